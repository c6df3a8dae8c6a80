"""`fedmq simulate` under client-level differential privacy: central and client mode complete and state the
ε the accountant gives for their rounds in every record; no client's loss or weight is recorded; killed with
SIGKILL and resumed, a run ends with the same ε and, its noise seeded from the job's seed, the same model."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import fedmq_procs
import pytest
import torch

from fedmq.aggregator.checkpoint import load_checkpoint
from fedmq.cli.report import build_report
from fedmq.privacy.accountant import Accountant, default_delta

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from crash_at import killed  # noqa: E402

EXAMPLES = HERE.parents[1] / "docs" / "examples"
K, C, ROUNDS, Z = 8, 0.5, 4, 0.8
RUN = [
    "simulate",
    "--task",
    "logreg:LogReg",
    "-k",
    str(K),
    "-c",
    str(C),
    "-r",
    str(ROUNDS),
    "--lr",
    "0.5",
    "--max-steps",
    "5",
    "--clip-norm",
    "1.0",
    "--noise-multiplier",
    str(Z),
    "--json",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}


def _fedmq(*args: str, cwd: Path) -> dict:
    done = fedmq_procs.fedmq(*args, cwd=cwd, env=_env(), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _expected_epsilons() -> list[float]:
    acc = Accountant(C, Z, default_delta(K))
    out = []
    for _ in range(ROUNDS):
        acc.step()
        out.append(acc.epsilon())
    return out


@pytest.mark.parametrize("mode", ["central", "client"])
def test_a_dp_run_completes_and_states_the_accountants_epsilon(tmp_path, mode):
    extra = ["--min-clients", "2"] if mode == "client" else []
    summary = _fedmq(*RUN, "--dp", mode, *extra, "--out", str(tmp_path / "run"), cwd=tmp_path)
    expected = _expected_epsilons()
    assert summary["rounds_completed"] + summary["rounds_skipped"] == ROUNDS
    assert summary["epsilon"] == pytest.approx(expected[-1], rel=1e-9)
    assert summary["delta"] == pytest.approx(1 / K**1.1)
    assert summary["dp"]["mode"] == mode and "seeded" in summary["dp"]["noise"]
    rows = _rows(tmp_path / "run")
    assert [r["epsilon"] for r in rows] == pytest.approx(expected, rel=1e-9)
    assert all(r["delta"] == summary["delta"] for r in rows)
    # nothing per client that the mechanism does not cover
    assert all(r["losses"] == {} and r["weights"] == {} and r["mean_loss"] is None for r in rows)
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "epsilon" in header and "delta" in header
    # `fedmq status` of the finished run (its job has no queues left: the folder)
    status = fedmq_procs.fedmq(
        "status", "--job", "sim", "--run-dir", tmp_path / "run", "--json", cwd=tmp_path
    )
    assert status.returncode == 0, status.stderr[-2000:]
    assert json.loads(status.stdout)["epsilon"] == pytest.approx(expected[-1], rel=1e-9)
    report = build_report([tmp_path / "run"], tmp_path / "report")  # `fedmq report`: ε per round and a note
    assert (tmp_path / "report" / "privacy.png").is_file()
    assert f"ε = {expected[-1]:.3g} at δ" in report.markdown.read_text()


def test_distributed_dp_under_secure_aggregation_is_client_dp_in_the_clear(tmp_path):
    """dp client with secagg: each client clips and noises its change before masking, and the aggregator
    unmasks only their sum. With the job's seeded sampling and noise, the run spends the same ε as the same
    job in the clear and ends with the same model up to the secure sum's quantization."""
    # raw both ways: no bf16 rounding of the updates in the clear, nor of the model the clients train from
    args = [*RUN, "--dp", "client", "--min-clients", "2", "--encoding", "raw", "--down-encoding", "raw"]
    clear = _fedmq(*args, "--out", str(tmp_path / "clear"), cwd=tmp_path)
    secure = _fedmq(*args, "--secagg", "--secagg-clip", "10", "--out", str(tmp_path / "secure"), cwd=tmp_path)
    assert secure["epsilon"] == clear["epsilon"] == pytest.approx(_expected_epsilons()[-1], rel=1e-9)
    assert secure["rounds_completed"] == clear["rounds_completed"] > 0
    rows = _rows(tmp_path / "secure")
    assert all(r["weights"] == {} and r["mean_loss"] is None for r in rows)
    x, y = (
        load_checkpoint(tmp_path / "clear" / "checkpoints"),
        load_checkpoint(tmp_path / "secure" / "checkpoints"),
    )
    for name, value in x.global_state.items():  # within a few quantization steps (2c / 2^29 each), not equal
        torch.testing.assert_close(y.global_state[name], value, rtol=0, atol=1e-5)
    assert any(not torch.equal(y.global_state[k], v) for k, v in x.global_state.items())


