"""The `fedmq` command line (Typer). Every user error ends in one line on stderr and exit code 2."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from fedmq.aggregator.config import STRATEGIES, JobConfig, JobFile, read_job_file
from fedmq.cli.errors import Stopped, UsageError
from fedmq.cli.help import HelpCommand, HelpGroup
from fedmq.errors import FedmqError
from fedmq.tasks.catalog import MIN_COUNT, MODELS

app = typer.Typer(
    cls=HelpGroup,
    add_completion=True,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="fedmq: asynchronous federated learning over a message broker.",
)
aggregator_app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="The aggregator service.")
agent_app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="The client agent service.")
broker_app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="Broker topology, users and permissions.")
bench_app = typer.Typer(
    cls=HelpGroup, no_args_is_help=True, help="Benchmarks (results go to docs/benchmarks.md)."
)
app.add_typer(aggregator_app, name="aggregator")
app.add_typer(agent_app, name="agent")
app.add_typer(broker_app, name="broker")
app.add_typer(bench_app, name="bench")

JOB = JobConfig()  # a job's defaults: the flags that set JobConfig fields take theirs from it
LOG_LEVEL = typer.Option("info", "--log-level", help="debug | info | warning | error")
CONSUME_TIMEOUT = typer.Option(
    20.0,
    envvar="FEDMQ_CONSUME_TIMEOUT",
    help="seconds RabbitMQ may take to confirm a subscription before the queue counts as "
    "broken (a zombie quorum queue): the service then stops with one line",
)


def _setup_logs(
    level: str, fmt: str = "auto", file: Path | None = None, console_level: str | None = None
) -> None:
    from fedmq.cli.logs import configure

    try:
        configure(level, fmt, file, console_level)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _prepare_process() -> None:
    """For a process that serves or simulates: it moves model-sized buffers all the time, so glibc may reuse
    them (broker/wire/malloc.py); it trains, so torch's optimizers leave torch._dynamo unloaded
    (fedmq/tasks/lazy_dynamo.py: ~1.8 s of CPU at every start)."""
    from fedmq.broker.wire.malloc import tune_allocator
    from fedmq.tasks import lazy_dynamo

    tune_allocator()
    lazy_dynamo.defer()


def _stop_on_signals(service: Callable[[], Any], running: Callable[[Any], bool]) -> None:
    """SIGTERM / SIGINT set the service's ``stop``: a running service ends its step and leaves cleanly. While
    it is not running yet, or an agent is rejoining (connecting, declaring, subscribing: waits a broker may
    never answer), the process leaves at once."""

    def handler(signum: int, _frame: Any) -> None:
        svc = service()
        if svc is not None:
            svc.stop.set()
        if svc is None or not running(svc):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Stopped(f"stopped by {signal.Signals(signum).name} while connecting")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _stop_agent_on_signals(agent_of: Callable[[], Any], grace_s: float, hosted: bool = False) -> None:
    """SIGTERM / SIGINT to a joined agent (as Kubernetes sends before it kills a pod): the agent finishes the
    local training and the upload under way, leaves the job (presence offline) and the process exits 0. At
    most ``grace_s`` seconds: past it, or on a second signal, or while the agent is not joined (connecting,
    rejoining), the process exits at once (143 after SIGTERM, 130 after SIGINT); its local training stops
    at its next step first, so that nothing is left inside torch when the process exits.

    A host (``hosted``: client_agent.host.Host) cannot finish its clients' rounds under way: it stops their
    local training at its next step and leaves the job at once, offline for all its clients (the aggregator
    then waits for none of them), within the same bounds."""
    first: list[int] = []
    expired = threading.Event()

    def joined(svc: Any) -> bool:
        return bool(svc.connected)

    def at_once(signum: int, why: str) -> None:
        svc = agent_of()
        if svc is not None:
            svc.stop.set()
            svc.trainers.close()
            svc.trainers.wait_idle(5.0)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(why)

    def expire(signum: int) -> None:
        expired.set()
        os.kill(os.getpid(), signum)

    def handler(signum: int, _frame: Any) -> None:
        svc = agent_of()
        name = signal.Signals(signum).name
        if svc is None or not joined(svc):
            at_once(signum, f"stopped by {name} while connecting")
        if expired.is_set():
            at_once(
                signum, f"stopped by {name}: the round under way took more than {grace_s:g} s (--stop-grace)"
            )
        if first:
            at_once(signum, f"stopped by a second {name}")
        first.append(signum)
        if hosted:
            svc.stop.set()
            svc.trainers.close()
            typer.echo(
                f"{name}: leaving the job (at most {grace_s:g} s); rounds under way are dropped", err=True
            )
        else:
            # the round under way ends (a grant it waits for included: client_agent.agent.Agent.finish_round)
            svc.finish_round = True
            svc.stop.set()
            typer.echo(
                f"{name}: finishing the round under way (at most {grace_s:g} s), then leaving the job",
                err=True,
            )
        timer = threading.Timer(grace_s, expire, args=(signum,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _make_task(options: dict[str, Any]):
    from fedmq.tasks.registry import make_task

    opts = dict(options)
    return make_task(opts.pop("task"), **opts)


# --------------------------------------------------------------------------------------------- simulate
TASK, STRATEGY, TRAIN, WIRE, AVAIL, RUN = (
    "Task and data",
    "Strategy",
    "Local training",
    "Wire",
    "Availability and faults",
    "Run",
)
# broker.wire.encodings.EncodingSpec
ENCODINGS = "raw, fp16, bf16, int8, int6, int5, int4 (each also -row), topk:DENSITY"


def _opt(default: Any, *names: str, panel: str, metavar: str | None = None, help: str = "") -> Any:
    return typer.Option(default, *names, rich_help_panel=panel, metavar=metavar, help=help)


@app.command(cls=HelpCommand)
def simulate(
    ctx: typer.Context,
    task: str = _opt(
        "lm",
        panel=TASK,
        metavar="TASK",
        help="lm (language modelling), nmt (German→English) or your own package.module:Class",
    ),
    data: str = _opt(
        "builtin",
        panel=TASK,
        metavar="PATH",
        help="corpus folder, a corpus name in $FEDMQ_DATA_DIR (~/.cache/fedmq/data), "
        "or builtin (Python's docs; lm only)",
    ),
    model: str | None = _opt(
        None,
        panel=TASK,
        metavar="NAME",
        help=f"lm: {', '.join(MODELS['lm'])} (default gru-tiny); "
        f"nmt: {', '.join(MODELS['nmt'])} (default small)",
    ),
    tied: bool | None = _opt(
        None, "--tied/--untied", panel=TASK, help="tie input and output embeddings (lm; default per model)"
    ),
    partition: str = _opt("iid", panel=TASK, metavar="SPEC", help="iid, dirichlet:ALPHA or natural"),
    vocab_size: int = _opt(0, panel=TASK, metavar="N", help="keep the N commonest words (0 = all)"),
    min_count: int = _opt(MIN_COUNT, panel=TASK, metavar="N", help="lm: words seen < N times become <unk>"),
    max_lines: int = _opt(0, panel=TASK, metavar="N", help="use only the first N training lines (0 = all)"),
    max_eval_lines: int = _opt(
        0, panel=TASK, metavar="N", help="lm: evaluate on the first N lines of valid/test (0 = all)"
    ),
    bptt: int = _opt(35, panel=TASK, metavar="N", help="lm: BPTT length"),
    dropout: float = _opt(0.2, panel=TASK, metavar="P", help="dropout"),
    domains: str | None = _opt(
        None, panel=TASK, metavar="A,B,...", help="nmt: comma-separated domain folders under --data"
    ),
    eval_max_sentences: int | None = _opt(
        None, panel=TASK, metavar="N", help="nmt: sentences per BLEU evaluation (0 = all)"
    ),
    beam: int | None = _opt(None, panel=TASK, metavar="N", help="nmt: beam size for BLEU (1 = greedy)"),
    clients: int | None = _opt(
        None,
        "--clients",
        "-k",
        panel=STRATEGY,
        metavar="K",
        help="agents (default 8; natural partition: one per domain or document); "
        "capped by host threads/memory",
    ),
    fraction: float = _opt(
        JOB.fraction,
        "--fraction",
        "-c",
        panel=STRATEGY,
        metavar="C",
        help="share of agents selected per round",
    ),
    rounds: int = _opt(
        8, "--rounds", "-r", panel=STRATEGY, metavar="N", help="communication rounds (async: global versions)"
    ),
    strategy: str = _opt(
        "fedavg",
        panel=STRATEGY,
        metavar="NAME",
        help=", ".join(STRATEGIES) + " or package.module:Class",
    ),
    strategy_arg: list[str] | None = _opt(
        None,
        "--strategy-arg",
        panel=STRATEGY,
        metavar="KEY=VALUE",
        help="a strategy parameter, repeatable: mu=0.01",
    ),
    eps: float | None = _opt(None, panel=STRATEGY, metavar="EPS", help="FedAtt step size ε"),
    norm: str | None = _opt(None, panel=STRATEGY, metavar="NORM", help="FedAtt distance: fro or spectral"),
    loss_eps: float = _opt(
        JOB.loss_eps, panel=STRATEGY, metavar="EPS", help="FedMed loss-switch threshold ε"
    ),
    beta: float = _opt(
        JOB.beta,
        panel=STRATEGY,
        metavar="BETA",
        help="top-K share of reporting agents granted an upload (FedMed β)",
    ),
    noise: float = _opt(
        JOB.noise,
        panel=STRATEGY,
        metavar="SIGMA",
        help="agents add noise·N(0,1) before upload (FedAtt randomization)",
    ),
    pull_fraction: float = _opt(
        JOB.pull_fraction,
        panel=STRATEGY,
        metavar="F",
        help="dynamic pulling: share of tensors sent (0.5 or 0.33)",
    ),
    pull_down: bool = _opt(
        JOB.pull_down,
        "--pull-down",
        panel=STRATEGY,
        help="pull both ways; raw uploads (no shared delta base): 4 B/param, FedAvg 2; saves below 0.5",
    ),
    robust: str = _opt(
        JOB.robust,
        panel=STRATEGY,
        metavar="GUARD",
        help="outlier guard: none, clip:NORM, trimmed:FRAC or median",
    ),
    min_clients: int = _opt(
        JOB.min_clients, panel=STRATEGY, metavar="N", help="skip a round with fewer updates"
    ),
    max_samples_factor: float = _opt(
        JOB.max_samples_factor,
        panel=STRATEGY,
        metavar="F",
        help="influence guard: weight n_k ≤ F × the round's median n_k (0 = off)",
    ),
    epochs: int = _opt(JOB.epochs, "--epochs", "-e", panel=TRAIN, metavar="E", help="local epochs"),
    batch_size: int = _opt(
        JOB.batch_size, "--batch-size", "-b", panel=TRAIN, metavar="B", help="local batch size"
    ),
    lr: float = _opt(JOB.lr, panel=TRAIN, metavar="LR", help="client learning rate"),
    optimizer: str = _opt(JOB.optimizer, panel=TRAIN, metavar="NAME", help="sgd or adam"),
    momentum: float = _opt(JOB.momentum, panel=TRAIN, metavar="M", help="SGD momentum"),
    round_lr_decay: float = _opt(
        JOB.round_lr_decay,
        panel=TRAIN,
        metavar="D",
        help="lr × D^(r−1) in round r (1 = constant)",
    ),
    lr_anneal: float = _opt(
        JOB.lr_anneal,
        panel=TRAIN,
        metavar="F",
        help="lr ÷ F after a round that did not improve validation (1 = off)",
    ),
    max_steps: int = _opt(
        JOB.max_steps, panel=TRAIN, metavar="N", help="cap on local optimizer steps per round (0 = none)"
    ),
    encoding: str = _opt(
        "auto",
        panel=WIRE,
        metavar="SPEC",
        help=f"uplink: auto (delta+bf16; raw with --pull-down) or one of {ENCODINGS}; "
        "prefix delta+, suffix @LEVEL (zstd level, default 1)",
    ),
    down_encoding: str = _opt(
        JOB.down_encoding,
        panel=WIRE,
        metavar="SPEC",
        help="downlink (the global model): raw, fp16, bf16, int8-row, int6-row, int5-row or int4-row; "
        "prefix delta+",
    ),
    broker: str = _opt(
        "memory://sim",
        panel=WIRE,
        metavar="URL",
        help="memory://NAME (in-process) or amqp://USER:PASS@HOST:5672/VHOST",
    ),
    availability: str = _opt(
        "always", panel=AVAIL, metavar="SPEC", help="always, bernoulli:P, markov:A,B or trace:FILE"
    ),
    faults: str = _opt(
        "",
        panel=AVAIL,
        metavar="LIST",
        help="comma-separated: crash-train:P, crash-grant:P, slow:P:SECONDS, cut:P",
    ),
    report_deadline: float = _opt(
        JOB.report_deadline_s, panel=AVAIL, metavar="S", help="seconds to wait for loss reports"
    ),
    update_deadline: float = _opt(
        JOB.update_deadline_s, panel=AVAIL, metavar="S", help="seconds to wait for granted uploads"
    ),
    config: Path | None = _opt(
        None,
        panel=RUN,
        metavar="FILE",
        help="TOML job file (JobConfig keys, a [task] table, as for aggregator run); flags override it",
    ),
    out: Path | None = _opt(
        None, panel=RUN, metavar="DIR", help="run folder, new or empty (default runs/TIME-STRATEGY)"
    ),
    resume: bool = _opt(
        False,
        "--resume",
        panel=RUN,
        help="continue the run in --out with its saved options (--rounds may extend it)",
    ),
    keep_queues: bool = _opt(
        False,
        "--keep-queues",
        panel=RUN,
        help="over RabbitMQ: keep the job's queues after the run (default: delete them)",
    ),
    device: str = _opt("cpu", panel=RUN, metavar="DEVICE", help="auto, cpu, cuda or cuda:N"),
    cohort: bool = _opt(
        False,
        "--cohort",
        panel=RUN,
        help="train a round's clients as one batched model (LM, SGD; for a GPU); "
        "the report deadline is then per client",
    ),
    seed: int = _opt(
        JOB.seed, panel=RUN, metavar="N", help="one seed for sampling, dropouts, shards and init"
    ),
    as_json: bool = _opt(
        False, "--json", panel=RUN, help="machine-readable output (default when not a terminal)"
    ),
    log_level: str = _opt(
        "info", "--log-level", panel=RUN, metavar="LEVEL", help="debug, info, warning or error"
    ),
    metrics_port: int = _opt(
        0,
        panel=RUN,
        metavar="PORT",
        help="serve /metrics, /healthz, /readyz and /status while it runs (0 = off)",
    ),
) -> None:
    """Run a whole federation on this machine and report its scores.

    Options come from the flags' defaults, then --config FILE, then the flags
    given. --resume takes the run's saved options and refuses different ones.

    Examples:

    \b
      fedmq simulate                    # ~2 min demo on Python's docs
      fedmq simulate --data DIR --model gru-small --strategy fedatt -r 10
      fedmq simulate --strategy fedmed --beta 0.5 --encoding delta+int8
      fedmq simulate --config job.toml --rounds 20 --out runs/a
      fedmq simulate --out runs/a --resume --rounds 30
      fedmq simulate --broker amqp://guest:guest@127.0.0.1:5672/%2F
    """
    from fedmq.cli import run_folder
    from fedmq.cli.simulate_options import from_context, saved_options

    if resume and out is None:
        raise UsageError("--resume needs --out RUN_FOLDER, the run to continue")
    saved = run_folder.check(out, True) if resume else None
    plan = from_context(ctx, simulate, saved_options(saved) if saved is not None else None)
    run_dir = out or run_folder.default_dir(plan.options["strategy"])
    if not resume:
        run_folder.check(run_dir, False)
    telemetry = (
        _serve_metrics(metrics_port) if metrics_port else None
    )  # a taken port: one line, no folder made
    discard = run_folder.create(run_dir)
    try:
        code = _simulate(plan, run_dir, resume, as_json, log_level, keep_queues, telemetry)
    except BaseException:
        discard()
        raise
    finally:
        if telemetry:
            telemetry.close()
    if code:
        discard()
        raise typer.Exit(code)


def _serve_metrics(port: int) -> Any:
    """`simulate --metrics-port`: the endpoint `aggregator run --metrics-port` serves; it reports "starting"
    (not ready) until ``_simulate`` points it at the simulation."""
    from fedmq.cli.telemetry import Telemetry

    telemetry = Telemetry(lambda: {"phase": "starting"}, lambda: False)
    try:
        telemetry.serve(port)
    except OSError as exc:
        raise UsageError(f"--metrics-port {port}: cannot listen there: {exc.strerror or exc}") from None
    return telemetry


def _simulate(
    plan: Any,
    run_dir: Path,
    resume: bool,
    as_json: bool,
    log_level: str,
    keep_queues: bool,
    telemetry: Any = None,
) -> int:
    """Run the validated plan in ``run_dir``; the exit code (130: interrupted)."""
    interactive = sys.stderr.isatty() and not as_json
    _setup_logs(  # at a terminal the progress bars replace the info lines; the run's log file keeps them
        log_level,
        "console" if interactive else "json",
        run_dir / "logs" / "simulate.jsonl",
        console_level="warning" if interactive else None,
    )
    _prepare_process()  # the first torch import
    from fedmq.tasks.training import resolve_device

    opts, cfg = plan.options, plan.job
    resolve_device(opts["device"])  # --device cuda without a GPU: one line, before any agent starts
    from fedmq.cli import run_folder
    from fedmq.cli.progress import RoundProgress
    from fedmq.simulation import Simulation

    task_obj = _make_task(plan.task)
    if resume:
        run_folder.check_checkpoint_fits(run_dir, task_obj, cfg.seed)
    cfg = dataclasses.replace(cfg, clients=task_obj.num_clients)  # nmt natural: one client per domain
    over_rabbit = not opts["broker"].startswith("memory://")
    job_line = f"job {cfg.job}" + (f" (fedmq status --job {cfg.job})" if over_rabbit else "")
    progress = RoundProgress(cfg.rounds, task_obj.metric, enabled=interactive)

    def on_round(row: dict[str, Any]) -> None:
        progress.update(row)
        if telemetry:
            telemetry.observe_round(row)

    sim = Simulation(
        cfg,
        task_obj,
        opts["broker"],
        run_dir,
        availability=opts["availability"],
        faults=opts["faults"],
        device=opts["device"],
        cohort=opts["cohort"],
        resume=resume,
        keep_queues=keep_queues,
        on_round=on_round,
        on_local_progress=progress.local,
        on_start=lambda: typer.echo(job_line, err=True),
    )
    if telemetry:
        telemetry.status, telemetry.ready = sim.status, lambda: sim.engine is not None
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with progress:
        summary = sim.run(stop)
    summary["run_dir"] = str(run_dir)
    if interactive:
        progress.print_summary(summary, run_dir)
    else:
        typer.echo(json.dumps(summary, default=str))
    return 130 if summary.get("interrupted") else 0


# --------------------------------------------------------------------------------------------- services
def _job_file(path: Path | None) -> JobFile:
    """The --config job file (aggregator.config.read_job_file), or an empty one."""
    return read_job_file(path) if path is not None else JobFile(Path(), {}, {})


def _merge(file_values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Flags and FEDMQ_* environment variables (already folded in by Typer) override the config file."""
    merged = dict(file_values)
    merged.update({k: v for k, v in given.items() if v is not None})
    return merged


