"""The fedmq CLI: help on every command, and every documented user error is one line, exit code 2,
no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import fedmq_procs
import pytest

ROOT = Path(__file__).resolve().parents[2]


fedmq = fedmq_procs.fedmq


@pytest.mark.parametrize(
    "cmd",
    [
        [],
        ["simulate"],
        ["aggregator", "run"],
        ["agent", "run"],
        ["broker", "provision"],
        ["broker", "check"],
        ["broker", "purge"],
        ["status"],
        ["report"],
        ["bench", "codec"],
        ["bench", "broker"],
        ["bench", "aggregate"],
        ["bench", "train"],
        ["bench", "load"],
        ["bench", "flower"],
        ["bench", "cohort"],
        ["experiment"],
    ],
)
def test_help_everywhere(cmd):
    proc = fedmq(*cmd, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
    if cmd:
        assert "Example" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["simulate", "--strategy", "fedfoo"], "unknown strategy"),
        (["simulate", "--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
        (["simulate", "--broker", "nats://x"], "unsupported broker URL scheme"),
        (["simulate", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F", "--rounds", "1"], "127.0.0.1"),
        (["simulate", "--encoding", "zip9"], "encoding"),
        (["simulate", "--availability", "sometimes"], "availability"),
        (["simulate", "--fraction", "2"], "fraction"),
        (["simulate", "--log-level", "loud"], "log level"),
        (["simulate", "--robust", "clip:-1"], "robust"),
        (["simulate", "--down-encoding", "int9"], "encoding"),
        (["report", "/nonexistent/run"], "/nonexistent/run"),
        (["bench", "flower", "--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
        (["bench", "flower", "--data", ".", "-k", "5", "--selected", "10"], "--selected"),
        (["bench", "flower", "--data", ".", "--scale", "ten"], "--scale"),
        (["bench", "cohort", "--cohort", "ten"], "--cohort"),
        (["bench", "cohort", "--cohort", "1"], "between 2"),
        (["bench", "cohort", "--data", "/nonexistent/corpus", "--cohort", "2"], "/nonexistent/corpus"),
        (["broker", "check", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F"], "cannot connect"),
        (["status", "--job", "j", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F"], "cannot connect"),
        (["agent", "run", "--broker", "amqp://127.0.0.1:1/", "--job", "j"], "--client-id"),
        (
            [
                "agent",
                "run",
                "--broker",
                "amqp://127.0.0.1:1/",
                "--job",
                "j",
                "--client-id",
                "agent-0",
                "--availability",
                "markov:2,1",
            ],
            "markov",
        ),
        (
            ["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--config", "/nonexistent/job.toml"],
            "not found",
        ),
        (
            [
                "aggregator",
                "run",
                "--broker",
                "amqp://127.0.0.1:1/",
                "--strategy",
                "fedfoo",
                "--print-config",
            ],
            "unknown strategy",
        ),
        (["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--tier", "branch"], "use root or edge"),
        (["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--tier", "edge"], "no edge aggregators"),
        (
            ["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--tier", "edge", "--edges", "2"],
            "--edge in [0, 2)",
        ),
        (
            ["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--edges", "2", "--strategy", "fedatt"],
            "needs each client's update",
        ),
    ],
)
def test_user_errors_are_one_line(args, needle, tmp_path):
    proc = fedmq(*args, "--out", str(tmp_path / "run")) if args[0] == "simulate" else fedmq(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle.lower() in err.lower()


# ----------------------------------------------------------------------------------------- help at 80 columns
ALL_COMMANDS = [
    [],
    ["simulate"],
    ["aggregator", "run"],
    ["agent", "run"],
    ["broker", "provision"],
    ["broker", "check"],
    ["broker", "purge"],
    ["status"],
    ["report"],
    ["bench", "codec"],
    ["bench", "broker"],
    ["bench", "aggregate"],
    ["bench", "train"],
    ["bench", "load"],
    ["bench", "flower"],
    ["bench", "cohort"],
    ["experiment"],
]


def help80(*cmd: str) -> str:
    proc = fedmq_procs.run(
        fedmq_procs.command(*cmd, "--help"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("cmd", ALL_COMMANDS)
def test_help_fits_80_columns_and_reads_like_argparse(cmd):
    text = help80(*cmd)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "…" not in text  # nothing truncated
    assert not [line for line in text.splitlines()[1:] if line.endswith("...")], (
        text
    )  # command summaries in full
    assert not re.search(r"<(str|int|float|bool|path|list\[)", text, re.I), text  # readable metavars


def words(text: str) -> set[str]:
    return set(re.findall(r"[\w:.+-]+", text))


def test_simulate_help_groups_options_and_lists_every_choice_in_full():
    from fedmq.aggregator.config import STRATEGIES
    from fedmq.broker.wire.encodings import KINDS
    from fedmq.tasks.lm_models import PRESETS
    from fedmq.tasks.nmt_model import CONFIGS

    text = help80("simulate")
    for panel in (
        "Task and data:",
        "Strategy:",
        "Differential privacy:",
        "Local training:",
        "Wire:",
        "Availability and faults:",
        "Run:",
    ):
        assert f"\n{panel}\n" in text, panel
    names = words(text)
    encodings = set(KINDS) - {"topk"} | {"int8-row", "int4-row", "topk:DENSITY"}
    for name in [
        *STRATEGIES,
        *encodings,
        *PRESETS,
        *CONFIGS,
        "iid",
        "dirichlet:ALPHA",
        "natural",
        "bernoulli:P",
        "markov:A,B".split(",")[0],
        "trace:FILE",
        "crash-train:P",
        "crash-grant:P",
        "slow:P:SECONDS",
        "cut:P",
    ]:
        assert name in names, name
    assert "--config FILE" in text and "--tied / --untied" in text and "-k, --clients K" in text
    assert "--metrics-port PORT" in text
    # 120 before the privacy panel (one line a flag), its example, the two secure-aggregation flags and
    # --trainers
    assert len(text.splitlines()) < 133


def test_agent_run_help_shows_option_names_and_brackets():
    text = help80("agent", "run")
    for name in (
        "--client-id-from-hostname",
        "--no-client-id-from-hostname",
        "--audit-log AUDIT_LOG",
        "--chunk-limit CHUNK_LIMIT",
        "--metrics-port METRICS_PORT",
        "--availability AVAILABILITY",
    ):
        assert name in text, name
    assert "[task] table" in text  # not eaten as markup


def test_model_catalog_matches_the_models():
    from fedmq.tasks.catalog import MODELS
    from fedmq.tasks.lm_models import PRESETS
    from fedmq.tasks.nmt_model import CONFIGS

    assert MODELS == {"lm": tuple(PRESETS), "nmt": tuple(CONFIGS)}


# ------------------------------------------------------------------------------------ fast, torch-free checks
def fedmq_torch_probe(*args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Run the CLI in-process under a probe that reports whether torch was imported by the time it exited."""
    code = (
        "import atexit, sys; "
        "atexit.register(lambda: sys.__stdout__.write('TORCH=%s' % ('torch' in sys.modules)));"
        f"sys.argv = ['fedmq', *{list(args)!r}]; from fedmq.cli.app import main; main()"
    )
    proc = fedmq_procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    return proc, "TORCH=True" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--strategy", "nope"], "unknown strategy"),
        (["--model", "gru-huge"], "gru-tiny, gru-small"),
        (["--encoding", "zip9"], "encoding"),
        (["--down-encoding", "int9"], "encoding"),
        (["--availability", "markov:2,1"], "markov"),
        (["--faults", "boom:1"], "unknown fault"),
        (["--partition", "dirichlet:x"], "partition"),
        (["--device", "tpu"], "--device"),
        (["--broker", "nats://x"], "unsupported broker URL scheme"),
        (["--fraction", "2"], "fraction"),
        (["--robust", "clip:-1"], "robust"),
        (["--log-level", "loud"], "log level"),
        (["--rounds", "x"], "--rounds"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--data", "/etc/hostname"], "is a file"),
        (["--data", "/nonexistent/corpus"], "no such folder"),
        (["--task", "lm", "--domains", "news"], "--domains"),
        (["--beam", "4"], "--beam"),
        (["--trainers", "0"], "--trainers must be at least 1, got 0"),
        (["--task", "nmt", "--data", ".", "--bptt", "20"], "--bptt"),
        (["--task", "nmt", "--data", ".", "--tied"], "--tied"),
        (["--task", "nmt"], "needs --data"),
        (["--vocab-size", "-1"], "--vocab-size"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--metrics-port", "-1"], "--metrics-port"),
        (["--metrics-port", "http"], "--metrics-port"),
        (["--strategy", "fedadam", "--strategy-arg", "server-lr=0.01"], "did you mean server_lr?"),
        (["--strategy", "fedatt", "--strategy-arg", "eps=1"], "strategy 'fedatt' has no parameter 'eps'"),
        (["--dp", "central", "--clip-norm", "0"], "--clip-norm) S must be positive"),
        (["--dp", "central", "--noise-multiplier", "-1"], "must not be negative"),
        (["--dp", "central", "-k", "10", "--delta", "0.1"], "must be in (0, 1/K)"),
        (["--dp", "central", "--target-epsilon", "0"], "--target-epsilon) ε must be positive"),
        (["--dp", "central", "--target-epsilon", "2", "--noise-multiplier", "1"], "not both"),
        (["--dp", "central", "--strategy", "fedmed"], "needs an averaging strategy"),
        (["--dp", "central", "--beta", "0.5"], "by loss"),
        (["--dp", "client", "--clip-norm", "adaptive"], "adaptive needs dp (--dp) central"),
        (["--dp", "secret"], "use none, central or client"),
    ],
)
def test_bad_simulate_flags_are_one_line_before_torch_and_leave_no_folder(args, needle, tmp_path):
    out = tmp_path / "run"
    proc, torch_loaded = fedmq_torch_probe("simulate", *args, "--out", str(out))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle.lower() in err.lower(), err
    assert not torch_loaded, "torch was imported before the flags were checked"
    assert not out.exists()


