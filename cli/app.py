"""The `fedmq` command line (Typer). Every user error ends in one line on stderr and exit code 2."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any, Optional

import typer

from broker.errors import FedmqError

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode="rich",
                  help="fedmq: asynchronous federated learning over a message broker.")
aggregator_app = typer.Typer(no_args_is_help=True, help="The aggregator service.")
agent_app = typer.Typer(no_args_is_help=True, help="The client agent service.")
broker_app = typer.Typer(no_args_is_help=True, help="Broker topology, users and permissions.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results go to docs/benchmarks.md).")
app.add_typer(aggregator_app, name="aggregator")
app.add_typer(agent_app, name="agent")
app.add_typer(broker_app, name="broker")
app.add_typer(bench_app, name="bench")

LOG_LEVEL = typer.Option("info", "--log-level", help="debug | info | warning | error")


class UsageError(FedmqError):
    pass


def _setup_logs(level: str, fmt: str = "auto", file: Path | None = None) -> None:
    from cli.logs import configure
    try:
        configure(level, fmt, file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


DEFAULT_MODEL = {"lm": "gru-tiny", "nmt": "small"}


def _task_options(task: str, **options: Any) -> dict[str, Any]:
    """Task options from the CLI; None means "the task's default" (e.g. tied per model, clients per domain)."""
    options["model"] = options.get("model") or DEFAULT_MODEL.get(task)
    return {"task": task, **{k: v for k, v in options.items() if v is not None}}


def _tune_allocator() -> None:
    """Services and simulations move model-sized buffers all the time: let glibc reuse them (broker/_codec_malloc.py)."""
    from broker._codec_malloc import tune_allocator
    tune_allocator()


def _make_task(options: dict[str, Any]):
    from client_agent.tasks.registry import make_task
    opts = dict(options)
    return make_task(opts.pop("task"), **opts)


# --------------------------------------------------------------------------------------------- simulate
@app.command()
def simulate(
    task: str = typer.Option("lm", help="lm (language modelling) or nmt (German→English translation)"),
    data: str = typer.Option("builtin", help="corpus folder (wikitext-2, ptb, de-en/<domain>...) or 'builtin'"),
    model: Optional[str] = typer.Option(None, help="lm: gru-tiny (default)|gru-small|gru-medium|gru-large|lstm; nmt: tiny|mini|small (default)|base"),
    tied: Optional[bool] = typer.Option(None, "--tied/--untied", help="tie input and output embeddings (lm; default per model)"),
    clients: Optional[int] = typer.Option(None, "--clients", "-k", help="K, the number of agents (default 8; nmt natural: one per domain)"),
    fraction: float = typer.Option(0.5, "--fraction", "-c", help="C, the share of agents selected per round"),
    epochs: int = typer.Option(1, "--epochs", "-e", help="E, local epochs"),
    batch_size: int = typer.Option(20, "--batch-size", "-b", help="B, local batch size"),
    lr: float = typer.Option(20.0, help="client learning rate"),
    optimizer: str = typer.Option("sgd", help="sgd | adam"),
    momentum: float = typer.Option(0.0, help="SGD momentum"),
    max_steps: int = typer.Option(0, help="cap on local optimizer steps per round (0 = full epochs)"),
    strategy: str = typer.Option("fedavg", help="fedavg|fedsgd|fedatt|fedmed|dp-l|dp-g|dp-random|async"),
    eps: float = typer.Option(1.2, help="FedAtt step size ε"),
    norm: str = typer.Option("fro", help="FedAtt distance: fro | spectral"),
    loss_eps: float = typer.Option(0.1, help="FedMed loss-switch threshold ε"),
    beta: float = typer.Option(1.0, help="top-K share of reporting agents granted an upload (FedMed β)"),
    noise: float = typer.Option(0.0, help="randomization: agents add noise·N(0,1) before upload (FedAtt Eq. 6)"),
    pull_fraction: float = typer.Option(0.5, help="dynamic pulling: share of tensors sent (0.5 or 0.33)"),
    pull_down: bool = typer.Option(False, "--pull-down", help="dynamic pulling in both directions: the server pushes only the tensors its rule picks"),
    robust: str = typer.Option("none", help="guard against outlier updates: none | clip:NORM | trimmed:FRAC | median"),
    encoding: str = typer.Option("auto", help="uplink encoding (auto: delta+bf16, raw with --pull-down): raw|fp16|bf16|int8|int8-row|int4|int4-row|topk:D, prefix delta+, suffix @LEVEL (zstd, default 1)"),
    down_encoding: str = typer.Option("bf16", help="downlink encoding of the global model (raw|fp16|bf16|int8-row|int4-row, prefix delta+)"),
    rounds: int = typer.Option(8, "--rounds", "-r", help="communication rounds (async: global versions)"),
    min_clients: int = typer.Option(1, help="a round with fewer updates is closed as skipped"),
    availability: str = typer.Option("always", help="always | bernoulli:P | markov:A,B | trace:FILE"),
    faults: str = typer.Option("", help="crash-train:P,crash-grant:P,slow:P:SECONDS,cut:P"),
    report_deadline: float = typer.Option(300.0, help="seconds to wait for loss reports"),
    update_deadline: float = typer.Option(120.0, help="seconds to wait for granted uploads"),
    partition: str = typer.Option("iid", help="iid | dirichlet:ALPHA | natural"),
    vocab_size: int = typer.Option(0, help="cap the vocabulary to the N most frequent words (0 = all)"),
    max_lines: int = typer.Option(0, help="use only the first N training lines (0 = all)"),
    max_eval_lines: int = typer.Option(0, help="lm: evaluate on the first N lines of valid/test (0 = full split)"),
    domains: Optional[str] = typer.Option(None, help="nmt: comma-separated domain folders under --data"),
    eval_max_sentences: Optional[int] = typer.Option(None, help="nmt: sentences per BLEU evaluation (0 = full split)"),
    beam: Optional[int] = typer.Option(None, help="nmt: beam size for BLEU (1 = greedy)"),
    bptt: int = typer.Option(35, help="BPTT length (lm)"),
    dropout: float = typer.Option(0.2, help="dropout"),
    device: str = typer.Option("cpu", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, help="one seed for sampling, dropouts, shards and init"),
    broker: str = typer.Option("memory://sim", help="memory://NAME (in-process) or amqp://user:pass@host:5672/vhost"),
    out: Optional[Path] = typer.Option(None, help="run folder (default runs/<time>-<strategy>)"),
    resume: bool = typer.Option(False, help="continue the run in --out from its last checkpoint"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output (default when not a terminal)"),
    log_level: str = LOG_LEVEL,
) -> None:
    """Run a whole federation on this machine and report its scores.

    Examples:

      fedmq simulate                                   # ~2 min demo on Python's own docs, no download

      fedmq simulate --data ../shared/data/wikitext-2 --model gru-small --strategy fedatt --rounds 10

      fedmq simulate --strategy fedmed --beta 0.5 --availability bernoulli:0.8 --encoding delta+int8

      fedmq simulate --broker amqp://guest:guest@127.0.0.1:5672/%2F
    """
    from aggregator.config import JobConfig
    from cli.simulate import Simulation

    _tune_allocator()

    run_dir = out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy}"
    if resume and not (run_dir / "config.json").is_file():
        raise UsageError(f"--resume needs an existing run folder; {run_dir} has no config.json")
    interactive = sys.stderr.isatty() and not as_json
    _setup_logs(log_level if not interactive else "warning", "console" if interactive else "json",
                run_dir / "logs" / "simulate.jsonl")
    from broker.encodings import EncodingSpec
    EncodingSpec.parse("raw" if encoding == "auto" else encoding), EncodingSpec.parse(down_encoding)
    job = "sim" if broker.startswith("memory://") else f"sim-{uuid.uuid4().hex[:8]}"
    cfg = JobConfig(job=job, strategy=strategy, rounds=rounds, clients=clients or 1, fraction=fraction,
                    min_clients=min_clients, beta=beta, loss_eps=loss_eps, att_eps=eps, att_norm=norm, noise=noise,
                    pull_fraction=pull_fraction, pull_down=pull_down, encoding=encoding, down_encoding=down_encoding, epochs=epochs,
                    batch_size=batch_size, lr=lr, optimizer=optimizer, momentum=momentum, max_steps=max_steps,
                    report_deadline_s=report_deadline, update_deadline_s=update_deadline, heartbeat_s=1.0,
                    join_timeout_s=60.0, seed=seed, robust=robust)
    if clients is None and not (task == "nmt" and partition == "natural"):
        clients = 8
    task_obj = _make_task(_task_options(task, data=data, model=model, tied=tied, clients=clients, partition=partition,
                                        vocab_size=vocab_size, max_lines=max_lines, max_eval_lines=max_eval_lines,
                                        bptt=bptt, dropout=dropout, seed=seed, domains=domains,
                                        eval_max_sentences=eval_max_sentences, beam=beam))
    cfg.clients = task_obj.num_clients
    cfg.validate()
    from cli.progress import RoundProgress
    progress = RoundProgress(rounds, task_obj.metric, enabled=interactive)
    sim = Simulation(cfg, task_obj, broker, run_dir, availability=availability, faults=faults, device=device,
                     resume=resume, on_round=progress.update, on_local_progress=progress.local)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with progress:
        summary = sim.run(stop)
    summary["run_dir"] = str(run_dir)
    if interactive:
        progress.print_summary(summary, run_dir)
    else:
        typer.echo(json.dumps(summary, default=str))
    if summary.get("interrupted"):
        raise typer.Exit(130)


# --------------------------------------------------------------------------------------------- services
def _load_config_file(path: Optional[Path]) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise UsageError(f"config file {path} not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None


def _merge(file_values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Flags and FEDMQ_* environment variables (already folded in by Typer) override the config file."""
    merged = dict(file_values)
    merged.update({k: v for k, v in given.items() if v is not None})
    return merged