def _broker_url(url: str, user: str | None, password: str | None) -> str:
    """Combine a URL with credentials from FEDMQ_BROKER_USER / FEDMQ_BROKER_PASSWORD (Kubernetes Secrets)."""
    if not user:
        return url
    from fedmq.broker.transport.urls import with_credentials

    return with_credentials(url, user, password or "")


@aggregator_app.command("run", cls=HelpCommand)
def aggregator_run(
    broker: str = typer.Option(
        ...,
        envvar="FEDMQ_BROKER",
        help="amqp(s)://user:pass@host:port[,host2:port2...]/vhost "
        "(several addresses: the nodes of one cluster)",
    ),
    job: str | None = typer.Option(None, envvar="FEDMQ_JOB", help="job id"),
    config: Path | None = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file: job keys, [task] table"),
    state_dir: Path = typer.Option(
        Path("fedmq-state"), envvar="FEDMQ_STATE_DIR", help="run folder: checkpoints, metrics"
    ),
    strategy: str | None = typer.Option(
        None, envvar="FEDMQ_STRATEGY", help=", ".join(STRATEGIES) + " or package.module:Class"
    ),
    rounds: int | None = typer.Option(
        None, envvar="FEDMQ_ROUNDS", help="communication rounds (async: global versions)"
    ),
    clients: int | None = typer.Option(None, envvar="FEDMQ_CLIENTS", help="K: the agents of the job"),
    fraction: float | None = typer.Option(
        None, envvar="FEDMQ_FRACTION", help="C: the share of online agents selected each round"
    ),
    strategy_arg: list[str] | None = typer.Option(
        None,
        "--strategy-arg",
        metavar="KEY=VALUE",
        help="a parameter of the strategy, repeatable: --strategy-arg mu=0.01 "
        "(overrides the [strategy] table)",
    ),
    user: str | None = typer.Option(
        None, envvar="FEDMQ_BROKER_USER", help="broker user (instead of the one in --broker)"
    ),
    password: str | None = typer.Option(
        None, envvar="FEDMQ_BROKER_PASSWORD", help="the broker user's password"
    ),
    metrics_port: int = typer.Option(
        0, envvar="FEDMQ_METRICS_PORT", help="serve /metrics, /healthz, /readyz (0 = off)"
    ),
    chunk_limit: int = typer.Option(
        8 * 1024 * 1024, envvar="FEDMQ_CHUNK_LIMIT", help="split messages above this many bytes"
    ),
    heartbeat: int = typer.Option(30, envvar="FEDMQ_HEARTBEAT", help="AMQP heartbeat in seconds"),
    consume_timeout: float = CONSUME_TIMEOUT,
    log_format: str = typer.Option("json", envvar="FEDMQ_LOG_FORMAT", help="json | console"),
    log_level: str = LOG_LEVEL,
    print_config: bool = typer.Option(False, help="print the resolved, validated config as JSON and exit"),
) -> None:
    """Run the aggregator service until the job's rounds are done (resumes from --state-dir).

    Precedence: flags > FEDMQ_* environment variables > the --config file > defaults.

    Example: fedmq aggregator run --broker amqps://rabbit:5671/fedmq --job wt2 --config job.toml
    --state-dir /var/lib/fedmq
    """
    from fedmq.aggregator.config import JobConfig
    from fedmq.params import parse_assignments

    jobfile = _job_file(config)  # a job file or flag that is wrong: one line, before torch is loaded
    values, task_opts = dict(jobfile.job), {"task": "lm", "data": "builtin", **jobfile.task}
    if strategy_arg:
        values["strategy_args"] = {**values.get("strategy_args", {}), **parse_assignments(strategy_arg)}
    cfg = JobConfig.from_dict(
        _merge(
            values,
            {"job": job, "strategy": strategy, "rounds": rounds, "clients": clients, "fraction": fraction},
        )
    )
    task_opts.setdefault("clients", cfg.clients)
    if print_config:
        typer.echo(json.dumps({**cfg.to_dict(), "task": task_opts}, sort_keys=True))
        return
    _setup_logs(log_level, log_format, state_dir / "logs" / "aggregator.jsonl")
    _prepare_process()
    from fedmq.aggregator.engine import Engine
    from fedmq.broker.transport.connect import connect

    engine = None
    _stop_on_signals(lambda: engine, lambda e: e.started)
    task_obj = _make_task(task_opts)
    # a chunked update whose sender went silent this long (it died mid-upload) is dropped and its chunks
    # rejected; generous, because a publisher blocked by flow control is silent too and its update must still
    # complete
    conn = connect(
        _broker_url(broker, user, password),
        chunk_limit=chunk_limit,
        heartbeat=heartbeat,
        consume_timeout=consume_timeout,
        chunk_timeout_s=max(cfg.update_deadline_s, 300.0),
    )
    from fedmq.broker.transport import topology

    telemetry = None
    if metrics_port:
        from fedmq.cli.telemetry import Telemetry

        def live_status() -> dict[str, Any]:
            inbox = topology.q_inbox(cfg.job)
            return {
                **engine.status(),
                "broker": conn.status(),
                "queue_depths": {inbox: conn.queue_depth(inbox)},
            }

        telemetry = Telemetry(live_status, lambda: bool(conn.status().get("connected")))
    engine = Engine(conn, task_obj, cfg, state_dir, on_round=telemetry.observe_round if telemetry else None)
    if telemetry:
        telemetry.serve(metrics_port)
    try:
        summary = engine.run()
    finally:
        conn.close()
        if telemetry:
            telemetry.close()
    typer.echo(json.dumps(summary, default=str))


