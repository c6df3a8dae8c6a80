"""CI smoke of every named experiment: each config runs end to end at the ``smoke`` scale.

The first lines of the real corpora (tests/fixtures/corpora, the data folder of every test here: none needs
the full corpora), one or two rounds, in-process broker (the same engine/agent/codec path as RabbitMQ).
Beyond "it runs", each test checks the property the experiment is about on the smoke numbers.
"""

from __future__ import annotations

import json
import math
import re
import sys
from functools import partial

import fedmq_procs
import pytest

from fedmq.benchmarks import experiments, results_file
from fedmq.benchmarks.experiments import ExperimentError, grids, nmt_grid
from fedmq.benchmarks.experiments.results import ROOT, max_jump
from fedmq.errors import FedmqError
from fedmq.simulation import Simulation

pytestmark = pytest.mark.usefixtures("fixture_corpora")
run_experiment = partial(
    experiments.run_experiment, simulation=Simulation
)  # the report: test_cli_topk_with_report


def _check_common(results: dict, out, name: str, seed: str | None = None) -> dict[str, dict]:
    """The runs of ``results`` (with ``seed``: that seed's, of a several-seed experiment) are in the
    experiment's tables, have their run folders and their rows in the results file kept in git
    (NAME.SCALE.json)."""
    runs = {r["run"]: r for r in (results if seed is None else results["per_seed"][seed])["runs"]}
    assert runs, "an experiment must run at least one federation"
    md = (out / name / "results.md").read_text()
    saved = json.loads((out / name / "results.json").read_text())
    assert [r["run"] for r in saved["runs"]] == list(runs)
    folder = out / name if seed is None else out / name / f"seed-{seed}"
    for run, r in runs.items():
        assert run in md
        assert (folder / run / "summary.json").is_file()
        assert (folder / run / "metrics.jsonl").is_file()
        assert r["rounds_completed"] + r["rounds_skipped"] >= 1
        if r["rounds_completed"]:
            assert r["test"] is not None and math.isfinite(r["test"]), run
    kept = results_file.read(out / name / results_file.file_name(name, results["scale"]))
    rows = {r["run"]: r for r in kept["runs"] if seed is None or r["seed"] == int(seed)}
    assert list(rows) == list(runs) and kept["command"].split()[:3] in (
        ["fedmq", "experiment", name],
        ["python", "scripts/reproduce.py", name],
    )
    assert all(rows[run]["test"] == r["test"] and rows[run]["valid_curve"] for run, r in runs.items())
    return runs


@pytest.mark.parametrize("name", ["table2", "fraction", "randomization", "scale"])
def test_lm_grid_runs(name, tmp_path):
    results = run_experiment(name, "smoke", tmp_path)
    runs = _check_common(results, tmp_path, name)
    assert all(r["rounds_completed"] == 1 for r in runs.values())
    assert len(runs) == len(grids.EXPERIMENTS[name]("smoke"))
    if name == "table2":  # FedSGD uses every client, the others C*K
        assert runs["wikitext-2-fedsgd"]["updates_received"] == 4
        assert runs["wikitext-2-fedavg-c0.5"]["updates_received"] == 2
        central = runs[
            "wikitext-2-central-c0.5"
        ]  # no federation: nothing on the wire, one model on the union
        assert (
            central["strategy"] == "central" and central["bytes_up"] == 0 and central["updates_received"] == 0
        )
    if name == "randomization":  # noise changes the uploaded weights, hence the model
        assert runs["fedavg-noise0.0"]["test"] != runs["fedavg-noise0.01"]["test"]