def _broker_url(url: str, user: Optional[str], password: Optional[str]) -> str:
    """Combine a URL with credentials from FEDMQ_BROKER_USER / FEDMQ_BROKER_PASSWORD (Kubernetes Secrets)."""
    if not user:
        return url
    import urllib.parse
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{urllib.parse.quote(user)}:{urllib.parse.quote(password or '')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@aggregator_app.command("run")
def aggregator_run(
    broker: str = typer.Option(..., envvar="FEDMQ_BROKER", help="amqp(s)://host:port/vhost"),
    job: Optional[str] = typer.Option(None, envvar="FEDMQ_JOB", help="job id"),
    config: Optional[Path] = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file: job keys, [task] table"),
    state_dir: Path = typer.Option(Path("fedmq-state"), envvar="FEDMQ_STATE_DIR", help="run folder: checkpoints, metrics"),
    strategy: Optional[str] = typer.Option(None, envvar="FEDMQ_STRATEGY"),
    rounds: Optional[int] = typer.Option(None, envvar="FEDMQ_ROUNDS"),
    clients: Optional[int] = typer.Option(None, envvar="FEDMQ_CLIENTS"),
    fraction: Optional[float] = typer.Option(None, envvar="FEDMQ_FRACTION"),
    user: Optional[str] = typer.Option(None, envvar="FEDMQ_BROKER_USER"),
    password: Optional[str] = typer.Option(None, envvar="FEDMQ_BROKER_PASSWORD"),
    metrics_port: int = typer.Option(0, envvar="FEDMQ_METRICS_PORT", help="serve /metrics, /healthz, /readyz (0 = off)"),
    chunk_limit: int = typer.Option(8 * 1024 * 1024, envvar="FEDMQ_CHUNK_LIMIT", help="split messages above this many bytes"),
    heartbeat: int = typer.Option(30, envvar="FEDMQ_HEARTBEAT", help="AMQP heartbeat in seconds"),
    log_format: str = typer.Option("json", envvar="FEDMQ_LOG_FORMAT", help="json | console"),
    log_level: str = LOG_LEVEL,
    print_config: bool = typer.Option(False, help="print the resolved, validated config as JSON and exit"),
) -> None:
    """Run the aggregator service until the job's rounds are done (resumes from --state-dir).

    Precedence: flags > FEDMQ_* environment variables > the --config file > defaults.

    Example: fedmq aggregator run --broker amqps://rabbit:5671/fedmq --job wt2 --config job.toml --state-dir /var/lib/fedmq
    """
    from aggregator.config import JobConfig
    from aggregator.engine import Engine

    _tune_allocator()
    from broker.connect import connect

    values = _load_config_file(config)
    task_opts = {"task": "lm", "data": "builtin", **values.pop("task", {})}
    cfg = JobConfig.from_dict(_merge(values, {"job": job, "strategy": strategy, "rounds": rounds,
                                              "clients": clients, "fraction": fraction}))
    task_opts.setdefault("clients", cfg.clients)
    if print_config:
        typer.echo(json.dumps({**cfg.to_dict(), "task": task_opts}, sort_keys=True))
        return
    _setup_logs(log_level, log_format, state_dir / "logs" / "aggregator.jsonl")
    task_obj = _make_task(task_opts)
    # a chunked update whose sender went silent this long (it died mid-upload) is dropped and its chunks rejected;
    # generous, because a publisher blocked by flow control is silent too and its update must still complete
    conn = connect(_broker_url(broker, user, password), chunk_limit=chunk_limit, heartbeat=heartbeat,
                   chunk_timeout_s=max(cfg.update_deadline_s, 300.0))
    from broker import topology
    telemetry = None
    if metrics_port:
        from cli.telemetry import Telemetry

        def live_status() -> dict[str, Any]:
            inbox = topology.q_inbox(cfg.job)
            return {**engine.status(), "broker": conn.status(), "queue_depths": {inbox: conn.queue_depth(inbox)}}
        telemetry = Telemetry(live_status, lambda: bool(conn.status().get("connected")))
    engine = Engine(conn, task_obj, cfg, state_dir, on_round=telemetry.observe_round if telemetry else None)
    if telemetry:
        telemetry.serve(metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: engine.stop.set())
    signal.signal(signal.SIGINT, lambda *_: engine.stop.set())
    try:
        summary = engine.run()
    finally:
        conn.close()
        if telemetry:
            telemetry.close()
    typer.echo(json.dumps(summary, default=str))


@agent_app.command("run")
def agent_run(
    broker: str = typer.Option(..., envvar="FEDMQ_BROKER", help="amqp(s)://host:port/vhost"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    client_id: Optional[str] = typer.Option(None, envvar="FEDMQ_CLIENT_ID", help="this agent's id and broker user"),
    client_id_from_hostname: bool = typer.Option(False, help="derive the id from a StatefulSet pod name (fedmq-agent-3 → agent-3)"),
    index: Optional[int] = typer.Option(None, envvar="FEDMQ_CLIENT_INDEX", help="shard index (default: the id's number)"),
    config: Optional[Path] = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file with a [task] table"),
    data: Optional[str] = typer.Option(None, envvar="FEDMQ_DATA", help="corpus folder"),
    device: str = typer.Option("auto", envvar="FEDMQ_DEVICE", help="auto | cpu | cuda"),
    availability: str = typer.Option("always", envvar="FEDMQ_AVAILABILITY", help="always|bernoulli:P|markov:A,B|trace:FILE"),
    faults: str = typer.Option("", envvar="FEDMQ_FAULTS"),
    user: Optional[str] = typer.Option(None, envvar="FEDMQ_BROKER_USER"),
    password: Optional[str] = typer.Option(None, envvar="FEDMQ_BROKER_PASSWORD"),
    seed: int = typer.Option(0, envvar="FEDMQ_SEED"),
    metrics_port: int = typer.Option(0, envvar="FEDMQ_METRICS_PORT"),
    chunk_limit: int = typer.Option(8 * 1024 * 1024, envvar="FEDMQ_CHUNK_LIMIT", help="split messages above this many bytes"),
    heartbeat: int = typer.Option(30, envvar="FEDMQ_HEARTBEAT", help="AMQP heartbeat in seconds"),
    audit_log: Optional[Path] = typer.Option(None, envvar="FEDMQ_AUDIT_LOG",
                                             help="append one JSON line per broker-confirmed upload (fault audits)"),
    log_format: str = typer.Option("json", envvar="FEDMQ_LOG_FORMAT"),
    log_level: str = LOG_LEVEL,
) -> None:
    """Run one client agent: join the job, train on its shard, upload when granted, repeat.

    Example: fedmq agent run --broker amqps://rabbit:5671/fedmq --job wt2 --client-id agent-3 --data /data --device cuda
    """
    import socket

    from broker.connect import connect
    from client_agent.agent import Agent
    from client_agent.availability import parse_availability, parse_faults

    _tune_allocator()

    _setup_logs(log_level, log_format)
    if client_id_from_hostname:
        host = socket.gethostname()
        client_id = "agent-" + host.rsplit("-", 1)[-1] if host.rsplit("-", 1)[-1].isdigit() else None
        if client_id is None:
            raise UsageError(f"hostname {host!r} does not end in a pod ordinal (-N)")
    if not client_id:
        raise UsageError("give --client-id (or FEDMQ_CLIENT_ID, or --client-id-from-hostname)")
    if index is None:
        tail = client_id.rsplit("-", 1)[-1]
        if not tail.isdigit():
            raise UsageError(f"cannot derive a shard index from {client_id!r}; give --index")
        index = int(tail)
    values = _load_config_file(config)
    task_opts = {"task": "lm", "data": "builtin", "seed": seed, **values.get("task", {})}
    if data:
        task_opts["data"] = data
    task_opts.setdefault("clients", values.get("clients", index + 1))
    task_obj = _make_task(task_opts)
    url = _broker_url(broker, user, password)
    agent = Agent(lambda: connect(url, chunk_limit=chunk_limit, heartbeat=heartbeat), job, client_id, index, task_obj,
                  availability=parse_availability(availability, seed), faults=parse_faults(faults, seed),
                  device=device, seed=seed, audit_log=audit_log)
    telemetry = None
    if metrics_port:
        from cli.telemetry import Telemetry
        telemetry = Telemetry(lambda: {"client": client_id, "version": agent.version,
                                       "rounds_trained": len(agent.log.rounds_trained),
                                       "uploads": len(agent.log.uploads)},
                              lambda: agent.connected)
        telemetry.serve(metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    try:
        agent.run()
    finally:
        if telemetry:
            telemetry.close()


# --------------------------------------------------------------------------------------------- broker
@broker_app.command("provision")
def broker_provision(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    vhost: str = typer.Option("fedmq", help="virtual host to create"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    agents: int = typer.Option(..., help="number of agents (users agent-0 … agent-N-1)"),
    secrets_out: Optional[str] = typer.Option(None, help="write Kubernetes Secret manifests to DIR, or - for stdout"),
    credentials_out: Optional[Path] = typer.Option(None, help="write a JSON credentials file"),
    namespace: str = typer.Option("fedmq", help="namespace of the Secrets"),
    remove_guest: bool = typer.Option(False, help="delete the guest user (production)"),
) -> None:
    """Create (idempotently) the vhost, the aggregator user and one user per agent with least-privilege permissions.

    Example: fedmq broker provision --job wt2 --agents 10 --secrets-out - | kubectl apply -f -
    """
    from broker import provision
    provision.provision_cli(broker=broker, vhost=vhost, job=job, agents=agents, secrets_out=secrets_out,
                            credentials_out=credentials_out, namespace=namespace, remove_guest=remove_guest)


@broker_app.command("check")
def broker_check(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: Optional[str] = typer.Option(None, envvar="FEDMQ_JOB"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Is the broker reachable? Its version, max message size and the job's queue depths.

    Example: fedmq broker check --job wt2
    """
    from broker import provision
    info = provision.check(broker, job)
    typer.echo(json.dumps(info, default=str) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


@broker_app.command("purge")
def broker_purge(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
) -> None:
    """Delete the job's queues.  Example: fedmq broker purge --job wt2"""
    from broker import provision
    provision.purge(broker, job)
    typer.echo(f"purged job {job}")


# --------------------------------------------------------------------------------------------- status, report
@app.command()
def status(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    run_dir: Optional[Path] = typer.Option(None, help="the aggregator's run folder, for round and metrics"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The job seen from outside: round, agents, last metrics, queue depths, standby aggregator.

    Example: fedmq status --job wt2 --run-dir /var/lib/fedmq
    """
    from cli.status_info import gather
    info = gather(broker, job, run_dir)
    from cli import status as status_view
    typer.echo(status_view.status_json(info) if as_json else status_view.render_status(info))


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="one or more run folders"),
    out: Optional[Path] = typer.Option(None, help="output folder (default: RUN_DIR/report)"),
) -> None:
    """Plots and tables of one or several runs: PNG files, one self-contained HTML page, a markdown table.

    Example: fedmq report runs/fedavg runs/fedatt --out runs/compare
    """
    from cli.report import run_report
    typer.echo(run_report(list(run_dirs), out).describe())


# --------------------------------------------------------------------------------------------- bench
def _bench(module: str, fn: str, **kw: Any) -> None:
    import importlib
    mod = importlib.import_module(f"benchmarks.{module}")
    rows = getattr(mod, fn)(**kw)
    typer.echo(mod.format_table(rows))


@bench_app.command("codec")
def bench_codec(repeats: int = 5, quick: bool = False) -> None:
    """Encode/decode MB/s and compression ratio per encoding vs torch.save and msgpack.

    Example: fedmq bench codec --quick
    """
    _bench("codec", "bench_codec", repeats=repeats, quick=quick)


@bench_app.command("broker")
def bench_broker(url: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F"), repeats: int = 3) -> None:
    """Publish/consume MB/s of 1, 10, 100 MB updates: fedmq vs raw pika vs the in-process broker.

    Example: fedmq bench broker --repeats 3
    """
    _bench("broker", "bench_broker", url=url, repeats=repeats)


@bench_app.command("aggregate")
def bench_aggregate(repeats: int = typer.Option(3, min=1, help="run the methods in turn this many times; medians")) -> None:
    """Streaming aggregation GB/s and peak RSS for 10, 50, 200 updates of a 25M-parameter model.

    Example: fedmq bench aggregate --repeats 3
    """
    _bench("aggregate", "bench_aggregate", repeats=repeats)


@bench_app.command("train")
def bench_train(quick: bool = False) -> None:
    """Local training tokens/s for GRU-small, LSTM and the small Transformer on CPU.

    Example: fedmq bench train --quick
    """
    _bench("train", "bench_train", quick=quick)


@bench_app.command("flower")
def bench_flower(data: Path = typer.Option(Path("../shared/data/wikitext-2"), help="corpus folder (full vocabulary)"),
                 clients: int = typer.Option(100, "--clients", "-k", min=1, help="K"),
                 selected: int = typer.Option(10, min=1, help="clients that train per round (C = selected / K)"),
                 rounds: int = typer.Option(5, "--rounds", "-r", min=2, help="rounds; medians over rounds 2..R"),
                 scale: str = typer.Option("", help="also fedmq at these K, comma-separated (e.g. 10,100,1000)"),
                 flower_python: Optional[Path] = typer.Option(None, help="python of the venv with the bench extra "
                                                                  "(default .fedmq-cache/flower-venv/bin/python)"),
                 flower: bool = typer.Option(True, "--flower/--no-flower", help="run the Flower side")) -> None:
    """fedmq vs Flower 1.41 on the FedAtt setting: s/round, wire bytes/round, peak memory; fedmq's scaling in K.

    Example: fedmq bench flower --data ../shared/data/wikitext-2 -k 100 --selected 10 -r 5 --scale 10,1000
    """
    from benchmarks import flower as fl
    if not data.is_dir():
        raise UsageError(f"--data {data} is not a folder")
    try:
        ks = tuple(int(k) for k in scale.split(",") if k.strip())
    except ValueError:
        raise UsageError(f"--scale wants comma-separated whole numbers, got {scale!r}") from None
    if selected > clients or any(k < selected for k in ks):
        raise UsageError("--selected must not exceed K")
    runs = fl.bench_flower(str(data), clients, selected, rounds, ks, flower_python or fl.DEFAULT_FLOWER_PYTHON, flower)
    typer.echo(fl.format_table(runs))


@app.command()
def experiment(
    name: str = typer.Argument(..., help="table2|fraction|rounds-to-target|topk|randomization|scale|dropout|nmt-domains"),
    scale: str = typer.Option("cpu", help="smoke (CI) | cpu (minutes on 2 cores) | paper (the papers' settings, GPU)"),
    out: Path = typer.Option(Path("runs/experiments"), help="results go to OUT/NAME (run folders, results.md, report/)"),
    seed: int = typer.Option(0, help="one seed for sampling, shards and init"),
    threads: int = typer.Option(1, help="torch intra-op threads"),
    log_level: str = LOG_LEVEL,
) -> None:
    """Reproduce a seed paper's experiment (docs/results.md).  Example: fedmq experiment table2 --scale cpu"""
    from benchmarks import experiments
    experiments.check_args(name, scale, threads)
    _setup_logs(log_level, "json", out / name / "experiment.jsonl")
    experiments.run_experiment(name, scale, out, seed, threads)
    typer.echo((out / name / "results.md").read_text())


@bench_app.command("load")
def bench_load(url: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F"),
               agents: str = typer.Option("100,1000", help="comma-separated agent counts"),
               rounds: int = 3, threads: int = typer.Option(4, help="swarm connections (agents are shared out)")) -> None:
    """N lightweight agents vs a real aggregator: updates/s, upload→inclusion p50/p99, aggregator RSS/CPU, lost.

    Example: fedmq bench load --agents 100,1000 --rounds 3
    """
    try:
        counts = tuple(int(a) for a in agents.split(",") if a.strip())
    except ValueError:
        raise UsageError(f"--agents wants comma-separated whole numbers, got {agents!r}") from None
    if not counts or min(counts) < 1 or rounds < 1 or threads < 1:
        raise UsageError("--agents, --rounds and --threads must be positive")
    _bench("load", "bench_load", url=url, agents=counts, rounds=rounds, threads=threads)


def main() -> None:
    """Console entry point: user errors become one line on stderr, never a traceback."""
    from cli.logs import configure
    configure("warning")  # commands that log (simulate, services) configure their own level and format
    try:
        code = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising it
        if isinstance(code, int) and code:
            sys.exit(code)
    except FedmqError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except Exception as exc:  # usage errors of typer's bundled click: they know how to show themselves
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