@agent_app.command("run", cls=HelpCommand)
def agent_run(
    broker: str = typer.Option(
        ...,
        envvar="FEDMQ_BROKER",
        help="amqp(s)://user:pass@host:port[,host2:port2...]/vhost "
        "(several addresses: the nodes of one cluster)",
    ),
    job: str = typer.Option(..., envvar="FEDMQ_JOB", help="job id (the aggregator's --job)"),
    client_id: str | None = typer.Option(
        None, envvar="FEDMQ_CLIENT_ID", help="this agent's id and broker user"
    ),
    client_id_from_hostname: bool = typer.Option(
        False, help="derive the id from a StatefulSet pod name (fedmq-agent-3 → agent-3)"
    ),
    index: int | None = typer.Option(
        None, envvar="FEDMQ_CLIENT_INDEX", help="shard index (default: the id's number)"
    ),
    config: Path | None = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file with a [task] table"),
    data: str | None = typer.Option(None, help="corpus folder, or a corpus name in $FEDMQ_DATA_DIR"),
    device: str = typer.Option("auto", envvar="FEDMQ_DEVICE", help="auto | cpu | cuda"),
    availability: str = typer.Option(
        "always", envvar="FEDMQ_AVAILABILITY", help="always|bernoulli:P|markov:A,B|trace:FILE"
    ),
    faults: str = typer.Option(
        "",
        envvar="FEDMQ_FAULTS",
        help="injected faults, comma-separated: crash-train:P, crash-grant:P, slow:P:SECONDS, cut:P",
    ),
    user: str | None = typer.Option(
        None, envvar="FEDMQ_BROKER_USER", help="broker user (instead of the one in --broker)"
    ),
    password: str | None = typer.Option(
        None, envvar="FEDMQ_BROKER_PASSWORD", help="the broker user's password"
    ),
    seed: int = typer.Option(
        0, envvar="FEDMQ_SEED", help="seed of the shards, availability and faults (the job's seed)"
    ),
    metrics_port: int = typer.Option(
        0, envvar="FEDMQ_METRICS_PORT", help="serve /metrics, /healthz, /readyz (0 = off)"
    ),
    chunk_limit: int = typer.Option(
        8 * 1024 * 1024, envvar="FEDMQ_CHUNK_LIMIT", help="split messages above this many bytes"
    ),
    heartbeat: int = typer.Option(30, envvar="FEDMQ_HEARTBEAT", help="AMQP heartbeat in seconds"),
    consume_timeout: float = CONSUME_TIMEOUT,
    audit_log: Path | None = typer.Option(
        None, envvar="FEDMQ_AUDIT_LOG", help="append one JSON line per broker-confirmed upload (fault audits)"
    ),
    stop_grace: float = typer.Option(
        25.0,
        envvar="FEDMQ_STOP_GRACE",
        help="on SIGTERM/SIGINT, finish the round's local training and upload, leave the job and exit 0 "
        "within this many seconds, else exit 143 (keep it below the pod's terminationGracePeriodSeconds); "
        "a second signal exits at once",
    ),
    host: str | None = typer.Option(
        None,
        envvar="FEDMQ_HOST_ID",
        help="serve many clients in this one process, as host HOST: clients HOST-<n>, broker user "
        "<job>.host.HOST (instead of --client-id); give --clients",
    ),
    clients: str | None = typer.Option(
        None,
        envvar="FEDMQ_HOST_CLIENTS",
        metavar="RANGES",
        help="with --host: the client numbers it serves, e.g. 0-2499,5000 (inside the job's population: "
        "clients in --config, default 10)",
    ),
    host_from_hostname: bool = typer.Option(
        False,
        help="a host per StatefulSet pod: pod NAME-i is host hi and serves the i-th of --hosts equal "
        "parts of the job's population K (clients in --config): numbers i*K/N to (i+1)*K/N-1, rounded "
        "down",
    ),
    hosts: int | None = typer.Option(
        None,
        envvar="FEDMQ_HOSTS",
        metavar="N",
        help="with --host-from-hostname: N, the hosts (the StatefulSet's replicas)",
    ),
    trainers: int = typer.Option(
        1,
        envvar="FEDMQ_TRAINERS",
        metavar="N",
        help="a host's models that train at once (its clients share them)",
    ),
    client_state: Path | None = typer.Option(
        None,
        envvar="FEDMQ_CLIENT_STATE",
        metavar="DIR",
        help="a host keeps what the job's algorithm keeps per client in files here (default: in memory)",
    ),
    log_format: str = typer.Option("json", envvar="FEDMQ_LOG_FORMAT", help="json | console"),
    log_level: str = LOG_LEVEL,
) -> None:
    """Run one client agent: join the job, train on its shard, upload when granted, repeat. With --host (or
    --host-from-hostname), run a host: one process and one broker connection serving many clients of the job.

    Example: fedmq agent run --broker amqps://rabbit:5671/fedmq --job wt2 --client-id agent-3
    --data /data --device cuda

    Example: fedmq agent run --broker amqps://rabbit:5671/fedmq --job wt2 --config job.toml --host h0
    --clients 0-2499
    """
    import socket

    _setup_logs(log_level, log_format)
    if not 0 < stop_grace <= 86400:
        raise UsageError(f"--stop-grace {stop_grace:g} must be in (0, 86400] seconds")
    jobfile = _job_file(config)
    values = jobfile.job
    population = int(values.get("clients", JOB.clients))
    heartbeat_s = float(values.get("heartbeat_s", JOB.heartbeat_s))  # a host's and a one-client agent's beat
    served = _hosted_clients(
        population, host, clients, host_from_hostname, hosts, client_id, client_id_from_hostname, index
    )
    if served is None and (trainers != 1 or client_state is not None):
        raise UsageError(
            "--trainers and --client-state are a host's options: give --host or --host-from-hostname"
        )
    if served is not None:
        if trainers < 1:
            raise UsageError(f"--trainers must be at least 1, got {trainers}")
        task_opts = {"task": "lm", "data": "builtin", "seed": seed, **jobfile.task}
        if data:
            task_opts["data"] = data
        task_opts.setdefault("clients", population)
        _run_host(
            _broker_url(broker, user, password),
            {"chunk_limit": chunk_limit, "heartbeat": heartbeat, "consume_timeout": consume_timeout},
            job,
            *served,
            task_opts,
            availability=availability,
            faults=faults,
            device=device,
            seed=seed,
            heartbeat_s=heartbeat_s,
            strategy=str(values.get("strategy", "")),
            trainers=trainers,
            client_state=client_state,
            audit_log=audit_log,
            metrics_port=metrics_port,
            stop_grace=stop_grace,
        )
        return
    agent = None
    _stop_agent_on_signals(lambda: agent, stop_grace)
    if client_id_from_hostname:
        hostname = socket.gethostname()
        tail = hostname.rsplit("-", 1)[-1]
        client_id = "agent-" + tail if tail.isdigit() else None
        if client_id is None:
            raise UsageError(f"hostname {hostname!r} does not end in a pod ordinal (-N)")
    if not client_id:
        raise UsageError(
            "give --client-id (or FEDMQ_CLIENT_ID, or --client-id-from-hostname), or --host for many clients"
        )
    if index is None:
        tail = client_id.rsplit("-", 1)[-1]
        if not tail.isdigit():
            raise UsageError(f"cannot derive a shard index from {client_id!r}; give --index")
        index = int(tail)
    task_opts = {"task": "lm", "data": "builtin", "seed": seed, **jobfile.task}
    if data:
        task_opts["data"] = data
    task_opts.setdefault("clients", values.get("clients", index + 1))
    _prepare_process()  # a job file or flag that is wrong was one line before torch is loaded
    from fedmq.broker.transport.connect import connect
    from fedmq.client_agent.agent import Agent
    from fedmq.client_agent.availability import parse_availability, parse_faults

    task_obj = _make_task(task_opts)
    url = _broker_url(broker, user, password)
    agent = Agent(
        lambda: connect(url, chunk_limit=chunk_limit, heartbeat=heartbeat, consume_timeout=consume_timeout),
        job,
        client_id,
        index,
        task_obj,
        availability=parse_availability(availability, seed),
        faults=parse_faults(faults, seed),
        device=device,
        seed=seed,
        heartbeat_s=heartbeat_s,
        audit_log=audit_log,
        strategy=str(values.get("strategy", "")),
    )
    telemetry = None
    if metrics_port:
        from fedmq.cli.telemetry import Telemetry

        telemetry = Telemetry(
            lambda: {
                "client": client_id,
                "version": agent.version,
                "rounds_trained": len(agent.log.rounds_trained),
                "uploads": len(agent.log.uploads),
            },
            lambda: agent.connected,
        )
        telemetry.serve(metrics_port)
    try:
        agent.run()
    finally:
        if telemetry:
            telemetry.close()
    if agent.finished:
        typer.echo(f"job {job} finished: agent {client_id} left", err=True)