def test_kill9_and_resume_give_the_same_epsilon_and_model(tmp_path):
    whole = tmp_path / "whole"
    a = _fedmq(*RUN, "--dp", "central", "--out", str(whole), cwd=tmp_path)
    run = tmp_path / "run"
    crashed = killed("after-agg", 2, [*RUN, "--dp", "central", "--out", str(run)], tmp_path, _env())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    b = _fedmq("simulate", "--out", str(run), "--resume", "--json", cwd=tmp_path)
    assert b["epsilon"] == a["epsilon"]
    assert [r["epsilon"] for r in _rows(run)] == [r["epsilon"] for r in _rows(whole)]
    x, y = load_checkpoint(whole / "checkpoints"), load_checkpoint(run / "checkpoints")
    assert x.round == y.round == ROUNDS + 1
    assert x.extra["dp_accountant"] == y.extra["dp_accountant"]
    assert all(torch.equal(x.global_state[k], y.global_state[k]) for k in x.global_state)


def test_async_versions_are_releases_without_sampling_and_take_one_update_per_client(tmp_path):
    args = [*RUN, "--dp", "central", "--strategy", "async", "--strategy-arg", "buffer_size=6"]
    summary = _fedmq(*args, "--out", str(tmp_path / "run"), cwd=tmp_path)
    acc = Accountant(1.0, Z, default_delta(K))  # each published version: one release, q = 1
    acc.step(summary["version"])
    assert summary["version"] == ROUNDS and summary["epsilon"] == pytest.approx(acc.epsilon(), rel=1e-9)
    assert summary["dp"]["sampling_rate"] == 1.0 and summary["dp"]["denominator"] == 6
    for row in _rows(tmp_path / "run"):
        clients = [key.split("#")[0] for key in row["update_ids"]]
        assert len(clients) == len(set(clients)), row["update_ids"]  # at most once a version


def test_the_target_epsilon_ends_the_job_cleanly_with_a_checkpoint(tmp_path, monkeypatch):
    """z is derived for the planned rounds, so the stop is a safety net; here the target is lowered to what
    two releases spend, as if the job ran longer than planned: it ends after round 2, checkpointed."""
    import fedmq
    from fedmq.aggregator import privacy_ledger

    sys.path.insert(0, str(EXAMPLES))
    try:
        from bring_your_own import TwoMoons
    finally:
        sys.path.remove(str(EXAMPLES))
    init = privacy_ledger.PrivacyLedger.__init__

    def lowered(self, plan, noise_seed):
        init(self, plan, noise_seed)
        self.plan = dataclasses.replace(plan, target_epsilon=self.accountant.epsilon_after(2))

    monkeypatch.setattr(privacy_ledger.PrivacyLedger, "__init__", lowered)
    cfg = fedmq.JobConfig(
        job="dp-stop",
        rounds=5,
        clients=4,
        fraction=0.5,
        lr=0.5,
        batch_size=16,
        dp="central",
        target_epsilon=9.0,
    )
    summary = fedmq.Simulation(cfg, TwoMoons(clients=4), run_dir=tmp_path / "run").run()
    assert summary["budget_spent"] is True and not summary["interrupted"]
    rows = _rows(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2]
    assert summary["epsilon"] == rows[-1]["epsilon"]
    assert load_checkpoint(tmp_path / "run" / "checkpoints").round == 3
