"""CI smoke of every named experiment (issue 8): each config runs end to end at the ``smoke`` scale.

Tiny slices of the real corpora, one or two rounds, in-process broker (the same engine/agent/codec path as
RabbitMQ). Beyond "it runs", each test checks the property the experiment is about on the smoke numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks import experiments
from benchmarks.experiments import ExperimentError, run_experiment
from broker.errors import FedmqError

ROOT = experiments.ROOT


def _check_common(results: dict, out, name: str) -> dict[str, dict]:
    runs = {r["run"]: r for r in results["runs"]}
    assert runs, "an experiment must run at least one federation"
    md = (out / name / "results.md").read_text()
    saved = json.loads((out / name / "results.json").read_text())
    assert [r["run"] for r in saved["runs"]] == list(runs)
    for run, r in runs.items():
        assert run in md
        assert (out / name / run / "summary.json").is_file()
        assert (out / name / run / "metrics.jsonl").is_file()
        assert r["rounds_completed"] + r["rounds_skipped"] >= 1
        if r["rounds_completed"]:
            assert r["test"] is not None and math.isfinite(r["test"]), run
    return runs


@pytest.mark.parametrize("name", ["table2", "fraction", "randomization", "scale"])
def test_lm_grid_runs(name, tmp_path):
    results = run_experiment(name, "smoke", tmp_path, report=False)
    runs = _check_common(results, tmp_path, name)
    assert all(r["rounds_completed"] == 1 for r in runs.values())
    assert len(runs) == len(experiments.EXPERIMENTS[name]("smoke"))
    if name == "table2":  # FedSGD uses every client, the others C*K
        assert runs["wikitext-2-fedsgd"]["updates_received"] == 4
        assert runs["wikitext-2-fedavg-c0.5"]["updates_received"] == 2
    if name == "randomization":  # noise changes the uploaded weights, hence the model
        assert runs["fedavg-noise0.0"]["test"] != runs["fedavg-noise0.01"]["test"]


def test_rounds_to_target(tmp_path):
    results = run_experiment("rounds-to-target", "smoke", tmp_path, report=False)
    runs = _check_common(results, tmp_path, "rounds-to-target")
    assert results["target"] == pytest.approx(min(runs["fedavg-e1"]["valid_curve"]))
    assert runs["fedavg-e1"]["rounds_to_target"] == 1  # the reference reaches its own best value
    assert runs["fedavg-e1"]["bytes_to_target"] > 0
    # int8 deltas put fewer bytes on the wire than raw fp32 for the same rounds
    assert runs["fedavg-e1-delta-int8"]["bytes_up"] < runs["fedavg-e1"]["bytes_up"] / 2


def test_dropout_availability_and_crashes(tmp_path):
    results = run_experiment("dropout", "smoke", tmp_path, report=False)
    runs = _check_common(results, tmp_path, "dropout")
    assert (tmp_path / "dropout" / "availability-trace.json").is_file()
    assert set(runs) == {"bernoulli0.7-crash-train0.2", "trace"}


def test_nmt_domains(tmp_path):
    results = run_experiment("nmt-domains", "smoke", tmp_path, report=False)
    runs = _check_common(results, tmp_path, "nmt-domains")
    table = results["bleu_by_domain"]
    assert set(table["pre-trained (news_wmt)"]) == {"news_wmt", "ted_iwslt14"}
    assert "server fedavg" in table and "client ted_iwslt14 (local only)" in table
    # round 2 of dynamic pulling sends about half of the tensors: fewer raw bytes up than FedAvg
    assert runs["pull-local-0.5"]["bytes_up_raw"] < runs["fedavg"]["bytes_up_raw"]
    assert runs["pull-global-0.5"]["bytes_up_raw"] < runs["fedavg"]["bytes_up_raw"]
    # the 33 % variant pulls in both directions: round 2's push is a third of the tensors too
    assert runs["pull-global-0.33-both"]["directions"] == "both" and runs["pull-global-0.5"]["directions"] == "up"
    assert runs["pull-global-0.33-both"]["bytes_down_raw"] < runs["fedavg"]["bytes_down_raw"]
    assert runs["pull-global-0.5"]["bytes_down_raw"] == runs["fedavg"]["bytes_down_raw"]


def test_cli_topk_with_report(tmp_path):
    """`fedmq experiment topk --scale smoke`: top-K β=0.5 grants half the uploads; the report has its figures."""
    proc = subprocess.run([sys.executable, "-m", "cli.app", "experiment", "topk", "--scale", "smoke", "--out",
                           str(tmp_path), "--log-level", "warning"], cwd=ROOT, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fedmed-beta0.5" in proc.stdout
    results = json.loads((tmp_path / "topk" / "results.json").read_text())
    runs = _check_common(results, tmp_path, "topk")
    assert runs["fedmed-beta0.5"]["updates_received"] == 1 and runs["fedmed-beta1.0"]["updates_received"] == 2
    assert runs["fedmed-beta0.5"]["bytes_up"] < runs["fedmed-beta1.0"]["bytes_up"]
    assert list((tmp_path / "topk" / "report").glob("*.png"))


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path):
    with pytest.raises(ExperimentError, match="unknown experiment 'tabel2'"):
        run_experiment("tabel2", "smoke", tmp_path)
    with pytest.raises(ExperimentError, match="unknown scale"):
        run_experiment("table2", "gpu", tmp_path)
    with pytest.raises(ExperimentError, match="no run name contains 'zzz'"):
        run_experiment("table2", "smoke", tmp_path, only="zzz")
    with pytest.raises(FedmqError, match="unknown config key"):
        run_experiment("table2", "smoke", tmp_path, overrides={"roundz": 3})
    with pytest.raises(FedmqError, match="rounds must be at least 1"):
        run_experiment("topk", "smoke", tmp_path, overrides={"rounds": 0})
    proc = subprocess.run([sys.executable, "-m", "cli.app", "experiment", "nope", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown experiment 'nope'" in proc.stderr
    assert list(tmp_path.iterdir()) == []