def _hosted_clients(
    population: int,
    host: str | None,
    clients: str | None,
    from_hostname: bool,
    hosts: int | None,
    client_id: str | None,
    client_id_from_hostname: bool,
    index: int | None,
) -> tuple[str, list[tuple[int, int]]] | None:
    """`agent run`'s host and the client numbers it serves ([start, stop) ranges), or None for a one-client
    agent; each wrong combination or value is one line."""
    import socket

    from fedmq.broker.transport import topology

    if host is None and not from_hostname:
        if hosts is not None:
            raise UsageError("--hosts N goes with --host-from-hostname")
        if clients is not None:
            raise UsageError("--clients are a host's client numbers: give --host too")
        return None
    given = "--host" if host is not None else "--host-from-hostname"
    if host is not None and from_hostname:
        raise UsageError("give --host or --host-from-hostname, not both")
    if client_id or client_id_from_hostname:
        one = "--client-id" if client_id else "--client-id-from-hostname"
        raise UsageError(f"{given} serves many clients, {one} one: give one or the other")
    if index is not None:
        raise UsageError(f"--index is a one-client agent's: {given}'s client HOST-<n> trains on shard n")
    if population < 1:
        raise UsageError(f"the job's population (clients in --config) must be at least 1, got {population}")
    if from_hostname:
        if clients is not None:
            raise UsageError("--host-from-hostname splits the population: give --hosts N, not --clients")
        if hosts is None:
            raise UsageError("--host-from-hostname needs --hosts N (the StatefulSet's replicas)")
        if not 1 <= hosts <= population:
            raise UsageError(f"--hosts {hosts} must be between 1 and the job's population ({population})")
        hostname = socket.gethostname()
        tail = hostname.rsplit("-", 1)[-1]
        if not tail.isdigit():
            raise UsageError(f"hostname {hostname!r} does not end in a pod ordinal (-N)")
        return _host_share(int(tail), hosts, population)
    assert host is not None
    try:
        topology.check_host(host)
    except ValueError as exc:
        raise UsageError(f"--host: {exc}") from None
    if hosts is not None:
        raise UsageError("--hosts N goes with --host-from-hostname, not --host")
    if clients is None:
        raise UsageError(f"--host {host} needs --clients: the client numbers it serves, e.g. 0-99")
    try:
        ranges = topology.parse_clients(clients)
    except ValueError as exc:
        raise UsageError(f"--clients: {exc}") from None
    if ranges[-1][1] > population:
        raise UsageError(
            f"--clients {clients}: client {ranges[-1][1] - 1} is past the job's population of {population} "
            "(clients in --config): the aggregator would refuse this host's roster"
        )
    return host, ranges