def test_rounds_to_target(tmp_path):
    results = run_experiment("rounds-to-target", "smoke", tmp_path)
    runs = _check_common(results, tmp_path, "rounds-to-target")
    assert results["target"] == pytest.approx(min(runs["fedavg-e1"]["valid_curve"]))
    assert runs["fedavg-e1"]["rounds_to_target"] == 1  # the reference reaches its own best value
    assert runs["fedavg-e1"]["bytes_to_target"] > 0
    # int8 deltas put fewer bytes on the wire than raw fp32 for the same rounds
    assert runs["fedavg-e1-delta-int8"]["bytes_up"] < runs["fedavg-e1"]["bytes_up"] / 2


def test_dropout_availability_and_crashes(tmp_path):
    results = run_experiment("dropout", "smoke", tmp_path)
    runs = _check_common(results, tmp_path, "dropout")
    assert (tmp_path / "dropout" / "availability-trace.json").is_file()
    assert set(runs) == {"bernoulli0.7-crash-train0.2", "trace"}


def test_nmt_domains(tmp_path, monkeypatch):
    """Two seeds: as in Passban et al. every federation starts from one pre-trained (WMT) engine, so the seeds
    pre-train once (cached at the experiment level) and differ only in their federations."""
    results = run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1))
    exp = tmp_path / "nmt-domains"
    assert (exp / "pretrained.pt").is_file() and not list(exp.glob("seed-*/pretrained.pt"))
    tables = [results["per_seed"][s]["bleu_by_domain"] for s in ("0", "1")]
    assert tables[0]["pre-trained (news_wmt)"] == tables[1]["pre-trained (news_wmt)"]
    assert {r["run"] for r in results["runs"]} >= {"fedavg", "pull-random-0.5"}
    runs = _check_common(results, tmp_path, "nmt-domains", seed="0")
    table = tables[0]
    assert set(table["pre-trained (news_wmt)"]) == {"news_wmt", "ted_iwslt14"}
    assert "server fedavg" in table and "client ted_iwslt14 (local only)" in table
    # cross-entropy beside BLEU for every model, a mean per server row, and its own orderings
    # (lower is better)
    ce = results["per_seed"]["0"]["ce_by_domain"]
    assert set(ce) == set(table) and all(0 < v < 10 for row in ce.values() for v in row.values())
    assert all(r["ce_mean_domains"] > 0 and r["ce_mean_domains_sd"] is not None for r in results["runs"])
    assert results["orderings_ce"] and all(" < " in o for o in results["orderings_ce"])
    assert "Cross-entropy (nats a reference token" in (exp / "results.md").read_text()
    # every round's checkpoint is kept, and each server is also read at its round of lowest validation
    # cross-entropy (all validation pairs of each domain) beside the engine's pick by BLEU on a few pairs
    pick = json.loads((exp / "seed-0" / "fedavg" / "summary.json").read_text())["ce_pick"]
    by_round = pick["valid_ce_by_round"]
    assert set(by_round) == {"1", "2"} and str(pick["round"]) == min(by_round, key=by_round.get)
    assert (
        table["server fedavg, CE pick"] == pick["test_bleu_by_domain"]
        and ce["server fedavg, CE pick"] == pick["test_ce_by_domain"]
    )
    seed0 = {r["run"]: r for r in results["per_seed"]["0"]["runs"]}
    assert seed0["fedavg"]["ce_pick_round"] == pick["round"]
    assert seed0["fedavg"]["ce_ce_pick"] == pytest.approx(sum(pick["test_ce_by_domain"].values()) / 2)
    assert len(results["orderings_ce_pick"]) == 21
    assert (
        "each server read at its round of lowest validation cross-entropy" in (exp / "results.md").read_text()
    )
    # round 2 of dynamic pulling sends about half of the tensors: fewer raw bytes up than FedAvg
    assert runs["pull-local-0.5"]["bytes_up_raw"] < runs["fedavg"]["bytes_up_raw"]
    assert runs["pull-global-0.5"]["bytes_up_raw"] < runs["fedavg"]["bytes_up_raw"]
    # the 33 % variant pulls in both directions: round 2's push is a third of the tensors too
    assert (
        runs["pull-global-0.33-both"]["directions"] == "both"
        and runs["pull-global-0.5"]["directions"] == "up"
    )
    assert runs["pull-global-0.33-both"]["bytes_down_raw"] < runs["fedavg"]["bytes_down_raw"]
    assert runs["pull-global-0.5"]["bytes_down_raw"] == runs["fedavg"]["bytes_down_raw"]
    # orderings of the per-domain mean BLEU, paired by seed, the higher one first:
    # one line per pair of the 7 runs
    mean = {s: {r["run"]: r["bleu_mean_domains"] for r in results["per_seed"][s]["runs"]} for s in ("0", "1")}
    assert len(results["orderings"]) == 21
    line = next(
        o for o in results["orderings"] if "fedavg" in o.split(" in ")[0] and "pull-local-0.5 " in o + " "
    )
    diffs = [mean[s]["fedavg"] - mean[s]["pull-local-0.5"] for s in ("0", "1")]
    first, second = ("fedavg", "pull-local-0.5") if sum(diffs) >= 0 else ("pull-local-0.5", "fedavg")
    wins = sum(d > 0 for d in diffs) if first == "fedavg" else sum(d < 0 for d in diffs)
    assert line.startswith(f"{first} > {second} in {wins}/2 seeds, difference {abs(sum(diffs)) / 2:.2f}")
    assert (
        line in (exp / "results.md").read_text()
        and "Orderings of the per-domain mean BLEU" in (exp / "results.md").read_text()
    )

    # scripts/bleu_bootstrap.py rescores each server from its sentences' statistics: the same per-domain mean
    # BLEU as the experiment's, and a server against itself differs by exactly 0 in every resample
    def bootstrap(a, b):
        proc = fedmq_procs.run(
            [
                sys.executable,
                "scripts/bleu_bootstrap.py",
                str(exp),
                a,
                b,
                "--seeds",
                "0,1",
                "--scale",
                "smoke",
                "--resamples",
                "20",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.splitlines()

    lines = bootstrap("fedavg", "pull-local-0.5")
    for s, text in zip(("0", "1"), lines):
        assert text.startswith(
            f"seed {s}: fedavg - pull-local-0.5 = {mean[s]['fedavg'] - mean[s]['pull-local-0.5']:+.2f}, "
        )
    assert lines[2].startswith("mean over seeds: 95 % [")
    assert all(
        "= +0.00, 95 % [+0.00, +0.00], A ahead in 0.0% of 20" in t for t in bootstrap("fedavg", "fedavg")[:2]
    )
    # --only runs a subset of the grid (two processes can share a grid), reusing the finished runs; --set is
    # refused (it would change the federations but not the local-only baselines they are read against)
    subset = run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1), only="fedavg,pull-local-0.5")
    assert [r["run"] for r in subset["runs"]] == ["fedavg", "pull-local-0.5"]
    assert subset["per_seed"]["0"]["bleu_by_domain"]["server fedavg"] == table["server fedavg"]
    with pytest.raises(ExperimentError, match="no run name contains 'zzz'"):
        run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1), only="zzz")
    with pytest.raises(ExperimentError, match="--set applies to the language-modelling experiments"):
        run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1), overrides={"lr": 0.1})
    # a run folder kept without its weights (no best.pt) keeps its per-domain BLEU row
    fedavg = exp / "seed-0" / "fedavg"
    assert json.loads((fedavg / "summary.json").read_text())["test_bleu_by_domain"] == table["server fedavg"]
    (fedavg / "best.pt").unlink()
    again = run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1))
    assert again["per_seed"]["0"]["bleu_by_domain"]["server fedavg"] == table["server fedavg"]
    # one restored from before cross-entropy was measured keeps its BLEU row and has no cross-entropy row
    summary = json.loads((fedavg / "summary.json").read_text())
    del summary["test_ce_by_domain"]
    (fedavg / "summary.json").write_text(json.dumps(summary))
    again = run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1))
    assert again["per_seed"]["0"]["bleu_by_domain"]["server fedavg"] == table["server fedavg"]
    assert "server fedavg" not in again["per_seed"]["0"]["ce_by_domain"]
    assert "ce_mean_domains" not in again["per_seed"]["0"]["runs"][0]
    # without either, the row is refused, not scored on another model (the old fallback: the pre-trained one)
    summary = json.loads((fedavg / "summary.json").read_text())
    del summary["test_bleu_by_domain"]
    (fedavg / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ExperimentError, match="run fedavg has no best.pt and no per-domain BLEU"):
        run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1))
    # the pre-trained engine is cached by the pre-training settings alone: a change in how the clients train
    # reruns the local-only baselines (and the federations) but not the pre-training
    pre = (exp / "pretrained.pt").stat().st_mtime_ns, (exp / "pretrain.json").read_text()
    local = json.loads((exp / "local-only.json").read_text())["key"]
    monkeypatch.setitem(nmt_grid.NMT_SETTINGS["smoke"], "lr", 1e-3)
    changed = run_experiment("nmt-domains", "smoke", tmp_path, seeds=(0, 1), only="fedavg")
    assert ((exp / "pretrained.pt").stat().st_mtime_ns, (exp / "pretrain.json").read_text()) == pre
    assert json.loads((exp / "local-only.json").read_text())["key"] != local
    assert changed["runs"][0]["run"] == "fedavg"