def test_metrics_port_in_use_is_one_line_before_torch_and_leaves_no_folder(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "run"
        proc, torch_loaded = fedmq_torch_probe("simulate", "--metrics-port", str(port), "--out", str(out))
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and f"--metrics-port {port}" in err, err
    assert not torch_loaded and not out.exists()


def test_device_cuda_without_a_gpu_is_one_line_before_any_agent(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    out = tmp_path / "run"
    proc = fedmq("simulate", "--device", "cuda", "--out", str(out))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "CUDA is not available" in proc.stderr and not out.exists()


def test_connection_errors_read_as_words_not_exception_classes(tmp_path):
    proc = fedmq(
        "simulate",
        "--broker",
        "amqp://guest:guest@127.0.0.1:1/%2F",
        "--max-lines",
        "200",
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2 and "connection refused" in proc.stderr, proc.stderr
    assert not re.search(r"[A-Z]\w*(Error|Exception)\b", proc.stderr), proc.stderr
    assert not (tmp_path / "run").exists()  # created once the flags were valid, removed again on the failure


# ---------------------------------------------------------------------------------------- run folder mistakes
def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and needle in err, err


def test_out_that_is_a_file_or_under_one_or_unwritable_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    one_line_error(fedmq("simulate", "--out", str(afile)), "is a file")
    one_line_error(fedmq("simulate", "--out", str(afile / "run")), "is a file")
    one_line_error(fedmq("simulate", "--out", "/proc/fedmq-cannot-be-here/run"), "cannot")
    assert afile.read_text() == "keep me"


def test_out_holding_a_run_is_refused_without_resume_and_left_untouched(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"strategy": "fedavg"}')
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    one_line_error(fedmq("simulate", "--out", str(run)), "--resume")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_failed_run_leaves_an_existing_empty_folder_empty(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = fedmq(
        "simulate", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F", "--max-lines", "200", "--out", str(run)
    )
    one_line_error(proc, "cannot connect")
    assert run.is_dir() and not list(run.iterdir())


def test_resume_needs_out():
    one_line_error(fedmq("simulate", "--resume"), "--out")


# ------------------------------------------------------------------------------------------ option resolution
def plan(*args: str, saved: dict | None = None):
    import typer

    from fedmq.cli.app import app
    from fedmq.cli.commands.simulate import simulate
    from fedmq.cli.simulate_options import from_context

    ctx = typer.main.get_command(app).commands["simulate"].make_context("simulate", list(args))
    return from_context(ctx, simulate, saved)


def test_config_file_then_flags_override_it(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        'job = "wt2"\nidentity = "strict"\nstrategy = "fedatt"\nrounds = 3\natt_eps = 1.0\nlr = 10\n'
        'keyframe_every = 4\n[task]\nmodel = "gru-small"\nclients = 6\nmax_lines = 500\nemb = 64\n'
    )
    p = plan("--config", str(job), "--rounds", "5", "--lr", "5")
    assert (p.job.strategy, p.job.rounds, p.job.strategy_args["epsilon"], p.job.lr, p.job.keyframe_every) == (
        "fedatt",
        5,
        1.0,
        5.0,
        4,
    )
    assert p.job.job == "sim"  # simulate names its own job; the services' job id in the file is ignored
    assert p.task == {**p.task, "model": "gru-small", "clients": 6, "max_lines": 500, "emb": 64}
    assert p.job.extra["cli"]["rounds"] == 5 and p.job.extra["cli"]["keyframe_every"] == 4
    assert plan().job.strategy == "fedavg" and plan().task["model"] == "gru-tiny"


def test_simulate_learning_rate_is_the_strategys_unless_given(tmp_path):
    assert plan().job.lr == 20.0 and plan("--strategy", "fedsgd").job.lr == 1.5
    assert plan("--strategy", "fedsgd", "--lr", "4").job.lr == 4.0
    job = tmp_path / "job.toml"
    job.write_text('strategy = "fedsgd"\nlr = 2\n')
    assert plan("--config", str(job)).job.lr == 2.0


@pytest.mark.parametrize(
    "content,needle",
    [
        ("rounds = 'ten'\n", "rounds must be a whole number"),
        ("fraction = true\n", "fraction must be a number"),
        ("roundz = 3\n", "unknown key(s) roundz"),
        ("[task]\nfoo = 1\n", "task.foo"),
        ("clients = 2\n[task]\nclients = 3\n", "contradicts"),
        ("task = 3\n", "[task] table"),
        ("rounds =\n", "not valid TOML"),
        ("[task]\ndomains = ['news']\n", "--domains"),
    ],
)
def test_bad_config_files_are_one_line(tmp_path, content, needle):
    from fedmq.cli.errors import UsageError

    job = tmp_path / "job.toml"
    job.write_text(content)
    with pytest.raises(UsageError, match=re.escape(needle)):
        plan("--config", str(job))


def test_resume_keeps_saved_options_and_refuses_different_ones():
    from fedmq.cli.errors import UsageError

    saved = plan(
        "-k", "4", "--lr", "10", "--model", "gru-small", "--max-lines", "300", "--rounds", "2"
    ).options
    p = plan(
        "--rounds", "6", "--device", "auto", saved=dict(saved)
    )  # harmless: extend the run, another device
    assert (p.job.clients, p.job.lr, p.job.rounds) == (4, 10.0, 6)
    assert (p.task["model"], p.task["max_lines"]) == ("gru-small", 300)
    assert plan("--lr", "10", "-k", "4", saved=dict(saved)).job.lr == 10.0  # the saved values, repeated: fine
    with pytest.raises(
        UsageError, match=r"--clients 8 \(saved: 4\), --model 'gru-tiny' \(saved: 'gru-small'\)"
    ):
        plan("-k", "8", "--model", "gru-tiny", saved=dict(saved))


def test_resume_of_a_run_folder_from_before_options_were_recorded():
    from fedmq.cli.simulate_options import saved_options

    legacy = {
        "strategy": "fedatt",
        "att_eps": 1.0,
        "clients": 4,
        "lr": 10.0,
        "task": "lm",
        "model": "gru-small",
        "partition": "iid",
        "bptt": 20,
        "model_config": {"tied": True, "dropout": 0.1},
        "extra": {},
    }
    p = plan(saved=saved_options(legacy))
    assert (
        p.job.strategy,
        p.job.strategy_args["epsilon"],
        p.job.clients,
        p.task["model"],
        p.task["bptt"],
        p.task["tied"],
    ) == ("fedatt", 1.0, 4, "gru-small", 20, True)


# --------------------------------------------------------------------------------------------- set-up
def make_setup_commands(target: str) -> str:
    """What `make TARGET` would install: its setup lines, run by scripts/setup.sh with --dry-run."""
    lines = fedmq_procs.run(
        ["make", "-n", target], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    out = ""
    for line in lines.splitlines():
        if "scripts/setup.sh" in line:
            out += fedmq_procs.run(
                [*line.split(), "--dry-run"], capture_output=True, text=True, cwd=ROOT, check=True
            ).stdout
    return out


def test_make_demo_installs_only_the_runtime_and_make_test_everything():
    demo, test = make_setup_commands("demo"), make_setup_commands("test")
    assert "torch==2.13.0" in demo and any(line.endswith(" -e .") for line in demo.splitlines())
    assert "checkov" not in demo and "[test]" not in demo
    assert "torch==2.13.0" in test and "-e .[test]" in test and "checkov==" in test
    makefile = (ROOT / "Makefile").read_text()
    assert "torch" not in makefile  # scripts/setup.sh is the one place that pins it


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("roundz = 3\n", "unknown key(s) roundz"),
        ("rounds = 'ten'\n", "rounds must be a whole number, got 'ten'"),
        ("[strategy]\nmu = 0.1\n", 'the [strategy] table needs name = "STRATEGY"'),
        ("task = 3\n", "task must be a [task] table"),
    ],
)
def test_every_command_reads_a_job_file_the_same_way(tmp_path, content, needle):
    """One reader of job files (aggregator.config.read_job_file) for simulate, aggregator run and agent run:
    the same mistake is the same line from each, before anything connects."""
    job = tmp_path / "job.toml"
    job.write_text(content)
    url = "amqp://guest:guest@127.0.0.1:1/%2F"  # never reached
    commands = [
        ["simulate", "--config", str(job)],
        ["aggregator", "run", "--broker", url, "--config", str(job), "--state-dir", str(tmp_path / "s")],
        ["agent", "run", "--broker", url, "--job", "j", "--client-id", "agent-0", "--config", str(job)],
    ]
    for cmd in commands:
        done = fedmq(*cmd)
        assert done.returncode != 0 and "Traceback" not in done.stderr, (cmd, done.stderr)
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: config file {job}") and needle in last, (cmd, last)


def test_every_option_of_the_services_says_what_it_is():
    """`aggregator run --help` and `agent run --help`: no option without a line of help."""
    import typer

    from fedmq.cli.app import app

    root = typer.main.get_command(app)
    for group in ("aggregator", "agent"):
        command = root.commands[group].commands["run"]
        bare = [p.name for p in command.params if p.param_type_name == "option" and not p.help]
        assert bare == [], (group, bare)