def _host_share(ordinal: int, hosts: int, population: int) -> tuple[str, list[tuple[int, int]]]:
    """Host ``h<ordinal>`` of ``hosts`` and its equal part of the population (parts differ by at most one)."""
    from fedmq.broker.transport.provision import HOST_PREFIX

    if ordinal >= hosts:
        raise UsageError(
            f"pod ordinal {ordinal} is past --hosts {hosts}: the hosts are ordinals 0 to {hosts - 1}"
        )
    return f"{HOST_PREFIX}{ordinal}", [(ordinal * population // hosts, (ordinal + 1) * population // hosts)]


def _run_host(
    url: str,
    connect_args: dict[str, Any],
    job: str,
    host_id: str,
    ranges: list[tuple[int, int]],
    task_opts: dict[str, Any],
    *,
    availability: str,
    faults: str,
    device: str,
    seed: int,
    heartbeat_s: float,
    strategy: str,
    trainers: int,
    client_state: Path | None,
    audit_log: Path | None,
    metrics_port: int,
    stop_grace: float,
) -> None:
    """`agent run --host`: a Host (client_agent/host.py) built and stopped as the one-client agent is."""
    host = None
    _stop_agent_on_signals(lambda: host, stop_grace, hosted=True)
    _prepare_process()
    from fedmq.broker.transport.connect import connect
    from fedmq.client_agent.availability import parse_availability, parse_faults
    from fedmq.client_agent.host import Host
    from fedmq.client_agent.state import DiskStore
    from fedmq.client_agent.trainers import TrainerPool

    task_obj = _make_task(task_opts)
    host = Host(
        lambda: connect(url, **connect_args),
        job,
        host_id,
        ranges,
        task_obj,
        availability=parse_availability(availability, seed),
        faults=parse_faults(faults, seed),
        device=device,
        heartbeat_s=heartbeat_s,
        seed=seed,
        trainers=TrainerPool(task_obj, trainers, seed),
        store=DiskStore(client_state) if client_state is not None else None,
        strategy=strategy,
        audit_log=audit_log,
    )
    telemetry = None
    if metrics_port:
        from fedmq.cli.telemetry import Telemetry

        def live() -> dict[str, Any]:
            logs = list(host.logs.values())
            return {
                "host": host_id,
                "clients": host.count(),
                "rounds_trained": sum(len(log.rounds_trained) for log in logs),
                "uploads": sum(len(log.uploads) for log in logs),
            }

        telemetry = Telemetry(live, lambda: host.connected)
        telemetry.serve(metrics_port)
    try:
        host.run()
    finally:
        if telemetry:
            telemetry.close()
        # nothing may be left inside torch when the process exits (a running client's thread is a daemon)
        host.trainers.close()
        host.trainers.wait_idle(5.0)
    if host.finished:
        typer.echo(f"job {job} finished: host {host_id} left ({host.count()} clients)", err=True)


# --------------------------------------------------------------------------------------------- broker
@broker_app.command("provision", cls=HelpCommand)
def broker_provision(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    vhost: str = typer.Option("fedmq", help="virtual host to create"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    agents: int = typer.Option(0, help="number of one-client agents (users agent-0 to agent-N-1)"),
    hosts: str | None = typer.Option(
        None,
        help="hosts, each serving many clients: N (hosts h0 to hN-1, as agent run --host-from-hostname "
        "names them) or ids, comma separated; one user <job>.host.<id> each",
    ),
    secrets_out: str | None = typer.Option(
        None, help="write Kubernetes Secret manifests to DIR, or - for stdout"
    ),
    credentials_out: Path | None = typer.Option(None, help="write a JSON credentials file"),
    namespace: str = typer.Option("fedmq", help="namespace of the Secrets"),
    remove_guest: bool = typer.Option(False, help="delete the guest user (production)"),
) -> None:
    """Create (idempotently) the vhost, the aggregator user and one user per agent and per host with
    least-privilege permissions.

    Example: fedmq broker provision --job wt2 --agents 10 --secrets-out - | kubectl apply -f -

    Example: fedmq broker provision --job wt2 --hosts 4 --credentials-out wt2.json
    """
    from fedmq.broker.transport import provision

    host_ids = _host_ids(hosts)
    provision.provision_cli(
        broker=broker,
        vhost=vhost,
        job=job,
        agents=agents,
        secrets_out=secrets_out,
        credentials_out=credentials_out,
        namespace=namespace,
        remove_guest=remove_guest,
        hosts=host_ids,
    )
    # what was set up, on stderr when stdout carries the Secrets (| kubectl apply -f -)
    for line in _provisioned(vhost, job, agents, host_ids, credentials_out, secrets_out, remove_guest):
        typer.echo(line, err=secrets_out == "-")


def _host_ids(spec: str | None) -> list[str]:
    """``--hosts`` of `broker provision` and `broker purge` (provision.host_ids), or none."""
    from fedmq.broker.transport.provision import host_ids

    try:
        return host_ids(spec) if spec is not None else []
    except ValueError as exc:
        raise UsageError(f"--hosts: {exc}") from None


def _provisioned(
    vhost: str,
    job: str,
    agents: int,
    hosts: list[str],
    credentials_out: Path | None,
    secrets_out: str | None,
    remove_guest: bool,
) -> list[str]:
    """`broker provision`'s summary: the vhost, the users with their permissions, where the passwords went."""
    from fedmq.broker.transport import topology

    lines = [
        f"vhost {vhost}: ready",
        f"user {topology.aggregator_user(job)}: aggregator of job {job}, permissions on the job's queues",
    ]
    if agents:
        first, last = (topology.agent_user(job, f"agent-{i}") for i in (0, agents - 1))
        lines.append(
            f"users {first if agents == 1 else f'{first} … {last}'}: {agents} agent(s) of job {job}, "
            "each confined to its own queues"
        )
    if hosts:
        first, last = (topology.host_user(job, h) for h in (hosts[0], hosts[-1]))
        lines.append(
            f"users {first if len(hosts) == 1 else f'{first} … {last}'}: {len(hosts)} host(s) of job {job}, "
            "each confined to its own queues and its own clients <host>-<n>"
        )
    if remove_guest:
        lines.append("user guest: deleted")
    saved = [str(p) for p in (credentials_out, secrets_out if secrets_out != "-" else None) if p]
    if saved:
        lines.append(f"passwords: in {' and '.join(saved)} (readable by you only)")
    elif secrets_out == "-":
        lines.append("passwords: in the Secrets on stdout")
    else:
        lines.append(
            "passwords: not saved (pass --credentials-out FILE or --secrets-out; rerunning rotates them)"
        )
    return lines


@broker_app.command("deprovision", cls=HelpCommand)
def broker_deprovision(
    broker: str = typer.Option(
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        envvar="FEDMQ_BROKER",
        help="an administrator's URL (rabbitmqctl on this machine, else the management API)",
    ),
    vhost: str = typer.Option("fedmq", help="the virtual host the job was provisioned in"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB", help="job id"),
) -> None:
    """Undo provision for one job: delete its users, its queues and the vhost (kept while another job
    lives there). Running it again does nothing.

    Example: fedmq broker deprovision --job wt2 --vhost fedmq
    """
    from fedmq.broker.transport.deprovision import deprovision

    typer.echo(deprovision(broker, vhost=vhost, job=job).line())


@broker_app.command("check", cls=HelpCommand)
def broker_check(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: str | None = typer.Option(None, envvar="FEDMQ_JOB"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Is the broker reachable? Its version, max message size and the job's queue depths.

    Example: fedmq broker check --job wt2
    """
    from fedmq.broker.transport import provision

    info = provision.check(broker, job)
    typer.echo(json.dumps(info, default=str) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


@broker_app.command("purge", cls=HelpCommand)
def broker_purge(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    agents: int = typer.Option(0, help="also the queues of agents agent-0 to agent-N-1"),
    hosts: str | None = typer.Option(
        None, help="also the queues of these hosts: N (h0 to hN-1) or ids, comma separated"
    ),
) -> None:
    """Delete the job's queues. Through rabbitmqctl (a broker on this machine) every queue of the job; else
    the inbox, the model stream and the queues of the agents and hosts named.

    Example: fedmq broker purge --job wt2 --hosts 4
    """
    from fedmq.broker.transport import provision

    if agents < 0:
        raise UsageError(f"--agents must be at least 0, got {agents}")
    provision.purge(broker, job, [*(f"agent-{i}" for i in range(agents)), *_host_ids(hosts)])
    typer.echo(f"purged job {job}")


# --------------------------------------------------------------------------------------------- status, report
@app.command(cls=HelpCommand)
def status(
    broker: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F", envvar="FEDMQ_BROKER"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB"),
    run_dir: Path | None = typer.Option(None, help="the aggregator's run folder, for round and metrics"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The job seen from outside: round, agents, last metrics, queue depths, standby aggregator.

    Example: fedmq status --job wt2 --run-dir /var/lib/fedmq
    """
    from fedmq.cli.status_info import gather

    info = gather(broker, job, run_dir)
    from fedmq.cli import status as status_view

    typer.echo(status_view.status_json(info) if as_json else status_view.render_status(info))


@app.command(cls=HelpCommand)
def report(
    run_dirs: list[Path] = typer.Argument(..., help="one or more run folders"),
    out: Path | None = typer.Option(None, help="output folder (default: RUN_DIR/report)"),
) -> None:
    """Plots and tables of one or several runs: PNG files, one self-contained HTML page, a markdown table.

    Example: fedmq report runs/fedavg runs/fedatt --out runs/compare
    """
    from fedmq.cli.report import run_report

    typer.echo(run_report(list(run_dirs), out).describe())


# --------------------------------------------------------------------------------------------- bench
def _corpus(data: str) -> str:
    """A bench's ``--data``: a corpus folder or the name of one in the local cache (fedmq.tasks.corpora)."""
    from fedmq.tasks.corpora import resolve

    return resolve(data)


def _bench(module: str, fn: str, **kw: Any) -> None:
    import importlib

    mod = importlib.import_module(f"fedmq.benchmarks.{module}")
    rows = getattr(mod, fn)(**kw)
    typer.echo(mod.format_table(rows))


@bench_app.command("codec", cls=HelpCommand)
def bench_codec(repeats: int = 5, quick: bool = False) -> None:
    """Encode/decode MB/s and compression ratio per encoding vs torch.save and msgpack.

    Example: fedmq bench codec --quick
    """
    _bench("codec", "bench_codec", repeats=repeats, quick=quick)


@bench_app.command("broker", cls=HelpCommand)
def bench_broker(url: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F"), repeats: int = 3) -> None:
    """Publish/consume MB/s of 1, 10, 100 MB updates: fedmq vs raw pika vs the in-process broker.

    Example: fedmq bench broker --repeats 3
    """
    _bench("broker", "bench_broker", url=url, repeats=repeats)


@bench_app.command("aggregate", cls=HelpCommand)
def bench_aggregate(
    repeats: int = typer.Option(3, min=1, help="run the methods in turn this many times; medians"),
) -> None:
    """Streaming aggregation GB/s and peak RSS for 10, 50, 200 updates of a 25M-parameter model.

    Example: fedmq bench aggregate --repeats 3
    """
    _bench("aggregate", "bench_aggregate", repeats=repeats)


@bench_app.command("train", cls=HelpCommand)
def bench_train(quick: bool = False) -> None:
    """Local training tokens/s for GRU-small, LSTM and the small Transformer on CPU.

    Example: fedmq bench train --quick
    """
    _bench("train", "bench_train", quick=quick)


@bench_app.command("cohort", cls=HelpCommand)
def bench_cohort(
    data: str = typer.Option("ptb", help="corpus folder, or a corpus name kept under $FEDMQ_DATA_DIR"),
    model: str = typer.Option("gru-small", help="LM preset"),
    clients: int = typer.Option(100, min=2, help="K: the corpus is split into K iid shards"),
    cohort: str = typer.Option("10", help="cohort sizes, comma-separated (C x K: 10 and 50 at K = 100)"),
    epochs: int = typer.Option(5, min=1, help="local epochs E"),
    max_steps: int = typer.Option(0, min=0, help="cap on a client's steps (0 = none; for a CPU)"),
    device: str = typer.Option("cpu", help="cpu | cuda | auto"),
    repeats: int = typer.Option(3, min=1, help="timed repetitions (after one warm-up); medians"),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads"),
) -> None:
    """A round's local training: the selected clients one at a time vs as one batched cohort (--cohort).

    Example: fedmq bench cohort --data ptb --cohort 10,50 --device cuda
    """
    try:
        sizes = tuple(int(n) for n in cohort.split(","))
    except ValueError:
        raise UsageError(f"--cohort wants comma-separated whole numbers, got {cohort!r}") from None
    if any(not 2 <= n <= clients for n in sizes):
        raise UsageError(f"--cohort sizes must be between 2 and --clients ({clients}), got {cohort!r}")
    _bench(
        "cohort",
        "bench_cohort",
        data=_corpus(data),
        model=model,
        clients=clients,
        sizes=sizes,
        epochs=epochs,
        max_steps=max_steps,
        device=device,
        repeats=repeats,
        threads=threads,
    )


@bench_app.command("flower", cls=HelpCommand)
def bench_flower(
    data: str = typer.Option("wikitext-2", help="corpus folder, or a corpus name kept under $FEDMQ_DATA_DIR"),
    clients: int = typer.Option(100, "--clients", "-k", min=1, help="K"),
    selected: int = typer.Option(10, min=1, help="clients that train per round (C = selected / K)"),
    rounds: int = typer.Option(5, "--rounds", "-r", min=2, help="rounds; medians over rounds 2..R"),
    scale: str = typer.Option("", help="also fedmq at these K, comma-separated (e.g. 10,100,1000)"),
    flower_python: Path | None = typer.Option(
        None, help="python of the venv with the bench extra (default .fedmq-cache/flower-venv/bin/python)"
    ),
    flower: bool = typer.Option(True, "--flower/--no-flower", help="run the Flower side"),
    control: bool = typer.Option(
        False, "--control/--no-control", help="also the minimal Flower harness it is checked against"
    ),
    limit: bool = typer.Option(
        True, "--limit/--no-limit", help="measure the round's parts here and print its physical limit"
    ),
) -> None:
    """fedmq vs Flower 1.41 on the FedAtt setting: s/round, wire bytes/round, peak memory;
    the round's physical limit on this machine; fedmq's scaling in K.

    s/round on both sides: the period between consecutive rounds' ends (aggregated and validated).

    Example: fedmq bench flower --data wikitext-2 -k 100 --selected 10 -r 5 --control
    """
    from fedmq.benchmarks import flower as fl

    data = _corpus(data)
    try:
        ks = tuple(int(k) for k in scale.split(",") if k.strip())
    except ValueError:
        raise UsageError(f"--scale wants comma-separated whole numbers, got {scale!r}") from None
    if selected > clients or any(k < selected for k in ks):
        raise UsageError("--selected must not exceed K")
    python = flower_python or fl.DEFAULT_FLOWER_PYTHON
    if flower and fl.flower_missing(python):
        raise UsageError(f"{fl.flower_missing(python)}; or run with --no-flower")
    bench = fl.bench_flower(data, clients, selected, rounds, ks, python, flower, control, limit)
    typer.echo(fl.format_table(bench))


@app.command(cls=HelpCommand)
def experiment(
    name: str = typer.Argument(
        ...,
        help="table2, sweep, fraction, rounds-to-target, topk, randomization, scale, dropout or nmt-domains",
    ),
    scale: str = typer.Option(
        "cpu", help="smoke (CI, seconds) | cpu (minutes a run on a CPU) | paper (the papers' settings, GPU)"
    ),
    out: Path = typer.Option(
        Path("runs/experiments"), help="results go to OUT/NAME (run folders, results.md, report/)"
    ),
    seeds: str = typer.Option(
        "0", help="seeds for sampling, shards and init, e.g. 0,1,2 (several: mean ± sd)"
    ),
    threads: int = typer.Option(1, help="torch intra-op threads"),
    device: str = typer.Option("cpu", help="local training of the LM experiments: cpu | cuda | auto"),
    cohort: bool = typer.Option(False, "--cohort", help="train each round's selected clients together (GPU)"),
    log_level: str = LOG_LEVEL,
) -> None:
    """Reproduce a seed paper's experiment (docs/results/).

    Example: fedmq experiment table2 --scale cpu --seeds 0,1,2   (rerun the same command to resume)
    """
    from fedmq.benchmarks import experiments
    from fedmq.cli.report import run_report
    from fedmq.simulation import Simulation

    experiments.check_args(name, scale, threads, device)
    seed_list = experiments.parse_seeds(seeds)
    experiments.check_corpora(name, scale)  # a missing corpus is one line, and nothing is written
    _setup_logs(log_level, "json", out / name / "experiment.jsonl")
    experiments.run_experiment(
        name,
        scale,
        out,
        seed_list,
        threads,
        simulation=Simulation,
        report=run_report,
        device=device,
        cohort=cohort,
    )
    typer.echo((out / name / "results.md").read_text())


@bench_app.command("load", cls=HelpCommand)
def bench_load(
    url: str = typer.Option("amqp://guest:guest@127.0.0.1:5672/%2F"),
    agents: str = typer.Option("100,1000", help="comma-separated agent counts"),
    rounds: int = 3,
    threads: int = typer.Option(4, help="swarm connections (agents are shared out)"),
) -> None:
    """N lightweight agents vs a real aggregator: updates/s, upload→inclusion p50/p99,
    aggregator RSS/CPU, lost.

    Example: fedmq bench load --agents 100,1000 --rounds 3
    """
    try:
        counts = tuple(int(a) for a in agents.split(",") if a.strip())
    except ValueError:
        raise UsageError(f"--agents wants comma-separated whole numbers, got {agents!r}") from None
    if not counts or min(counts) < 1 or rounds < 1 or threads < 1:
        raise UsageError("--agents, --rounds and --threads must be positive")
    _bench("load", "bench_load", url=url, agents=counts, rounds=rounds, threads=threads)


@bench_app.command("population", cls=HelpCommand)
def bench_population(
    data: str = typer.Option("wikitext-2", help="corpus folder, or a corpus name kept under $FEDMQ_DATA_DIR"),
    clients: str = typer.Option("100,10000,100000", help="simulated populations, comma separated"),
    selected: int = typer.Option(10, help="clients a round"),
    rounds: int = typer.Option(5, "-r", "--rounds"),
    broker: str | None = typer.Option(
        None, help="also run --services-clients clients over this RabbitMQ in --hosts agent processes"
    ),
    services_clients: int = typer.Option(10_000, help="the population over RabbitMQ"),
    hosts: int = typer.Option(4, help="agent processes serving it"),
) -> None:
    """s/round, peak memory and broker queues as the population grows (virtual clients), and a population
    over RabbitMQ: rounds completed, lost and duplicated updates, RabbitMQ's memory and queue count.

    Example: fedmq bench population --data wikitext-2 --broker amqp://guest:guest@127.0.0.1:5672/%2F
    """
    from fedmq.benchmarks import population

    try:
        ks = tuple(int(k) for k in clients.split(",") if k.strip())
    except ValueError:
        raise UsageError(f"--clients wants comma-separated whole numbers, got {clients!r}") from None
    if min(ks, default=0) < selected or selected < 1 or rounds < 2 or hosts < 1 or services_clients < hosts:
        raise UsageError("want --selected ≥ 1, every --clients ≥ --selected, --rounds ≥ 2, --hosts ≥ 1")
    runs = population.simulate_rows(_corpus(data), ks, selected, rounds)
    services = population.services_row(broker, services_clients, hosts, selected, rounds) if broker else None
    typer.echo(population.format_table(runs, services))


def main() -> None:
    """Console entry point: user errors become one line on stderr, never a traceback."""
    from fedmq.cli.logs import configure

    configure("warning")  # commands that log (simulate, services) configure their own level and format
    try:
        code = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising it
        if isinstance(code, int) and code:
            sys.exit(code)
    except FedmqError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))  # 2: the command line was wrong; 1: a run that broke
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # errors of typer's bundled click (bad flag values, unknown options)
        if type(exc).__name__ == "NoArgsIsHelpError" or not hasattr(exc, "format_message"):
            if hasattr(exc, "show") and hasattr(exc, "exit_code"):
                exc.show()
                sys.exit(exc.exit_code)
            raise
        ctx = getattr(exc, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)  # one line, like fedmq's own errors
        sys.exit(getattr(exc, "exit_code", 2))


if __name__ == "__main__":
    main()
