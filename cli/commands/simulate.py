"""`fedmq simulate`: a whole federation on this machine."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import typer

from fedmq import defaults
from fedmq.aggregator.config import STRATEGIES
from fedmq.cli.errors import UsageError, check_progress
from fedmq.cli.options import JOB
from fedmq.cli.process import make_task, prepare_process, setup_logs
from fedmq.tasks.catalog import MIN_COUNT, MODELS

TASK, STRATEGY, PRIVACY, TRAIN, WIRE, AVAIL, RUN = (
    "Task and data",
    "Strategy",
    "Differential privacy",
    "Local training",
    "Wire",
    "Availability and faults",
    "Run",
)
# broker.wire.encodings.EncodingSpec
ENCODINGS = "raw, fp16, bf16, int8, int6, int5, int4 (each also -row), topk:DENSITY"


def _opt(default: Any, *names: str, panel: str, metavar: str | None = None, help: str = "") -> Any:
    return typer.Option(default, *names, rich_help_panel=panel, metavar=metavar, help=help)


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
        help="influence guard: weight n_k ≤ F × the median n_k of recent rounds (0 = off)",
    ),
    edges: int = _opt(
        JOB.edges,
        panel=STRATEGY,
        metavar="N",
        help="edge aggregators (two-tier)",
    ),
    dp: str = _opt(
        JOB.dp,
        panel=PRIVACY,
        metavar="MODE",
        help="central or client (who noises)",
    ),
    clip_norm: str = _opt(
        str(JOB.clip_norm),
        panel=PRIVACY,
        metavar="S|adaptive",
        help="L2 bound on one client's update",
    ),
    clip_quantile: float = _opt(
        JOB.clip_quantile, panel=PRIVACY, metavar="Q", help="adaptive S: target quantile"
    ),
    noise_multiplier: float | None = _opt(
        JOB.noise_multiplier,
        panel=PRIVACY,
        metavar="Z",
        help="noise std z·S (default 1)",
    ),
    target_epsilon: float | None = _opt(
        JOB.target_epsilon,
        panel=PRIVACY,
        metavar="E",
        help="z for ε ≤ E over --rounds",
    ),
    delta: float | None = _opt(JOB.delta, panel=PRIVACY, metavar="D", help="default 1/K^1.1"),
    secagg: bool = _opt(JOB.secagg, "--secagg/--no-secagg", panel=PRIVACY, help="secure aggregation"),
    secagg_clip: float = _opt(JOB.secagg_clip, panel=PRIVACY, metavar="C", help="secagg: |coordinate| ≤ C"),
    epochs: int = _opt(JOB.epochs, "--epochs", "-e", panel=TRAIN, metavar="E", help="local epochs"),
    batch_size: int = _opt(
        JOB.batch_size, "--batch-size", "-b", panel=TRAIN, metavar="B", help="local batch size"
    ),
    lr: float | None = _opt(
        None,
        panel=TRAIN,
        metavar="LR",
        help=f"client learning rate [default: {defaults.LR:g}; fedsgd: {defaults.FEDSGD_LR:g}]",
    ),
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
    trainers: int = _opt(
        defaults.TRAINERS,
        panel=RUN,
        metavar="N",
        help="clients that train at once (docs/cli.md)",
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
      fedmq simulate --dp central --clip-norm 0.5 --target-epsilon 8 -r 20
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
    setup_logs(  # at a terminal the progress bars replace the info lines; the run's log file keeps them
        log_level,
        "console" if interactive else "json",
        run_dir / "logs" / "simulate.jsonl",
        console_level="warning" if interactive else None,
    )
    prepare_process()  # the first torch import
    from fedmq.tasks.training import resolve_device

    opts, cfg = plan.options, plan.job
    resolve_device(opts["device"])  # --device cuda without a GPU: one line, before any agent starts
    from fedmq.cli import run_folder
    from fedmq.cli.progress import RoundProgress
    from fedmq.simulation import Simulation

    task_obj = make_task(plan.task)
    if resume:
        run_folder.check_checkpoint_fits(run_dir, task_obj, cfg.seed, cfg.strategy)
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
        trainers=opts["trainers"],
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
    if summary.get("interrupted"):
        return 130
    check_progress(summary)
    return 0
