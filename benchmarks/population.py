"""`fedmq bench population`: what a round costs as the population and the cohort grow, and a population
over RabbitMQ.

Simulation: ``fedmq simulate`` at each K of ``populations`` and each cohort m of ``selected`` (m ≤ K) with the
round-cost settings of `fedmq bench flower` (GRU-small tied over the corpus's vocabulary, m clients a round,
one local step of batch 2 × BPTT 8), each run a process of its own: s/round is the median period between
round ends (rounds 2..R), memory the process's peak RSS (sampled every 0.2 s), queues the job's queues on the
broker at the end. Clients are virtual (client_agent.host): the ratios to the first run are what the bench is
for -- over K, that a population costs next to nothing; over m, that a round's memory does not grow with its
cohort (the aggregator holds one update at a time: aggregator.sync_round).

Services: ``clients`` clients over RabbitMQ, served by ``hosts`` ``fedmq agent run --host`` processes against
one ``fedmq aggregator run`` (with ``edges``, through that many ``--tier edge`` edge aggregators; the tiny
language model of `fedmq bench load`, ``selected`` clients a round, a run for each m): rounds completed,
uploads the hosts had confirmed by the broker (their audit logs) against the updates the aggregator folded
(its checkpoint): lost and duplicated; the job's queue count and RabbitMQ's memory (``rabbitmqctl``, when
this machine runs the broker), both at their peak during the run.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fedmq.benchmarks.flower import Run, Setting, period_median, run_fedmq
from fedmq.benchmarks.load import TINY_TASK, _toml, fedmq_command, one_thread_env, start_aggregator, tiny_job


def _name(k: int, m: int, cohorts: bool) -> str:
    return f"K = {k:,}, m = {m:,}" if cohorts else f"K = {k:,}"


def simulate_rows(
    data: str, populations: tuple[int, ...], selected: tuple[int, ...] = (10,), rounds: int = 5
) -> list[Run]:
    """A run for each population K and cohort m, K by K."""
    return [
        run_fedmq(_name(k, m, len(selected) > 1), Setting(data, k, m, rounds))
        for k in populations
        for m in selected
    ]


def cohort_lines(data: str, k: int, cohorts: list[tuple[int, Run]]) -> list[str]:
    """How s/round grows with the cohort m, against the round's physical limit (benchmarks/limit.py: the
    parts of this bench's round timed here on one core each): each run's s/round over its limit, and the
    growth per client between the smallest and the largest m against the per-client work (train, encode_up,
    decode_up, fold) spread over the cores. A growth per client near 1 × that work over the cores is linear
    in m at the machine's speed; the goal is ≤ 1.2 ×. ``cohorts``: (m, its run) in the order they ran."""
    from fedmq.benchmarks import limit

    timed = [(m, r.s_per_round, r.name) for m, r in cohorts if r.s_per_round]
    if len(timed) < 2:
        return []
    parts = limit.measure(data, k, timed[0][0])[0]
    per_client = sum(parts.parts[name] for name in limit.PER_CLIENT)
    lines = ["", parts.describe(), ""]
    for m, s, name in timed:
        bound = limit.Limit(parts.parts, m, parts.cores, parts.up, parts.down)
        ratio = s / bound.seconds
        lines.append(f"{name}: {s:.2f} s/round, limit {bound.seconds:.2f} s ({ratio:.2f} × the limit)")
    (m0, s0, _), (m1, s1, _) = min(timed), max(timed)
    if m1 > m0:
        growth, share = (s1 - s0) / (m1 - m0), per_client / parts.cores
        lines.append(
            f"growth from m = {m0:,} to {m1:,}: {growth:.3f} s a client; per-client work {per_client:.3f} "
            f"core-s over {parts.cores} cores = {share:.3f} s: {growth / share:.2f} × (goal ≤ 1.2 ×)"
        )
    return lines


