"""`fedmq simulate` end to end: the run folder, learning, Ctrl-C + --resume, and the same over RabbitMQ."""

from __future__ import annotations

import csv
import json
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import fedmq_procs
import pytest
from load_factor import budget

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--clients",
    "4",
    "--fraction",
    "0.5",
    "--model",
    "gru-tiny",
    "--max-lines",
    "1500",
    "--vocab-size",
    "2000",
    "--max-steps",
    "15",
    "--bptt",
    "20",
    "--lr",
    "10",
]


fedmq = fedmq_procs.command  # the command line of `fedmq ARGS`


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_simulate_writes_the_run_folder_and_learns(tmp_path):
    run = tmp_path / "run"
    proc = fedmq_procs.run(
        fedmq("simulate", *TINY, "--rounds", "3", "--out", str(run)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # not a TTY: machine-readable summary
    assert summary["rounds_completed"] == 3 and summary["test"] > 1
    for name in ("config.json", "metrics.jsonl", "summary.json", "best.pt", "logs/simulate.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "checkpoints").glob("*.fmq"))
    # the run folder is its owner's alone: the model, its metrics and logs say much about the clients' data
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "best.pt").stat().st_mode) == 0o600
    config = json.loads((run / "config.json").read_text())
    assert config["strategy"] == "fedavg" and config["clients"] == 4
    scores = [r["valid"] for r in rows(run)]
    assert len(scores) == 3 and scores[-1] < scores[0]  # validation perplexity falls over the rounds
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows(run))

    # every checkpoint truncated: --resume refuses in one line instead of training afresh from round 1 under
    # the old run's name, and the run's records stay as they were
    for ckpt in (run / "checkpoints").glob("*.fmq"):
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = fedmq_procs.run(
        fedmq("simulate", "--out", str(run), "--resume", "--rounds", "4"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(errors) == 1 and "no readable checkpoint" in errors[0] and "3 rounds" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_ctrl_c_checkpoints_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    proc = fedmq_procs.popen(
        fedmq("simulate", *TINY, "--rounds", "5", "--out", str(run)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.time() + budget(240)
    while len(rows(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(rows(run)) >= 2, "two rounds did not finish in time"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["interrupted"] is True
    done = len(rows(run))
    assert 2 <= done < 5
    proc = fedmq_procs.run(
        fedmq("simulate", *TINY, "--rounds", "5", "--out", str(run), "--resume"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["round"] for r in rows(run)] == [1, 2, 3, 4, 5]  # no round lost, none run twice
    assert [r["version"] for r in rows(run)] == [1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(
        run / "metrics.csv", newline=""
    ) as fh:  # the same CSV and event files, appended to, no round twice
        assert [float(r["valid"]) for r in csv.DictReader(fh)] == [r["valid"] for r in rows(run)]
    board = EventAccumulator(str(run / "tb"))
    board.Reload()
    assert [e.step for e in board.Scalars("valid/perplexity")] == [1, 2, 3, 4, 5]


def test_simulate_metrics_port_serves_score_and_loss_and_the_run_has_csv_and_tensorboard(tmp_path, free_port):
    import urllib.request

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    port = free_port
    run = tmp_path / "run"
    proc = fedmq_procs.popen(
        fedmq("simulate", *TINY, "--rounds", "2", "--out", str(run), "--metrics-port", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    scraped, deadline = "", time.time() + budget(120)
    while "fedmq_validation_perplexity" not in scraped and time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                scraped = resp.read().decode()
        except OSError:
            pass
        time.sleep(0.2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    metrics = dict(line.rsplit(" ", 1) for line in scraped.splitlines() if line and not line.startswith("#"))
    done = int(float(metrics['fedmq_rounds_total{outcome="completed"}']))  # scraped while it ran: 1 (or 2)
    assert float(metrics["fedmq_validation_perplexity"]) == rows(run)[done - 1]["valid"]
    assert float(metrics["fedmq_train_loss"]) == rows(run)[done - 1]["mean_loss"]
    with open(run / "metrics.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [(int(r["round"]), float(r["valid"]), json.loads(r["weights"])) for r in table] == [
        (r["round"], r["valid"], r["weights"]) for r in rows(run)
    ]
    board = EventAccumulator(str(run / "tb"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"valid/perplexity", "train/mean_loss", "bytes/up", "participation/received"} <= tags
    assert {f"weights/{c}" for r in rows(run) for c in r["weights"]} <= tags
    assert [e.step for e in board.Scalars("valid/perplexity")] == [1, 2]


def test_resume_without_a_run_folder_is_one_line(tmp_path):
    proc = fedmq_procs.run(
        fedmq("simulate", "--out", str(tmp_path / "none"), "--resume"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--resume" in proc.stderr


@pytest.mark.rabbitmq
def test_simulate_over_rabbitmq(tmp_path, rabbit_url):
    run = tmp_path / "run"
    proc = fedmq_procs.run(
        fedmq("simulate", *TINY, "--rounds", "2", "--out", str(run), "--broker", rabbit_url),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_completed"] == 2 and summary["rejected"] == {}
    assert json.loads((run / "config.json").read_text())["identity"] == "shared:guest"
    # the job's id is printed, and the run leaves no queue of it on the broker
    job = summary["job"]
    assert job.startswith("sim-") and f"job {job}" in proc.stderr
    assert _job_queues(job) == []


def _job_queues(job: str) -> list[str]:
    out = fedmq_procs.run(
        ["rabbitmqctl", "list_queues", "name", "--quiet", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [q.strip() for q in out.splitlines() if q.strip().startswith(f"fedmq.{job}.")]


@pytest.mark.rabbitmq
def test_simulate_keep_queues_leaves_them(tmp_path, rabbit_url):
    from fedmq.broker.transport.provision import purge

    proc = fedmq_procs.run(
        fedmq(
            "simulate",
            *TINY,
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "run"),
            "--broker",
            rabbit_url,
            "--keep-queues",
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = json.loads(proc.stdout.strip().splitlines()[-1])["job"]
    try:
        left = _job_queues(job)
        assert f"fedmq.{job}.inbox" in left and f"fedmq.{job}.models" in left and f"fedmq.{job}.dead" in left
        # the simulation is one host: two queues of its own, however many clients it serves
        assert len(left) == 3 + 2 and f"fedmq.{job}.agent.agent.latest" in left
    finally:
        purge(rabbit_url, job, ["agent"])
    assert _job_queues(job) == []


def test_an_agent_failure_ends_the_simulation_at_once_with_one_line(tmp_path):
    """A failing agent thread (here: its training raises) stops the run within seconds, not at the 300 s
    report deadline, and the user sees the first cause in one line (exit 1);
    the traceback is in the run's log."""
    from fedmq.aggregator.config import JobConfig
    from fedmq.simulation import Simulation, SimulationFailed
    from fedmq.tasks.lm import LanguageModelTask

    class Broken(LanguageModelTask):
        def train(self, model, client, cfg, progress=None):
            raise RuntimeError(f"out of memory on client {client}\nsecond line")

    task = Broken(data="builtin", model="gru-tiny", clients=3, max_lines=300, vocab_size=300, bptt=10)
    cfg = JobConfig(
        job="sim",
        rounds=2,
        clients=3,
        fraction=1.0,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=300,
        update_deadline_s=300,
        encoding="raw",
        down_encoding="raw",
    )
    started = time.monotonic()
    with pytest.raises(SimulationFailed) as info:
        Simulation(cfg, task, "memory://sim-broken", tmp_path / "run").run()
    # the failure ended the run; it did not wait for the round's deadline
    assert time.monotonic() - started < cfg.report_deadline_s
    assert re.fullmatch(r"agent agent-(\d): out of memory on client \1", str(info.value)), str(info.value)
    assert info.value.exit_code == 1


JOB_TOML = """\
job = "wt2"          # the services' job id: simulate names its own
strategy = "fedatt"
rounds = 8
clients = 3
fraction = 0.67
max_steps = 10
lr = 10

[task]
model = "gru-tiny"
max_lines = 1200
vocab_size = 1500
bptt = 20
"""


@pytest.mark.slow
def test_config_file_run_then_resume_from_the_saved_options_alone(tmp_path):
    job, run = tmp_path / "job.toml", tmp_path / "run"
    job.write_text(JOB_TOML)
    proc = fedmq_procs.run(
        fedmq("simulate", "--config", str(job), "--rounds", "1", "--out", str(run)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((run / "config.json").read_text())
    assert (config["strategy"], config["rounds"], config["clients"], config["train_lines"]) == (
        "fedatt",
        1,
        3,
        1200,
    )
    assert config["job"] == "sim" and config["extra"]["cli"]["vocab_size"] == 1500

    # no option repeated: the run's own config, not the defaults (8 agents, all words, fedavg)
    proc = fedmq_procs.run(
        fedmq("simulate", "--out", str(run), "--resume", "--rounds", "2"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["round"] for r in rows(run)] == [1, 2]
    resumed = json.loads((run / "config.json").read_text())
    assert {k: resumed[k] for k in ("strategy", "clients", "vocab_size", "parameters", "lr")} == {
        k: config[k] for k in ("strategy", "clients", "vocab_size", "parameters", "lr")
    }
    assert resumed["rounds"] == 2

    # different options are refused in one line, and nothing in the folder changes
    before = {p: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")}
    proc = fedmq_procs.run(
        fedmq("simulate", "--out", str(run), "--resume", "--model", "gru-small", "-k", "8"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--clients 8 (saved: 3)" in proc.stderr and "--model 'gru-small'" in proc.stderr
    assert {p: p.read_bytes() for p in before} == before

    # a checkpoint that no longer fits (the corpus or the recorded options changed) is one line, not a hang
    changed = {**resumed, "extra": {"cli": {**resumed["extra"]["cli"], "vocab_size": 300}}}
    (run / "config.json").write_text(json.dumps(changed))
    proc = fedmq_procs.run(
        fedmq("simulate", "--out", str(run), "--resume", "--rounds", "3"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "does not fit" in proc.stderr and [r["round"] for r in rows(run)] == [1, 2]


def test_a_second_run_of_the_same_job_in_one_process_starts_clean(tmp_path):
    """The in-process hub lives as long as the process: a run of the same job after another (the experiments'
    seeds) must not read the first run's leftovers. Before the purge, in
    `scripts/reproduce.py table2 --seeds 0,1` (K = 20) the first run's last heartbeats and goodbyes were still
    in the inbox: the second run counted the old agents online, selected at once, then took their goodbyes for
    its selected agents leaving, and closed round 1 with no update (every seed after the first lost a round).
    How many leftovers a run leaves depends on timing; what the fix guarantees does not: the job's queues are
    gone after each run, and the next run's rounds are whole."""
    from fedmq.aggregator.config import JobConfig
    from fedmq.broker.transport.connect import connect
    from fedmq.simulation import Simulation
    from fedmq.tasks.lm import LanguageModelTask

    task = LanguageModelTask(
        data="builtin", model="gru-tiny", clients=4, max_lines=300, vocab_size=300, bptt=10
    )
    for seed in (0, 1):
        cfg = JobConfig(
            job="same",
            rounds=2,
            clients=4,
            fraction=0.5,
            join_timeout_s=20,
            seed=seed,
            encoding="raw",
            down_encoding="raw",
            max_steps=2,
        )
        Simulation(cfg, task, "memory://same-hub", tmp_path / f"seed-{seed}").run()
        first = rows(tmp_path / f"seed-{seed}")[0]
        assert not first["skipped"] and len(first["received"]) == 2, first
    probe = connect("memory://same-hub")
    try:
        assert probe.purge_job("same") == []  # nothing of the job left behind
    finally:
        probe.close()


def test_clients_that_natural_partition_would_not_honour_are_one_line(tmp_path):
    """--partition natural gives one client per document (3 in the first 300 lines of the builtin corpus): a
    different -k is refused in one line and leaves nothing, never silently replaced."""
    out = tmp_path / "run"
    args = ["simulate", "--partition", "natural", "--max-lines", "300", "-r", "1", "--out", str(out)]
    proc = fedmq_procs.run(fedmq(*args, "-k", "5"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "error: partition natural (--partition) gives one client per document (3 here) but clients "
        "(--clients) is 5: drop clients or use iid"
    ]
