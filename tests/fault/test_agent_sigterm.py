"""`fedmq agent run` stopped as Kubernetes stops a pod (real processes, real RabbitMQ).

SIGTERM while the agent trains: it finishes the local training, its update is confirmed by the broker (the
agent's audit log) and folded by the aggregator, it leaves the job, and the process exits 0. A second signal
ends the process at once (143), and so does a round that outlasts ``--stop-grace``; neither aborts inside
torch. Local training here is exit_tasks.SlowTask's: TRAIN_S seconds of matrix products, and a training that
ran until its time was up says so on the agent's stderr (exit_tasks.TRAINED): agent-0's did before it exited,
agents 1 and 2 exited before theirs could.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fault_harness import Federation, delete_job_queues, read_jsonl, wait_for
from load_factor import budget

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

EXIT_TASKS = Path(__file__).resolve().parents[1] / "integration"
TRAIN_S = 6.0


def _signal_while_training(fed: Federation, i: int, *signals: int) -> subprocess.Popen:
    """Send ``signals`` (0.5 s apart) to agent-i once it has been training round 1 for a second."""
    wait_for(lambda: fed.agent_events(i, "round training", 1), 90, f"agent-{i} to train round 1")
    time.sleep(1.0)
    proc = fed.procs[f"agent-{i}"]
    for n, signum in enumerate(signals):
        if n:
            time.sleep(0.5)
        proc.send_signal(signum)
    return proc


def _exit(proc: subprocess.Popen, timeout: float) -> int:
    """The agent's exit code; it must exit within ``timeout`` (an idle machine's seconds, scaled)."""
    try:
        return proc.wait(timeout=budget(timeout))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent did not exit within {budget(timeout):.0f} s") from None


def _trained_to_the_end(fed: Federation, i: int) -> bool:
    """Whether agent-i's local training ran until its time was up (exit_tasks.SlowTask's TRAINED line)."""
    return bool(fed.agent_events(i, "slow training ran until its time was up"))


def test_sigterm_finishes_the_round_uploads_and_exits_0_second_signal_or_grace_exit_at_once(
    tmp_path, rabbit_url, job_id, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXIT_TASKS), os.environ.get("PYTHONPATH", "")]))
    fed = Federation(
        tmp_path / "fed",
        rabbit_url,
        job_id,
        clients=3,
        rounds=2,
        task={"task": "exit_tasks:SlowTask", "slow_s": TRAIN_S, "fast": 0},
        # agent-0's update is in about TRAIN_S after the announcement; agents 1 and 2 never report, so round 1
        # closes on these deadlines
        job_options={"report_deadline_s": 2 * TRAIN_S, "update_deadline_s": 4.0},
    )
    try:
        fed.start_aggregator()
        fed.start_agent(0)
        fed.start_agent(1)
        fed.agent_env = {"FEDMQ_STOP_GRACE": "2"}
        fed.start_agent(2)
        fed.agent_env = {}
        # agent-0: one SIGTERM mid-training
        proc0 = _signal_while_training(fed, 0, signal.SIGTERM)
        # agent-1: two signals; agent-2: one, but its round takes longer than its 2 s grace
        proc1 = _signal_while_training(fed, 1, signal.SIGTERM, signal.SIGTERM)
        proc2 = _signal_while_training(fed, 2, signal.SIGTERM)

        assert _exit(proc1, 10) == 143
        assert not _trained_to_the_end(fed, 1), "a second signal must end the agent at once"
        assert _exit(proc2, 10) == 143
        assert not _trained_to_the_end(fed, 2), "the grace did not bound the stop"
        assert _exit(proc0, 30) == 0, (fed.logs / "agent-0.err").read_text()[-2000:]
        assert _trained_to_the_end(fed, 0), "agent-0 stopped before its training ended"

        errs = {i: (fed.logs / f"agent-{i}.err").read_text() for i in range(3)}
        assert all("terminate called" not in e for e in errs.values()), errs
        assert "second SIGTERM" in errs[1] and "--stop-grace" in errs[2], errs
        # agent-0's round-1 update was confirmed by the broker (its audit log) and folded into round 1
        audit = read_jsonl(fed.audit_dir / "agent-0.jsonl")
        assert [(a["round"], a["client"]) for a in audit] == [(1, "agent-0")], audit
        assert not any((fed.audit_dir / f"agent-{i}.jsonl").exists() for i in (1, 2))
        wait_for(lambda: fed.round_closed(1), 60, "round 1 to close")
        row = next(r for r in fed.rows() if r["round"] == 1)
        assert row["update_ids"].get("agent-0") == audit[0]["update_id"], row
        # and it left the job: its goodbye reached the aggregator (it is no longer online)
        status = tmp_path / "fed" / "state" / "status.json"
        wait_for(lambda: "agent-0" not in status.read_text(), 30, "agent-0 to be offline")
    finally:
        fed.stop_all()
        delete_job_queues(rabbit_url, job_id, fed.clients)