def _rabbitmqctl(*args: str) -> str | None:
    try:
        out = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _broker_facts(job: str) -> tuple[int | None, int | None]:
    """(the job's queues, RabbitMQ's total memory in bytes) now; None where rabbitmqctl cannot tell."""
    names = _rabbitmqctl("list_queues", "-q", "--no-table-headers", "name")
    queues = None if names is None else sum(1 for q in names.split() if q.startswith(f"fedmq.{job}."))
    status = _rabbitmqctl("status", "--formatter", "json")
    try:
        memory = int(json.loads(status)["memory"]["total"]["rss"]) if status else None
    except (ValueError, KeyError, TypeError):
        memory = None
    return queues, memory


def start_services(
    url: str, work: Path, job: str, clients: int, hosts: int, edges: int = 0
) -> list[subprocess.Popen]:
    """The aggregator of the job in ``work``/job.toml and its ``edges`` edge aggregators, then ``hosts`` agent
    processes sharing its ``clients`` clients out, each with an audit log of the uploads the broker
    confirmed."""
    procs = [start_aggregator(url, work), *(start_aggregator(url, work, e) for e in range(edges))]
    per = -(-clients // hosts)
    for h in range(hosts):
        lo, hi = h * per, min((h + 1) * per, clients)
        procs.append(
            subprocess.Popen(
                fedmq_command(
                    "agent",
                    "run",
                    "--broker",
                    url,
                    "--config",
                    str(work / "job.toml"),
                    "--log-level",
                    "warning",
                    "--job",
                    job,
                    "--host",
                    f"h{h}",
                    "--clients",
                    f"{lo}-{hi - 1}",
                    "--audit-log",
                    str(work / f"h{h}.audit"),
                ),
                stdout=open(work / f"h{h}.out", "wb"),
                stderr=open(work / f"h{h}.err", "wb"),
                env=one_thread_env(),
            )
        )
    return procs


def _peak_rss(pid: int) -> int:
    """A live process's peak RSS so far in bytes (Linux's VmHWM; 0 where /proc cannot tell)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def wait_services(
    procs: list[subprocess.Popen], job: str, t0: float, timeout: float, aggregators: int = 1
) -> tuple[int, int, list[int]]:
    """Sample the broker and the aggregators (the first ``aggregators`` of ``procs``: the root and its edges)
    until every process exits (or ``timeout`` after ``t0``, then kill them): the job's peak queue count,
    RabbitMQ's peak memory (0 where rabbitmqctl cannot tell) and each aggregator's peak RSS as last seen (0
    where /proc cannot tell)."""
    peak_queues, peak_memory, rss = 0, 0, [0] * aggregators
    while any(p.poll() is None for p in procs) and time.time() - t0 < timeout:
        for i, p in enumerate(procs[:aggregators]):
            if p.poll() is None:  # not once it is reaped: its pid may be another process's by then
                rss[i] = max(rss[i], _peak_rss(p.pid))
        queues, memory = _broker_facts(job)
        peak_queues, peak_memory = max(peak_queues, queues or 0), max(peak_memory, memory or 0)
        time.sleep(2.0)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return peak_queues, peak_memory, rss


def services_row(
    url: str,
    clients: int = 10_000,
    hosts: int = 4,
    selected: int = 10,
    rounds: int = 5,
    timeout: float = 1800,
    edges: int = 0,
) -> dict[str, Any]:
    from fedmq.aggregator.checkpoint import load_checkpoint
    from fedmq.aggregator.runlog import read_rounds
    from fedmq.broker.transport.provision import purge

    job = f"pop-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="fedmq-population-"))
    # a round's deadlines: the hosts train the cohort in turn, a few ms a client
    deadline = max(120.0, 0.05 * selected)
    cfg = tiny_job(
        job,
        url,
        clients,
        rounds,
        fraction=selected / clients,
        batch_size=2,
        heartbeat_s=5.0,
        edges=edges,
        report_deadline_s=deadline,
        update_deadline_s=deadline,
    )
    task = {k: v for k, v in TINY_TASK.items() if k != "max_lines"}  # every builtin line: 11 words a client
    (work / "job.toml").write_text(_toml(cfg, {**task, "clients": clients}))
    _, memory_before = _broker_facts(job)
    procs = start_services(url, work, job, clients, hosts, edges)
    t0 = time.time()
    peak_queues, peak_memory, rss = wait_services(procs, job, t0, timeout, 1 + edges)
    aggregator_rss, edge_rss = rss[0], rss[1:]
    metrics = read_rounds(work / "state").records
    ckpt = load_checkpoint(work / "state" / "checkpoints")
    folded = [u for ids in (ckpt.folded.values() if ckpt else []) for u in ids]
    confirmed = [
        json.loads(line)
        for h in range(hosts)
        if (work / f"h{h}.audit").exists()
        for line in (work / f"h{h}.audit").read_text().splitlines()
    ]
    closed = {m.round for m in metrics}
    lost = [c for c in confirmed if c["update_id"] not in set(folded) and c["round"] in closed]
    purge(url, job, [f"h{h}" for h in range(hosts)])
    return {
        "clients": clients,
        "selected": selected,
        "hosts": hosts,
        "edges": edges,
        "edge_peak_mb": max(edge_rss) / 2**20 if edge_rss and min(edge_rss) else None,
        "rounds": len([m for m in metrics if not m.skipped]),
        "confirmed": len(confirmed),
        "folded": len(folded),
        "lost": len(lost),
        "duplicated": len(folded) - len(set(folded)),
        "queues": peak_queues or None,
        "rabbitmq_memory_mb": peak_memory / 2**20 if peak_memory else None,
        "rabbitmq_memory_before_mb": memory_before / 2**20 if memory_before else None,
        "aggregator_peak_mb": aggregator_rss / 2**20 if aggregator_rss else None,
        "s_per_round": period_median([m.time for m in metrics if m.time is not None]),
        "exit_codes": [p.returncode for p in procs],
        "wall_s": time.time() - t0,
    }


def format_table(runs: list[Run], services: list[dict[str, Any]]) -> str:
    base = runs[0] if runs else None
    lines = [
        "| run | s/round | × the first | peak memory | over the first | queues | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s, mem = run.s_per_round, run.peak_tree_gb
        ratio = f"{s / base.s_per_round:.2f}×" if s and base and base.s_per_round else "—"
        more = f"{(mem - base.peak_tree_gb) * 1000:+.0f} MB" if base else "—"
        lines.append(
            f"| {run.name} | {s:.2f} s | {ratio} | {mem * 1000:.0f} MB | {more} | "
            f"{run.summary.get('broker_queues', '—')} | {run.rounds}{' ' + run.note if run.note else ''} |"
            if s
            else f"| {run.name} | — | — | {mem * 1000:.0f} MB | — | — | {run.rounds} {run.note} |"
        )
    for s in services:
        mem = (
            f"{s['rabbitmq_memory_mb']:.0f} MB (the node's RSS; "
            f"{s['rabbitmq_memory_before_mb']:.0f} MB before)"
            if s["rabbitmq_memory_mb"] and s["rabbitmq_memory_before_mb"]
            else "not measured"
        )
        per = f"{s['s_per_round']:.2f} s/round" if s["s_per_round"] else "s/round not measured"
        agg = f"{s['aggregator_peak_mb']:.0f} MB" if s["aggregator_peak_mb"] else "not measured"
        if s.get("edges"):
            edge = f"{s['edge_peak_mb']:.0f} MB" if s["edge_peak_mb"] else "not measured"
            agg += f", through {s['edges']} edge aggregators (each at most {edge})"
        lines += [
            "",
            f"RabbitMQ: {s['clients']:,} clients ({s['selected']:,} a round) in {s['hosts']} agent "
            f"processes: {s['rounds']} rounds completed, "
            f"{s['confirmed']} uploads confirmed, {s['folded']} folded, {s['lost']} lost, {s['duplicated']} "
            f"duplicated; the job's queues at most {s['queues']}; RabbitMQ's memory at most {mem}; "
            f"the aggregator's peak RSS {agg}; "
            f"{per}; exit codes {s['exit_codes']}; {s['wall_s']:.0f} s in all",
        ]
    return "\n".join(lines)
