"""`fedmq bench secagg`: what SecAgg+'s cryptographic core (fedmq/secagg/) costs a client and the aggregator
for one round, against the plain arithmetic of the same round.

For each model length and cohort size m, one round is run in this process, message by message, as a protocol
layer would drive it (fedmq/secagg/masking.py): every client advertises its keys, shares them, quantizes and
masks its update (a uniform random vector in [-1, 1], clipped to c = 1); a fraction ``dropout`` of the cohort
vanishes after masking, and the server unmasks the survivors' sum. Measured per client (median over the
cohort): CPU seconds of its key rounds (advertise and share), of quantizing and of masking, and of answering
the unmasking request; its upload in payload bytes (public keys, encrypted shares and commitment, the masked
vector, its unmasking shares; names and framing not counted) against its update's raw fp32 bytes. Per server:
CPU seconds of collecting the shares, summing the masked vectors and unmasking (which re-expands the dropped
clients' pairwise masks and the survivors' self-masks), against summing the survivors' fp32 vectors (a FedAvg
fold's arithmetic, without its decode). k and t are ``graph.plan``'s for the cohort with ``corrupt`` and
``dropout`` fractions.

With a broker (``broker_rows``), the same model and m run as a job over RabbitMQ, plain and then under secure
aggregation: round time, the aggregator's CPU and a client's upload per round (services_run).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from fedmq.benchmarks.flower import period_median
from fedmq.benchmarks.load import TINY_TASK, _toml, tiny_job
from fedmq.benchmarks.population import start_services, wait_services
from fedmq.errors import FedmqError
from fedmq.secagg.graph import Cohort, plan
from fedmq.secagg.masking import MaskingClient, MaskingServer
from fedmq.secagg.quantize import Quantizer
from fedmq.secagg.shamir import SECRET_BYTES

# parameters of the two models the secure-aggregation goals name: GRU-small tied over WikiText-2's 33,278
# words, and the tiny language model of `fedmq bench load` (emb and hidden 16, 500 words)
MODELS = {"gru-small": 10_558_478, "tiny": 18_132}
SHARE_BYTES = 2 + SECRET_BYTES  # a share as it travels: its index and its data


def _cpu(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - t0


def one_round(
    length: int, m: int, dropout: float = 0.3, corrupt: float = 0.1, seed: int = 0
) -> dict[str, Any]:
    """One secure round of m clients over ``length`` coordinates (module docstring); its row."""
    names = [f"client-{i:05d}" for i in range(m)]
    params = plan(m, corrupt, dropout)
    quantizer = Quantizer.for_clients(m, 1.0)
    rng = np.random.default_rng(seed)
    context = f"bench/round-{seed}"
    cpu: dict[str, dict[str, float]] = {u: {} for u in names}
    sent: dict[str, int] = dict.fromkeys(names, 0)
    clients = {u: MaskingClient(u, context) for u in names}
    roster = {}
    for u, c in clients.items():
        roster[u], cpu[u]["keys"] = _cpu(c.advertise)
        sent[u] += len(roster[u].channel) + len(roster[u].mask)
    cohort = Cohort.build(names, params, os.urandom(32))
    server = MaskingServer(cohort, roster, context, length)
    server_cpu = {"shares": 0.0, "sum": 0.0, "unmask": 0.0}
    for u, c in clients.items():
        shared, spent = _cpu(c.share_keys, cohort, roster)
        cpu[u]["keys"] += spent
        sent[u] += sum(len(x) for x in shared.ciphertexts.values()) + len(shared.seed_commitment)
        _, spent = _cpu(server.receive_shares, u, shared)
        server_cpu["shares"] += spent
    dropped = set(names[: int(dropout * m)])
    plain = np.zeros(length, dtype=np.float32)
    survivors_sum = np.zeros(length, dtype=np.float64)  # to check the unmasked sum against
    plain_cpu = 0.0
    for u, c in clients.items():
        x = rng.uniform(-1.0, 1.0, length).astype(np.float32)
        if u not in dropped:  # the plain round's fold arithmetic, for the same survivors' vectors
            t0 = time.process_time()
            plain += x
            plain_cpu += time.process_time() - t0
        codes, cpu[u]["quantize"] = _cpu(quantizer.encode, x, rng)
        inbox, spent = _cpu(server.inbox, u)
        server_cpu["shares"] += spent
        y, cpu[u]["mask"] = _cpu(c.mask, codes, inbox)
        sent[u] += y.nbytes
        if u not in dropped:
            survivors_sum += x
            _, spent = _cpu(server.receive_masked, u, y)
            server_cpu["sum"] += spent
    request, spent = _cpu(server.unmask_request)
    server_cpu["unmask"] += spent
    for u in request.survivors:
        answer, cpu[u]["unmask"] = _cpu(clients[u].unmask, request)
        sent[u] += (len(answer.seeds) + len(answer.keys)) * SHARE_BYTES
        _, spent = _cpu(server.receive_unmask, u, answer)
        server_cpu["unmask"] += spent
    total, spent = _cpu(server.aggregate)
    server_cpu["unmask"] += spent
    survivors = list(request.survivors)
    error = float(np.abs(quantizer.decode_sum(total, len(survivors)) - survivors_sum).max())
    raw = 4 * length

    def median(phase: str, who: list[str]) -> float:
        return statistics.median(cpu[u].get(phase, 0.0) for u in who)

    return {
        "length": length,
        "m": m,
        "k": params.degree,
        "t": params.threshold,
        "bits": quantizer.bits,
        "dropped": len(dropped),
        "client_keys_s": median("keys", names),
        "client_quantize_s": median("quantize", names),
        "client_mask_s": median("mask", names),
        "client_unmask_s": median("unmask", survivors),
        "client_upload_bytes": statistics.median_low(sent[u] for u in survivors),
        "raw_bytes": raw,
        "server_shares_s": server_cpu["shares"],
        "server_sum_s": server_cpu["sum"],
        "server_unmask_s": server_cpu["unmask"],
        "plain_sum_s": plain_cpu,
        "sum_error": error,  # the unmasked sum against the survivors' plain sum, largest coordinate
        "error_bound": quantizer.error_bound(len(survivors)),
    }


def bench_secagg(
    models: tuple[str, ...] = ("tiny", "gru-small"),
    cohorts: tuple[int, ...] = (10, 100),
    dropout: float = 0.3,
) -> list[dict[str, Any]]:
    return [
        {"model": name, **one_round(MODELS[name], m, dropout=dropout)} for name in models for m in cohorts
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model (coordinates) | m | k, t | dropped | bits | client CPU s: keys, quantize, mask, unmask | "
        "client upload (÷ raw fp32) | server CPU s: shares, sum, unmask | plain sum | server ÷ plain | "
        "sum's error (bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        server = r["server_shares_s"] + r["server_sum_s"] + r["server_unmask_s"]
        extra = r["client_upload_bytes"] - r["raw_bytes"]
        lines.append(
            f"| {r['model']} ({r['length']:,}) | {r['m']} | {r['k']}, {r['t']} | {r['dropped']} | "
            f"{r['bits']} | "
            f"{r['client_keys_s']:.3f}, {r['client_quantize_s']:.3f}, {r['client_mask_s']:.3f}, "
            f"{r['client_unmask_s']:.3f} | {r['client_upload_bytes']:,} B "
            f"({r['client_upload_bytes'] / r['raw_bytes']:.3f}×; {extra:+,} B) | "
            f"{r['server_shares_s']:.3f}, {r['server_sum_s']:.3f}, {r['server_unmask_s']:.3f} | "
            f"{r['plain_sum_s']:.3f} s | {server / max(r['plain_sum_s'], 1e-9):.1f}× | "
            f"{r['sum_error']:.2e} ({r['error_bound']:.2e}) |"
        )
    return "\n".join(lines)


def _task(model: str, data: str) -> dict[str, Any]:
    """The task options of a round bench's model: the tiny language model, or GRU-small tied over ``data``'s
    vocabulary (10.6 M parameters over WikiText-2), validated on its first 200 lines."""
    if model == "tiny":
        return {k: v for k, v in TINY_TASK.items() if k != "max_lines"}
    return {"task": "lm", "data": data, "model": "gru-small", "max_eval_lines": 200}


def services_run(
    url: str, model: str, m: int, secagg: bool, rounds: int, hosts: int, data: str
) -> dict[str, Any]:
    """One job of ``rounds`` rounds of m clients (all selected) over RabbitMQ: ``fedmq aggregator run`` and
    ``hosts`` agent processes, plain (the default encoding, delta+bf16) or under secure aggregation. Per round
    after the first (joining): the median round time, the aggregator's CPU seconds and the bytes a client
    uploads; the hosts' CPU seconds per client and round (training included: the difference between the two
    modes is the protocol's); validation at the end."""
    from fedmq.aggregator.runlog import read_rounds
    from fedmq.broker.transport.provision import purge

    job = f"sa-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="fedmq-secagg-"))
    cfg = tiny_job(
        job,
        url,
        m,
        rounds,
        batch_size=4,
        report_deadline_s=900.0,
        update_deadline_s=900.0,
        secagg=secagg,
        secagg_clip=1.0,
    )
    (work / "job.toml").write_text(_toml(cfg, {**_task(model, data), "clients": m}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = start_services(url, work, job, m, hosts)
    t0 = time.time()
    wait_services(procs, job, t0, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        purge(url, job, [f"h{h}" for h in range(hosts)])
    except FedmqError as exc:  # a broker rabbitmqctl cannot reach: its queues stay, the numbers hold
        print(f"the job's queues were not removed: {exc}", file=sys.stderr)
    rows = [r for r in read_rounds(work / "state").records if not r.skipped]
    summary = json.loads((work / "state" / "summary.json").read_text())
    later = [r for r in rows if r.round > 1] or rows
    children = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "model": model,
        "m": m,
        "secagg": secagg,
        "rounds": len(rows),
        "s_per_round": period_median([r.time for r in rows if r.time is not None]),
        "aggregator_cpu_s": statistics.median(r.cpu_s or 0.0 for r in later) if later else None,
        "client_upload_bytes": statistics.median((r.bytes_up or 0) / max(len(r.received), 1) for r in later)
        if later
        else None,
        "raw_bytes": statistics.median((r.bytes_up_raw or 0) / max(len(r.received), 1) for r in later)
        if later
        else None,
        "host_cpu_s_per_client": (children - summary["cpu_s"]) / (m * max(rounds, 1)),
        "valid": summary.get("best_valid"),
        "exit_codes": [p.returncode for p in procs],
    }


def broker_rows(
    url: str,
    models: tuple[str, ...] = ("tiny", "gru-small"),
    cohorts: tuple[int, ...] = (10, 100),
    rounds: int = 3,
    hosts: int = 2,
    data: str = "wikitext-2",
) -> list[dict[str, Any]]:
    """For each model and m: the plain job, then the same job under secure aggregation (services_run)."""
    return [
        services_run(url, model, m, secagg, rounds, hosts, data)
        for model in models
        for m in cohorts
        for secagg in (False, True)
    ]


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def format_broker_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | m | mode | rounds | s/round (÷ plain) | aggregator CPU s/round (÷ plain) | "
        "client upload/round (÷ raw fp32) | hosts' CPU s per client-round | valid ppl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plain: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["model"], r["m"])
        if not r["secagg"]:
            plain[key] = r
        base = plain.get(key, r)

        def ratio(name: str, r: dict[str, Any] = r, base: dict[str, Any] = base) -> str:
            a, b = r[name], base[name]
            return f" ({a / b:.2f}×)" if r["secagg"] and a is not None and b else ""

        up, raw = r["client_upload_bytes"], r["raw_bytes"]
        lines.append(
            f"| {r['model']} | {r['m']} | {'secagg' if r['secagg'] else 'plain'} | {r['rounds']} | "
            f"{_num(r['s_per_round'], '.1f')}{ratio('s_per_round')} | "
            f"{_num(r['aggregator_cpu_s'], '.2f')}{ratio('aggregator_cpu_s')} | "
            f"{_num(up, ',.0f')} B ({_num(up / raw if up and raw else None, '.3f')}×) | "
            f"{r['host_cpu_s_per_client']:.2f} | {_num(r['valid'], '.1f')} |"
        )
    return "\n".join(lines)