def test_cli_topk_with_report(tmp_path):
    """`fedmq experiment topk --scale smoke`: top-K β=0.5 grants half the uploads;
    the report has its figures."""
    proc = fedmq_procs.run(
        fedmq_procs.command(
            "experiment",
            "topk",
            "--scale",
            "smoke",
            "--out",
            str(tmp_path),
            "--log-level",
            "warning",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fedmed-beta0.5" in proc.stdout
    results = json.loads((tmp_path / "topk" / "results.json").read_text())
    runs = _check_common(results, tmp_path, "topk")
    assert runs["fedmed-beta0.5"]["updates_received"] == 1 and runs["fedmed-beta1.0"]["updates_received"] == 2
    assert runs["fedmed-beta0.5"]["bytes_up"] < runs["fedmed-beta1.0"]["bytes_up"]
    assert list((tmp_path / "topk" / "report").glob("*.png"))


def test_central_baseline_matches_the_federations_token_passes(tmp_path):
    """C x K clients x E epochs of their shards a round = C x E epochs of the union, trained on one model."""
    from fedmq.benchmarks.experiments.runner import Runner
    from fedmq.tasks.lm_data import StreamBatches

    spec = next(s for s in grids.table2("smoke") if s.central)
    runner = Runner(tmp_path, Simulation)
    summary = runner.federate(spec, seed=0)
    union = runner.task("lm", {**spec.task_options, "clients": 1})
    windows = StreamBatches.build(union.client_ids(0), spec.job["batch_size"], union.vocab.eos).num_windows(
        union.bptt
    )
    assert summary["steps_per_round"] == math.ceil(spec.job["fraction"] * spec.job["epochs"] * windows)
    rows = [json.loads(line) for line in (tmp_path / spec.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, spec.job["rounds"] + 1))
    assert summary["best_valid"] == min(r["valid"] for r in rows) and math.isfinite(summary["test"])


def test_central_baseline_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Stopped in round 3 of 3, the centralized baseline's rerun trains round 3 only and ends with the numbers
    of an uninterrupted run (a round's seed is fixed by the run's seed and the round)."""
    from dataclasses import replace

    from fedmq.benchmarks.experiments.runner import Runner

    spec = next(s for s in grids.table2("smoke") if s.central)
    spec = replace(spec, job={**spec.job, "rounds": 3})
    whole = Runner(tmp_path / "whole", Simulation).federate(spec, seed=0)
    runner = Runner(tmp_path / "stopped", Simulation)
    union = runner.task("lm", {**spec.task_options, "clients": 1})
    train, calls = union.train, []

    def stop_in_round_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return train(*args, **kwargs)

    monkeypatch.setattr(union, "train", stop_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        runner.federate(spec, seed=0)
    assert len(read_rows(tmp_path / "stopped" / spec.name)) == 2
    calls.clear()
    resumed = runner.federate(spec, seed=0)
    assert len(calls) == 1  # round 3 only
    rows = read_rows(tmp_path / "stopped" / spec.name)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["valid"] for r in rows] == [r["valid"] for r in read_rows(tmp_path / "whole" / spec.name)]
    assert (resumed["test"], resumed["best_round"]) == (whole["test"], whole["best_round"])


def test_a_run_made_under_an_older_default_is_run_again(tmp_path):
    """A finished run whose config.json says it ran otherwise than its cell is replaced: a ``fedmed`` run that
    records JS weights other than the paper's (``fedmed_js``, the setting FedMed's variants were before they
    had names) ran as that variant, not as FedMed. One that differs only in a setting its strategy does not
    read, or predates a setting now at its default, is kept."""
    from fedmq.benchmarks.experiments.runner import Runner, ran_strategy

    specs = {s.name: s for s in grids.table2("smoke")}
    runner = Runner(tmp_path, Simulation)
    for name in ("wikitext-2-fedavg-c0.5", "wikitext-2-fedmed-c0.5"):
        runner.federate(specs[name], seed=0)
        config = tmp_path / name / "config.json"
        recorded = json.loads(config.read_text())
        assert recorded["amp"] is False and ran_strategy(recorded) == specs[name].job["strategy"]
        del recorded["amp"]  # as if run before the setting existed
        config.write_text(json.dumps({**recorded, "fedmed_js": "standardised"}))
        assert ran_strategy(json.loads(config.read_text())) == specs[name].job["strategy"].replace(
            "fedmed", "fedmed-standardised"
        )
    stamp = {
        name: (tmp_path / name / "metrics.jsonl").stat().st_mtime_ns
        for name in ("wikitext-2-fedavg-c0.5", "wikitext-2-fedmed-c0.5")
    }
    for name in stamp:
        runner.federate(specs[name], seed=0)
    assert (tmp_path / "wikitext-2-fedavg-c0.5" / "metrics.jsonl").stat().st_mtime_ns == stamp[
        "wikitext-2-fedavg-c0.5"
    ]
    assert (tmp_path / "wikitext-2-fedmed-c0.5" / "metrics.jsonl").stat().st_mtime_ns != stamp[
        "wikitext-2-fedmed-c0.5"
    ]
    again = json.loads((tmp_path / "wikitext-2-fedmed-c0.5" / "config.json").read_text())
    assert again["strategy"] == "fedmed" and ran_strategy(again) == "fedmed"


def test_a_finished_run_of_many_clients_is_kept_on_rerun(tmp_path):
    """Simulations once raised heartbeat_s with K (presence traffic), so the config.json of a run made then
    records more than the spec asks; that is timing, not a setting the result depends on. Before it was
    ignored, every K = 100 paper-scale run was deleted and started again by the same command."""
    from dataclasses import replace

    from fedmq.benchmarks.experiments.runner import Runner

    spec = next(s for s in grids.table2("smoke") if s.name == "wikitext-2-fedavg-c0.5")
    spec = replace(spec, job={**spec.job, "clients": 60}, task_options={**spec.task_options, "clients": 60})
    runner = Runner(tmp_path, Simulation)
    first = runner.federate(spec, seed=0)
    config = tmp_path / spec.name / "config.json"
    recorded = json.loads(config.read_text())
    assert (spec.job["heartbeat_s"], recorded["heartbeat_s"]) == (1.0, 1.0)
    config.write_text(json.dumps({**recorded, "heartbeat_s": 1.2}))  # as a run of the older simulation
    stamp = (tmp_path / spec.name / "metrics.jsonl").stat().st_mtime_ns
    assert runner.federate(spec, seed=0)["test"] == first["test"]
    assert (tmp_path / spec.name / "metrics.jsonl").stat().st_mtime_ns == stamp


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_seeds_give_mean_and_sd_and_a_rerun_resumes(tmp_path):
    results = run_experiment("table2", "smoke", tmp_path, seeds=[0, 1], only="fedavg,central")
    runs = {r["run"]: r for r in results["runs"]}
    assert set(runs) == {"wikitext-2-fedavg-c0.5", "wikitext-2-central-c0.5"}
    # config.json records the run's seed; the task's
    # (its shards are drawn with seed 0 in every seed) beside it
    recorded = json.loads(
        (tmp_path / "table2" / "seed-1" / "wikitext-2-fedavg-c0.5" / "config.json").read_text()
    )
    assert (recorded["seed"], recorded["shard_seed"]) == (1, 0)
    for name, row in runs.items():
        tests = [
            results["per_seed"][s]["runs"][i]["test"]
            for s in ("0", "1")
            for i, r in enumerate(results["per_seed"][s]["runs"])
            if r["run"] == name
        ]
        assert row["seeds"] == 2 and row["test"] == pytest.approx(sum(tests) / 2)
        assert row["test_sd"] == pytest.approx(abs(tests[0] - tests[1]) / math.sqrt(2))
        each = [next(r for r in results["per_seed"][s]["runs"] if r["run"] == name) for s in ("0", "1")]
        assert (
            row["best_round"] == f"{each[0]['best_round']} / {each[1]['best_round']}"
        )  # rounds are not averaged
        assert row["bytes_up"] == round((each[0]["bytes_up"] + each[1]["bytes_up"]) / 2)
        assert (tmp_path / "table2" / "seed-1" / name / "summary.json").is_file()
    assert tests[0] != tests[1]  # the seed changes shards, init and sampling
    per = {s: {r["run"]: r["test"] for r in results["per_seed"][s]["runs"]} for s in ("0", "1")}
    diffs = [per[s]["wikitext-2-central-c0.5"] - per[s]["wikitext-2-fedavg-c0.5"] for s in ("0", "1")]
    low, high = "wikitext-2-fedavg-c0.5", "wikitext-2-central-c0.5"
    if sum(diffs) < 0:
        low, high, diffs = high, low, [-d for d in diffs]
    [line] = results["orderings"]
    assert line.startswith(
        f"{low} < {high} in {sum(d > 0 for d in diffs)}/2 seeds, difference {sum(diffs) / 2:.2f}"
    )
    md = (tmp_path / "table2" / "results.md").read_text()
    assert "seeds 0, 1, mean ± sd" in md and "test_sd" in md and line in md
    # the same command again: every run is already done, nothing is retrained
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "table2").rglob("metrics.jsonl")}
    again = run_experiment("table2", "smoke", tmp_path, seeds=[0, 1], only="fedavg,central")
    assert [r["test"] for r in again["runs"]] == [r["test"] for r in results["runs"]]
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    # a changed setting is a different run: it replaces the folder
    run_experiment("table2", "smoke", tmp_path, seeds=[0, 1], only="fedavg-c", overrides={"lr": 0.5})
    changed = tmp_path / "table2" / "seed-0" / "wikitext-2-fedavg-c0.5" / "metrics.jsonl"
    assert changed.stat().st_mtime_ns != stamp[changed]
    # --set clients=K changes the task's shards too (else agents beyond the task's clients would find none)
    k3 = run_experiment("table2", "smoke", tmp_path / "k3", only="fedavg-c0.5", overrides={"clients": 3})
    config = json.loads((tmp_path / "k3" / "table2" / "wikitext-2-fedavg-c0.5" / "config.json").read_text())
    assert (
        config["clients"] == 3
    )  # the task's shard count (config.json holds the job's settings, then the task's)
    assert all(r["rounds_completed"] == 1 for r in k3["runs"])  # the smoke scale runs one round


def test_sweep_reports_smoothness(tmp_path):
    results = run_experiment("sweep", "smoke", tmp_path)
    runs = _check_common(results, tmp_path, "sweep")
    assert {(r["lr"], r["momentum"]) for r in runs.values()} == {(1.0, 0.5), (0.5, 0.9)}
    assert max_jump([300.0, 200.0, 150.0, 240.0, 100.0]) == pytest.approx(1.6)
    assert max_jump([300.0, 200.0, 150.0]) is None


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path):
    with pytest.raises(ExperimentError, match="unknown experiment 'tabel2'"):
        run_experiment("tabel2", "smoke", tmp_path)
    with pytest.raises(ExperimentError, match="unknown scale"):
        run_experiment("table2", "gpu", tmp_path)
    with pytest.raises(ExperimentError, match="no run name contains 'zzz'"):
        run_experiment("table2", "smoke", tmp_path, only="zzz")
    with pytest.raises(FedmqError, match="unknown config key"):
        run_experiment("table2", "smoke", tmp_path, overrides={"roundz": 3})
    with pytest.raises(FedmqError, match=r"rounds \(--rounds\) must be at least 1"):
        run_experiment("topk", "smoke", tmp_path, overrides={"rounds": 0})
    for bad in ("0,x", "1,1", "-1"):
        with pytest.raises(ExperimentError, match="--seeds wants"):
            experiments.parse_seeds(bad)
    for args, message in (
        (["nope"], "unknown experiment 'nope'"),
        (["table2", "--seeds", "1,1"], "--seeds wants distinct"),
        (["table2", "--device", "tpu"], "unknown device (--device) 'tpu'"),
    ):
        proc = fedmq_procs.run(
            fedmq_procs.command("experiment", *args, "--out", str(tmp_path)),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, args
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_missing_corpus_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """Without the corpus the grid reads, the error names the folder looked in and FEDMQ_DATA_DIR; no
    experiment folder (not even its log) is written."""
    empty = tmp_path / "data"
    empty.mkdir()
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(empty))
    where = re.escape(f"at {empty / 'wikitext-2'} (looked there: no such folder), or set FEDMQ_DATA_DIR")
    with pytest.raises(ExperimentError, match=f"corpus 'wikitext-2' is not on this machine: put .* {where}"):
        run_experiment("table2", "smoke", tmp_path / "out")
    with pytest.raises(ExperimentError, match="corpus 'de-en' is not on this machine"):
        run_experiment("nmt-domains", "smoke", tmp_path / "out")
    proc = fedmq_procs.run(
        fedmq_procs.command("experiment", "table2", "--scale", "smoke")
        + ["--seeds", "0", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (
        proc.stderr.startswith("error: corpus 'wikitext-2' is not on this machine")
        and str(empty) in proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_reproduce_script_reports_a_bad_name_in_one_line():
    """scripts/reproduce.py (docs/results/method.md) runs outside the CLI:
    it imports cli and benchmarks side by side."""
    proc = fedmq_procs.run(
        [sys.executable, "scripts/reproduce.py", "tabel2", "--scale", "smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "tabel2" in proc.stderr


def test_a_configuration_shared_by_experiments_is_trained_once(tmp_path):
    """FedAvg at C = 0.5 is a cell of randomization (noise 0) and of fraction: the second experiment copies
    the first one's finished run instead of training it again; a changed setting, or another seed, trains."""
    calls = []

    def counting(cfg, *args, **kwargs):
        calls.append(cfg.job)
        return Simulation(cfg, *args, **kwargs)

    first = experiments.run_experiment("randomization", "smoke", tmp_path, simulation=counting, only="fedavg")
    (tmp_path / "junk" / "x").mkdir(parents=True)
    (tmp_path / "junk" / "x" / "spec.json").write_text("{not json")  # a damaged marker is never a source
    assert len(calls) == 2  # noise 0 and 0.01
    again = experiments.run_experiment("fraction", "smoke", tmp_path, simulation=counting, only="fedavg")
    assert len(calls) == 2  # nothing trained
    [src, _], [row] = first["runs"], again["runs"]
    assert row["test"] == src["test"] and row["valid_curve"] == src["valid_curve"]
    marker = json.loads((tmp_path / "fraction" / "fedavg-c0.5" / "spec.json").read_text())
    assert marker["done"] and marker["reused"] == str(tmp_path / "randomization" / "fedavg-noise0.0")
    assert (tmp_path / "fraction" / "fedavg-c0.5" / "metrics.jsonl").read_bytes() == (
        tmp_path / "randomization" / "fedavg-noise0.0" / "metrics.jsonl"
    ).read_bytes()
    experiments.run_experiment(
        "fraction", "smoke", tmp_path, simulation=counting, only="fedavg", overrides={"lr": 0.5}
    )
    experiments.run_experiment(
        "fraction", "smoke", tmp_path / "other", simulation=counting, seeds=[1], only="fedavg"
    )
    assert calls == ["exp-fedavg-noise0_0", "exp-fedavg-noise0_01", "exp-fedavg-c0_5", "exp-fedavg-c0_5"]


def test_only_picks_a_whole_name_exactly_and_otherwise_by_containment():
    grid = grids.EXPERIMENTS["rounds-to-target"]("cpu")
    assert [s.name for s in grids.select(grid, "fedavg-e1", None)] == ["fedavg-e1"]
    assert [s.name for s in grids.select(grid, "fedavg-e1,fp16", None)] == [
        "fedavg-e1",
        "fedavg-e1-fp16",
    ]
    assert [s.name for s in grids.select(grid, "avg-e1", None)] == [
        "fedavg-e1",
        "fedavg-e1-fp16",
        "fedavg-e1-delta-int8",
    ]


def test_paper_fedsgd_cuts_a_shard_into_more_streams_and_nothing_else_changes_b():
    """Only the paper scale's FedSGD cells (one full-batch step) take PAPER_FEDSGD_STREAMS; every minibatch
    cell keeps the reference code's B = 10, and the smaller scales keep theirs."""
    paper = {s.name: s.job["batch_size"] for s in grids.table2("paper")}
    assert {n: b for n, b in paper.items() if "fedsgd" in n} == {"wikitext-2-fedsgd": 100, "ptb-fedsgd": 100}
    assert {b for n, b in paper.items() if "fedsgd" not in n} == {10}
    assert {s.job["batch_size"] for s in grids.table2("cpu")} == {10}


def test_cohort_reaches_each_federation_of_an_experiment(tmp_path):
    """--cohort is how the runs train, not what they are: every federation of the grid gets it, trains its
    rounds' clients together, and the FedMed cell (its LSTM, tail losses) scores as it does one client at a
    time."""
    sims: list[Simulation] = []

    def keeping(*args, **kwargs):
        sims.append(Simulation(*args, **kwargs))
        return sims[-1]

    together = experiments.run_experiment(
        "table2", "smoke", tmp_path / "together", simulation=keeping, only="fedmed-c0.5", cohort=True
    )
    alone = experiments.run_experiment(
        "table2", "smoke", tmp_path / "alone", simulation=Simulation, only="fedmed-c0.5"
    )
    assert [s.cohort for s in sims] == [True] and sims[0].pool.cohorts == [2]  # C = 0.5 of K = 4, one round
    [t], [a] = together["runs"], alone["runs"]
    assert t["test"] == pytest.approx(a["test"], rel=1e-4)
