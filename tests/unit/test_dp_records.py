"""ε where a run is read (aggregator/privacy_ledger.py, cli/telemetry.py, cli/status.py): /metrics'
fedmq_dp_epsilon, `fedmq status`, the final table; the stop before a release would pass the target ε; the
accountant's state in a checkpoint."""

from __future__ import annotations

import dataclasses
import urllib.request

import pytest

from fedmq.aggregator.checkpoint import CheckpointRefused
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.privacy import dp_plan
from fedmq.aggregator.privacy_ledger import PrivacyLedger
from fedmq.cli.status import render_status, render_summary, to_text
from fedmq.cli.telemetry import Telemetry

CFG = JobConfig(dp="central", clients=100, fraction=0.1, rounds=10, target_epsilon=2.0)


def _ledger(cfg: JobConfig = CFG, seed: int | None = None) -> PrivacyLedger:
    plan = dp_plan(cfg)
    assert plan is not None
    return PrivacyLedger(plan, seed)


def test_the_target_epsilon_stops_before_the_release_that_would_pass_it():
    ledger = _ledger()
    allowed = 0
    while ledger.within_budget():
        ledger.release()
        allowed += 1
        assert ledger.record()["epsilon"] <= 2.0 * (1 + 1e-9)
    assert allowed == CFG.rounds  # z was derived for the planned rounds: the stop is a safety net
    assert ledger.accountant.epsilon_after(allowed + 1) > 2.0


def test_without_a_target_epsilon_nothing_stops():
    ledger = _ledger(dataclasses.replace(CFG, target_epsilon=None, noise_multiplier=0.5))
    for _ in range(30):
        assert ledger.within_budget()
        ledger.release()


def test_the_checkpointed_accountant_resumes_and_a_mismatch_is_refused():
    ledger = _ledger()
    for _ in range(3):
        ledger.release()
    again = _ledger()
    PrivacyLedger.restore(again, ledger.state_dict())
    assert again.record() == ledger.record() and again.accountant.releases == 3
    with pytest.raises(CheckpointRefused, match="without differential privacy"):
        PrivacyLedger.restore(_ledger(), {})
    with pytest.raises(CheckpointRefused, match="under differential privacy"):
        PrivacyLedger.restore(None, ledger.state_dict())
    other = _ledger(dataclasses.replace(CFG, target_epsilon=None, noise_multiplier=3.0))
    with pytest.raises(CheckpointRefused, match="does not fit"):
        PrivacyLedger.restore(other, ledger.state_dict())


def test_metrics_status_and_the_final_table_show_epsilon():
    t = Telemetry(lambda: {"round": 2}, lambda: True)
    t.serve(0, "127.0.0.1")
    try:
        port = t.server.server_address[1]
        t.observe_round({"round": 1, "received": ["a"], "epsilon": 0.75, "delta": 1e-5})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        t.close()
    assert "# TYPE fedmq_dp_epsilon gauge" in text and "\nfedmq_dp_epsilon 0.75\n" in text
    status = render_status({"job": "j", "round": 3, "epsilon": 0.75, "delta": 1e-5}, width=120)
    assert "privacy spent" in status and "ε = 0.750 at δ = 1e-05" in status
    summary = {
        "metric": "loss",
        "epsilon": 1.5,
        "delta": 1e-5,
        "dp": {"mode": "central", "noise": "os-csprng"},
    }
    table = to_text(render_summary(summary, [{"round": 1, "epsilon": 1.5, "delta": 1e-5}]), width=200)
    table = " ".join(table.split())  # the caption wraps at the table's width
    assert "client-level DP central: ε = 1.500 at δ = 1e-05" in table
    seeded = {
        **summary,
        "dp": {"mode": "client", "noise": "seeded from the job's seed"},
        "budget_spent": True,
    }
    table = " ".join(to_text(render_summary(seeded, []), width=300).split())
    assert "seeded from the job's seed" in table and "the target ε stopped the job" in table
