"""Named reproductions of the seed papers' experiments (issue 8): ``fedmq experiment NAME --scale S --out DIR``.

Papers: FedAtt (Ji et al. 2019), FedMed (Wu et al. 2020), dynamic pulling (Passban et al. 2022).
Every experiment is a grid of federations run one after the other with :class:`cli.simulate.Simulation` over
the in-process broker (``memory://``, the same engine/agent/codec code path as RabbitMQ). Each federation
writes a normal run folder ``OUT/NAME/<run>/`` (config.json, metrics.jsonl, summary.json); the experiment
writes ``OUT/NAME/results.json`` + ``results.md`` (one row per run) and ``OUT/NAME/report/`` (``fedmq report``
of all its runs). Reruns into the same folder replace that experiment's run folders.

Scales (same code path, only numbers differ):

* ``paper``: the papers' settings (100 IID clients, 50 rounds, GRU-300 / LSTM 2x400, full vocabulary, full
  validation and test splits; Transformer-base for translation). Meant for a GPU machine.
* ``cpu``: what finishes on 2 shared CPU cores in a few minutes per experiment: 10 clients, 5 rounds, the first
  2,000 training lines, vocabulary capped at 2,000 words, at most 5 local SGD steps (batch 10) per round
  (``max_steps``), validation/test on the first 100 lines (``max_eval_lines``) -- so the numbers are NOT
  comparable in absolute value with the papers', only the ordering of methods is.
* ``smoke``: CI; a reduced grid, one or two rounds, tiny slices, tiny models.

Local training is SGD lr 20, clip 0.25, batch 20, BPTT 35, dropout 0.2 (pytorch/examples word_language_model).
That is NOT the papers' regime (docs/results.md): FedAtt's client update is SGD with momentum, its reference code
(shaoxiongji/fed-att) uses lr 0.01, momentum 0.5, E = 5, B = 10, no clipping; FedMed decays the learning rate.
Moving the scales to the papers' regime is issue #14. The score is the test perplexity of the
best-on-validation global model (as both LM papers report).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog
import torch

from aggregator.config import JobConfig
from broker.errors import FedmqError
from client_agent.tasks.base import Task, TrainConfig, load_state, model_state

log = structlog.get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FEDMQ_DATA", ROOT.parent / "shared" / "data"))
SCALES = ("smoke", "cpu", "paper")


class ExperimentError(FedmqError):
    pass


@dataclass
class RunSpec:
    """One federation of an experiment's grid."""

    name: str  # run folder name
    task: str  # "lm" | "nmt"
    task_options: dict[str, Any]
    job: dict[str, Any]  # JobConfig keyword arguments
    labels: dict[str, Any] = field(default_factory=dict)  # columns of the results table
    availability: str = "always"
    faults: str = ""


# ----------------------------------------------------------------------------------------------- LM scales
# task options and job settings shared by the language-modelling experiments, per scale
_LM_TASK = {
    "paper": dict(model="gru-small", vocab_size=0, max_lines=0, max_eval_lines=0, clients=100),
    "cpu": dict(model="gru-small", vocab_size=2000, max_lines=2000, max_eval_lines=100, clients=10),
    "smoke": dict(model="gru-tiny", vocab_size=300, max_lines=120, max_eval_lines=10, clients=4),
}
_LM_JOB = {
    "paper": dict(clients=100, rounds=50, epochs=1, batch_size=20, lr=20.0, max_steps=0),
    "cpu": dict(clients=10, rounds=5, epochs=1, batch_size=10, lr=20.0, max_steps=5),
    "smoke": dict(clients=4, rounds=1, epochs=1, batch_size=4, lr=20.0, max_steps=2),
}
_DEADLINES = dict(report_deadline_s=120.0, update_deadline_s=120.0, join_timeout_s=60.0, heartbeat_s=1.0)
# FedMed's model is an LSTM (300 + 2x400); at the smoke scale a tiny LSTM keeps CI fast
_FEDMED_MODEL = {"paper": dict(model="lstm", tied=False), "cpu": dict(model="lstm", tied=False),
                 "smoke": dict(model="lstm", tied=False, emb=16, hidden=16, layers=2)}


def _corpus(name: str) -> str:
    return str(DATA / name)


def _lm(scale: str, name: str, labels: dict[str, Any], corpus: str = "wikitext-2", task: dict | None = None,
        lstm: bool = False, **job: Any) -> RunSpec:
    """An LM federation; ``lstm``: FedMed runs on FedMed's LSTM (Table 2), else on the same GRU as the others."""
    options = {**_LM_TASK[scale], "data": _corpus(corpus), "tied": True, **(task or {})}
    settings = {**_LM_JOB[scale], **_DEADLINES, **job}
    options["clients"] = settings["clients"]
    if settings.get("strategy") == "fedmed" and lstm:
        options.update(_FEDMED_MODEL[scale])
    return RunSpec(name, "lm", options, settings, {"corpus": corpus, **labels})


def _model(scale: str, strategy: str) -> str:
    return (_FEDMED_MODEL if strategy == "fedmed" else _LM_TASK)[scale]["model"]


def _pick(scale: str, smoke: list, cpu: list, paper: list) -> list:
    return {"smoke": smoke, "cpu": cpu, "paper": paper}[scale]


def table2(scale: str) -> list[RunSpec]:
    """FedAtt Table II + FedMed Table 2: FedSGD, FedAvg, FedAtt (GRU), FedMed (LSTM) at C = 0.1 and 0.5."""
    runs = []
    for corpus in _pick(scale, ["wikitext-2"], ["wikitext-2", "ptb"], ["wikitext-2", "ptb"]):
        runs.append(_lm(scale, f"{corpus}-fedsgd", {"strategy": "fedsgd", "C": 1.0}, corpus, strategy="fedsgd",
                        fraction=1.0))
        for c in _pick(scale, [0.5], [0.1, 0.5], [0.1, 0.5]):
            for s in ("fedavg", "fedatt", "fedmed"):
                runs.append(_lm(scale, f"{corpus}-{s}-c{c}", {"strategy": s, "C": c, "model": _model(scale, s)}, corpus,
                                lstm=True, strategy=s, fraction=c))
    return runs


def fraction(scale: str) -> list[RunSpec]:
    """FedAtt Fig. 2 / FedMed Fig. 4: test perplexity vs the client fraction C."""
    cs = _pick(scale, [0.5], [0.2, 0.5, 0.9], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    return [_lm(scale, f"{s}-c{c}", {"strategy": s, "C": c}, strategy=s, fraction=c)
            for c in cs for s in ("fedavg", "fedatt", "fedmed")]


def rounds_to_target(scale: str) -> list[RunSpec]:
    """FedAtt Fig. 3 / FedMed Fig. 6: rounds (and bytes) until validation perplexity reaches a target."""
    runs = []
    for e in _pick(scale, [1], [1, 2], [1, 5, 10]):
        for s in ("fedavg", "fedatt", "fedmed"):
            runs.append(_lm(scale, f"{s}-e{e}", {"strategy": s, "E": e, "encoding": "raw"}, strategy=s, fraction=0.5,
                            epochs=e, max_steps=_LM_JOB[scale]["max_steps"] * e))
    for enc in _pick(scale, ["delta+int8"], ["fp16", "delta+int8"], ["fp16", "delta+int8", "delta+topk:0.1"]):
        safe = enc.replace("+", "-").replace(":", "")
        runs.append(_lm(scale, f"fedavg-e1-{safe}", {"strategy": "fedavg", "E": 1, "encoding": enc}, strategy="fedavg",
                        fraction=0.5, encoding=enc))
    return runs


def topk(scale: str) -> list[RunSpec]:
    """FedMed Fig. 5: top-K share β of the reporting clients allowed to upload, vs upload bytes."""
    betas = _pick(scale, [0.5, 1.0], [0.3, 0.5, 0.7, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    return [_lm(scale, f"fedmed-beta{b}", {"strategy": "fedmed", "beta": b}, strategy="fedmed", fraction=0.5, beta=b)
            for b in betas]


def randomization(scale: str) -> list[RunSpec]:
    """FedAtt Table III: FedAvg vs FedAtt with the clients adding noise·N(0, 1) to their weights."""
    noises = _pick(scale, [0.0, 0.01], [0.0, 0.005, 0.05], [0.0, 0.001, 0.005, 0.01, 0.05])
    return [_lm(scale, f"{s}-noise{n}", {"strategy": s, "noise": n}, strategy=s, fraction=0.5, noise=n)
            for n in noises for s in ("fedavg", "fedatt")]


def model_scale(scale: str) -> list[RunSpec]:
    """FedAtt Table IV: small / medium / large GRU, tied / untied (FedAtt). Large only at the paper scale."""
    sizes = _pick(scale, ["gru-tiny"], ["gru-small", "gru-medium"], ["gru-small", "gru-medium", "gru-large"])
    return [_lm(scale, f"fedatt-{m}-{'tied' if t else 'untied'}", {"strategy": "fedatt", "model": m, "tied": t},
                task={"model": m, "tied": t}, strategy="fedatt", fraction=0.5)
            for m in sizes for t in (True, False)]


def dropout(scale: str, out: Path | None = None) -> list[RunSpec]:
    """Beyond the papers: FedAvg with clients going offline (availability models) and crashing mid-round."""
    specs = [("always", ""), ("bernoulli:0.9", ""), ("bernoulli:0.7", ""), ("bernoulli:0.5", ""),
             ("markov:0.8,0.5", ""), ("trace", ""), ("always", "crash-train:0.2")]
    if scale == "smoke":
        specs = [("bernoulli:0.7", "crash-train:0.2"), ("trace", "")]
    # a missing selected client costs a deadline: keep the deadlines short at the small scales
    deadlines = {"paper": {}, "cpu": dict(report_deadline_s=20.0, update_deadline_s=20.0),
                 "smoke": dict(report_deadline_s=5.0, update_deadline_s=5.0)}[scale]
    runs = []
    for avail, faults in specs:
        name = avail.replace(":", "").replace(",", "-") + (f"-{faults.replace(':', '')}" if faults else "")
        spec = _lm(scale, name, {"availability": avail, "faults": faults or "-"}, strategy="fedavg", fraction=0.5,
                   **deadlines)
        spec.availability, spec.faults = avail, faults
        runs.append(spec)
    return runs


def _trace_file(out: Path, clients: int, rounds: int) -> Path:
    """A FedScale-style trace: client i is offline for 2 rounds out of every (3 + i % 4), shifted by i."""
    spans: dict[str, list[list[int]]] = {}
    for i in range(clients):
        period, off = 3 + i % 4, 2
        spans[f"agent-{i}"] = [[s, s + period - off] for s in range(-period + i % period, rounds + period, period)]
    path = out / "availability-trace.json"
    path.write_text(json.dumps(spans))
    return path


# ----------------------------------------------------------------------------------------------- NMT
# task: TranslationTask options. pretrain_*: phase 1, Adam on the pairs of ``pretrain_domains`` (the first
# ``pretrain_max_lines`` of each, 0 = all; minus every pair whose source is in a valid/test split; pairs longer
# than max_len subwords skipped) for ``pretrain_steps`` steps of ``pretrain_batch`` pairs, lr warm-up over
# ``pretrain_warmup`` steps to ``pretrain_lr`` then linear decay to 0. lr: the clients' Adam lr (local only and
# federated); rounds x max_steps local steps of batch_size pairs; per_domain_test: BLEU on the first N test
# pairs of each domain.
_NMT = {
    "paper": dict(task=dict(model="base", domains=None, max_lines=0, vocab_size=32000, eval_max_sentences=0),
                  pretrain_domains=["news_wmt"], pretrain_max_lines=0, pretrain_steps=100_000,
                  pretrain_batch=64, pretrain_lr=7e-4, pretrain_warmup=4000, lr=5e-4,
                  rounds=5, max_steps=0, batch_size=64, per_domain_test=0, fractions=(0.5, 0.33)),
    "cpu": dict(task=dict(model="mini", domains=["news_wmt", "subtitles_opensubs", "ted_iwslt14", "software_it"],
                          max_lines=3000, vocab_size=4000, eval_max_sentences=40, max_len=64, dropout=0.0),
                pretrain_domains=["news_wmt"], pretrain_max_lines=0, pretrain_steps=4000, pretrain_batch=32,
                pretrain_lr=4e-3, pretrain_warmup=200, lr=5e-4,
                rounds=3, max_steps=20, batch_size=24, per_domain_test=100, fractions=(0.5, 0.33)),
    "smoke": dict(task=dict(model="tiny", domains=["news_wmt", "ted_iwslt14"], max_lines=60, vocab_size=300,
                            eval_max_sentences=6),
                  pretrain_domains=["news_wmt"], pretrain_max_lines=60, pretrain_steps=2, pretrain_batch=8,
                  pretrain_lr=5e-4, pretrain_warmup=0, lr=5e-4,
                  rounds=2, max_steps=1, batch_size=8, per_domain_test=3, fractions=(0.5, 0.33)),
}


def pretrain_pairs(task: Any, domains: list[str], max_lines: int) -> list[Any]:
    """The pre-training pairs: every pair of ``domains`` (the first ``max_lines`` lines of each, 0 = all) whose
    source sentence is not in any valid or test split of ``task`` (so no evaluated sentence is trained on)."""
    from client_agent.tasks.nmt_data import load_parallel

    held = {p.src for split in ("valid", "test") for p in task.corpus.splits[split]}
    corpus = load_parallel(_corpus("de-en"), domains, max_lines or None)
    return [p for split in ("train", "valid", "test") for p in corpus.splits[split] if p.src not in held]


class WarmStartTask:
    """A task whose ``build_model`` starts from a given state (the pre-trained model); all else delegated."""

    def __init__(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        self._task = task
        self._state = state

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        model = self._task.build_model(seed)
        load_state(model, self._state)
        return model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def domain_bleu(task: Any, model: torch.nn.Module, split: str = "test", per_domain: int = 0) -> dict[str, float]:
    """BLEU of ``model`` on each domain's ``split`` pairs (the first ``per_domain`` of each; 0 = all)."""
    from client_agent.tasks.nmt import corpus_bleu

    scores = {}
    for domain in task.corpus.domains:
        pairs = [p for p in task.corpus.splits[split] if p.domain == domain]
        if per_domain:
            pairs = pairs[:per_domain]
        hyps = task.translate(model, [p.src for p in pairs])
        scores[domain] = corpus_bleu(hyps, [p.tgt for p in pairs])
    return scores


# ----------------------------------------------------------------------------------------------- running
EXPERIMENTS: dict[str, Callable[..., list[RunSpec]]] = {
    "table2": table2, "fraction": fraction, "rounds-to-target": rounds_to_target, "topk": topk,
    "randomization": randomization, "scale": model_scale, "dropout": dropout,
}
NAMES = (*EXPERIMENTS, "nmt-domains")


_TASKS: dict[str, Task] = {}  # built tasks by options, shared by the experiments of one process


@dataclass
class Runner:
    """Runs the federations of an experiment one after the other; tasks with equal options are built once."""

    out: Path
    tasks: dict[str, Task] = field(default_factory=lambda: _TASKS)

    def task(self, kind: str, options: dict[str, Any]) -> Task:
        from client_agent.tasks.registry import make_task

        key = json.dumps([kind, options], sort_keys=True, default=str)
        if key not in self.tasks:
            self.tasks[key] = make_task(kind, **options)
        return self.tasks[key]

    def federate(self, spec: RunSpec, task: Any = None, seed: int = 0) -> dict[str, Any]:
        from cli.simulate import Simulation

        run_dir = self.out / spec.name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        task = task if task is not None else self.task(spec.task, spec.task_options)
        job = re.sub(r"[^A-Za-z0-9_-]", "_", f"exp-{spec.name}")[:64]
        # lossless wire unless a run says otherwise: the reproductions compare algorithms, not encodings
        cfg = JobConfig(job=job, seed=seed, **{"encoding": "raw", "down_encoding": "raw", **spec.job})
        sim = Simulation(cfg, task, f"memory://{job}", run_dir, availability=spec.availability,
                         faults=spec.faults)
        started = time.time()
        summary = sim.run()
        summary["run_wall_s"] = time.time() - started
        log.info("experiment run done", run=spec.name, test=summary.get("test"), wall_s=round(summary["run_wall_s"], 1))
        return summary


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _row(spec: RunSpec, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    rows = _metrics(run_dir)
    return {"run": spec.name, **spec.labels, "test": summary.get("test"), "best_valid": summary.get("best_valid"),
            "best_round": summary.get("best_round"), "rounds_completed": summary.get("rounds_completed"),
            "rounds_skipped": summary.get("rounds_skipped"), "bytes_up": summary.get("bytes_up"),
            "bytes_down": summary.get("bytes_down"), "bytes_up_raw": sum(r.get("bytes_up_raw") or 0 for r in rows),
            "bytes_down_raw": sum(r.get("bytes_down_raw") or 0 for r in rows),
            "updates_received": sum(len(r.get("received") or []) for r in rows),
            "valid_curve": [r.get("valid") for r in rows], "wall_s": round(summary.get("run_wall_s", 0.0), 1)}


def rounds_to(rows: list[dict[str, Any]], target: float) -> tuple[int | None, int | None]:
    """(first round whose validation perplexity <= target, cumulative bytes up+down until then) or (None, None)."""
    total = 0
    for r in rows:
        total += (r.get("bytes_up") or 0) + (r.get("bytes_down") or 0)
        v = r.get("valid")
        if v is not None and v <= target:
            return int(r["round"]), total
    return None, None


def add_rounds_to_target(out: Path, results: list[dict[str, Any]], reference: str) -> float | None:
    """Target = the best validation perplexity the ``reference`` run reached; fills rounds/bytes to reach it.

    (The best, not the last: at small scales the validation curve is far from monotone, and the last value
    is often reached by every run in round 1.)"""
    ref = next((r for r in results if r["run"] == reference), None)
    curve = [v for v in (ref or {}).get("valid_curve", []) if v is not None]
    if not curve:
        return None
    target = min(curve)
    for r in results:
        r["target"] = target
        r["rounds_to_target"], r["bytes_to_target"] = rounds_to(_metrics(out / r["run"]), target)
    return target


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.2f}" if abs(value) >= 10 or value == 0 else f"{value:.4g}"
    if isinstance(value, list):
        return " ".join(_fmt(v) if v is not None else "·" for v in value)
    return str(value)


def markdown(results: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    columns = columns or [k for k in results[0] if k != "valid_curve"] if results else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def select(specs: list[RunSpec], only: str | None, overrides: dict[str, Any] | None) -> list[RunSpec]:
    """Keep the runs whose name contains ``only`` (comma-separated alternatives) and apply job ``overrides``."""
    wanted = [w for w in (only or "").split(",") if w]
    picked = [s for s in specs if not wanted or any(w in s.name for w in wanted)]
    if not picked:
        raise ExperimentError(f"no run name contains {only!r}; runs: {', '.join(s.name for s in specs)}")
    for spec in picked:
        spec.job.update(overrides or {})
        JobConfig.from_dict({"job": "check", **spec.job})  # a bad override fails here, before anything runs
    return picked


def run_lm_experiment(name: str, scale: str, out: Path, seed: int = 0, only: str | None = None,
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    runner = Runner(out)
    specs = select(EXPERIMENTS[name](scale), only, overrides)
    if name == "dropout":
        for spec in specs:
            if spec.availability == "trace":
                spec.availability = f"trace:{_trace_file(out, spec.job['clients'], spec.job['rounds'])}"
    results = []
    for spec in specs:
        summary = runner.federate(spec, seed=seed)
        results.append(_row(spec, summary, out / spec.name))
    info: dict[str, Any] = {}
    if name == "rounds-to-target":
        info["target"] = add_rounds_to_target(out, results, "fedavg-e1")
    return {"runs": results, **info}


def run_nmt_domains(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    """Passban et al.: pre-train on news, one client per domain, FedAvg; then DP_l / DP_g / random pulling."""
    s = _NMT[scale]
    runner = Runner(out)
    options = {**s["task"], "data": _corpus("de-en"), "partition": "natural", "seed": seed,
               "cache_dir": str(out / "spm-cache")}
    options = {k: v for k, v in options.items() if v is not None}
    task = runner.task("nmt", options)
    names = list(task.shard_names)
    train = dict(batch_size=s["batch_size"], lr=s["lr"], optimizer="adam", clip=1.0, seed=seed)
    pre_label = f"pre-trained ({'+'.join(s['pretrain_domains'])})"
    n = s["per_domain_test"]
    # phases 1-2 are cached in OUT (pretrained.pt + pretrain.json) for the same settings: a rerun skips them
    key = json.dumps({**options, **{k: v for k, v in s.items() if k != "fractions"}, "seed": seed}, sort_keys=True)
    cache_pt, cache_json = out / "pretrained.pt", out / "pretrain.json"
    cached = json.loads(cache_json.read_text()) if cache_json.is_file() and cache_pt.is_file() else {}
    if cached.get("key") == key:
        pretrained = torch.load(cache_pt, weights_only=True)
        table, pretrain_s, pretrain_info = cached["table"], cached["pretrain_s"], cached.get("pretrain", {})
    else:
        # 1. pre-train on the news/WMT data (not only the news client's shard), evaluated sentences excluded
        started = time.time()
        data = task.encode_pairs(pretrain_pairs(task, s["pretrain_domains"], s["pretrain_max_lines"]))
        model = task.build_model(seed)
        every = max(1, s["pretrain_steps"] // 20)

        def progress(step: int, total: int) -> None:
            if step % every == 0:
                log.info("pre-training", step=step, of=total, seconds=round(time.time() - started, 1))

        cfg = TrainConfig(batch_size=s["pretrain_batch"], lr=s["pretrain_lr"], optimizer="adam", clip=1.0,
                          max_steps=s["pretrain_steps"], warmup_steps=s["pretrain_warmup"], linear_decay=True,
                          adam_betas=(0.9, 0.98), seed=seed)
        result = task.pretrain(model, data, cfg, progress)
        pretrained = {k: v.detach().clone() for k, v in model_state(model).items()}
        pretrain_s = time.time() - started
        pretrain_info = {"pairs": len(data), "tokens": result.tokens, "loss": round(result.loss, 4),
                         "train_s": round(result.seconds, 1)}
        log.info("pre-training done", **pretrain_info)
        table = {pre_label: domain_bleu(task, model, "test", n)}
        # 2. each client alone: fine-tune the pre-trained model on its own domain, as many steps as the federation
        local_steps = s["rounds"] * (s["max_steps"] or 0)
        for i, client in enumerate(names):
            m = task.build_model(seed)
            load_state(m, pretrained)
            task.train(m, i, TrainConfig(epochs=s["rounds"] if not local_steps else 100, max_steps=local_steps, **train))
            table[f"client {client} (local only)"] = domain_bleu(task, m, "test", n)
        torch.save(pretrained, cache_pt)
        cache_json.write_text(json.dumps({"key": key, "table": table, "pretrain_s": pretrain_s,
                                          "pretrain": pretrain_info}))
    warm = WarmStartTask(task, pretrained)
    job = dict(clients=len(names), fraction=1.0, rounds=s["rounds"], epochs=1, max_steps=s["max_steps"], **_DEADLINES,
               **{k: v for k, v in train.items() if k != "seed"})
    # 3. FedAvg from the pre-trained model; then the dynamic-pulling variants
    specs = [RunSpec("fedavg", "nmt", options, {**job, "strategy": "fedavg"}, {"strategy": "fedavg", "pull": 1.0})]
    for f in s["fractions"]:
        down = f < 0.5  # Passban et al.'s 33 % variant pulls in both directions (the server pushes a third too)
        for mode in ("pull-local", "pull-global", "pull-random"):
            specs.append(RunSpec(f"{mode}-{f}" + ("-both" if down else ""), "nmt", options,
                                 {**job, "strategy": mode, "pull_fraction": f, "pull_down": down},
                                 {"strategy": mode, "pull": f, "directions": "both" if down else "up"}))
    results = []
    for spec in specs:
        summary = runner.federate(spec, task=warm, seed=seed)
        row = _row(spec, summary, out / spec.name)
        server = task.build_model(seed)
        best = out / spec.name / "best.pt"
        load_state(server, torch.load(best, weights_only=True) if best.is_file() else pretrained)
        per_domain = domain_bleu(task, server, "test", n)
        table[f"server {spec.name}"] = per_domain
        row["bleu_mean_domains"] = sum(per_domain.values()) / len(per_domain)
        rows = _metrics(out / spec.name)
        row["bytes_up_per_round"] = row["bytes_up"] / max(len(rows), 1)
        results.append(row)
    return {"runs": results, "bleu_by_domain": table, "domains": names, "pretrain_s": round(pretrain_s, 1),
            "pretrain_steps": s["pretrain_steps"], "pretrain": pretrain_info,
            "settings": {k: v for k, v in s.items() if k != "fractions"} | {"fractions": list(s["fractions"])}}


def bleu_markdown(table: dict[str, dict[str, float]], domains: list[str]) -> str:
    lines = ["| model | " + " | ".join(domains) + " | mean |", "|" + "---|" * (len(domains) + 2)]
    for name, scores in table.items():
        vals = [scores[d] for d in domains]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    return "\n".join(lines)


_COLUMNS = {
    "table2": ["run", "corpus", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "fraction": ["run", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "rounds-to-target": ["run", "strategy", "E", "encoding", "test", "target", "rounds_to_target", "bytes_to_target",
                         "bytes_up", "bytes_up_raw", "wall_s"],
    "topk": ["run", "beta", "test", "best_valid", "updates_received", "bytes_up", "wall_s"],
    "randomization": ["run", "strategy", "noise", "test", "best_valid", "best_round", "wall_s"],
    "scale": ["run", "model", "tied", "test", "best_valid", "best_round", "wall_s"],
    "dropout": ["run", "availability", "faults", "test", "best_valid", "rounds_completed", "rounds_skipped",
                "updates_received", "wall_s"],
    "nmt-domains": ["run", "strategy", "pull", "directions", "test", "bleu_mean_domains", "best_round", "bytes_up_per_round",
                    "bytes_up", "bytes_up_raw", "bytes_down_raw", "wall_s"],
}


def check_args(name: str, scale: str, threads: int = 1) -> None:
    """One clear error line for a bad experiment name, scale or thread count (before anything is written)."""
    if name not in NAMES:
        raise ExperimentError(f"unknown experiment {name!r}; choose one of {', '.join(NAMES)}")
    if scale not in SCALES:
        raise ExperimentError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if threads < 1:
        raise ExperimentError(f"threads must be at least 1, got {threads}")


def run_experiment(name: str, scale: str = "cpu", out: Path | str | None = None, seed: int = 0,
                   threads: int = 1, report: bool = True, only: str | None = None,
                   overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run experiment ``name`` at ``scale``; results under ``out/name``; returns the results dict.

    ``only``/``overrides`` (LM experiments): run a subset of the grid with changed job settings, for the
    investigations in docs/results.md (e.g. more rounds); the results record them."""
    check_args(name, scale, threads)
    if not DATA.is_dir():
        raise ExperimentError(f"the corpora folder {DATA} does not exist (expected ../shared/data next to the project)")
    if name != "nmt-domains":
        select(EXPERIMENTS[name](scale), only, overrides)  # validate before anything is written
    elif only or overrides:
        raise ExperimentError("--only/--set apply to the language-modelling experiments, not nmt-domains")
    exp_dir = Path(out or "runs/experiments") / name
    exp_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    started = time.time()
    if name == "nmt-domains":
        results = run_nmt_domains(scale, exp_dir, seed)
    else:
        results = run_lm_experiment(name, scale, exp_dir, seed, only, overrides)
    results.update(experiment=name, scale=scale, seed=seed, threads=threads, only=only, overrides=overrides or {},
                   wall_s=round(time.time() - started, 1))
    (exp_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    changed = f", overrides {overrides}" if overrides else ""
    text = [f"# {name} ({scale} scale{changed}, seed {seed}, wall {results['wall_s']} s)", "", markdown(results["runs"], _COLUMNS[name])]
    if "bleu_by_domain" in results:
        text += ["", "BLEU on each domain's test pairs:", "", bleu_markdown(results["bleu_by_domain"], results["domains"])]
    (exp_dir / "results.md").write_text("\n".join(text) + "\n")
    if report:
        from cli.report import run_report

        run_report([exp_dir / r["run"] for r in results["runs"]], exp_dir / "report")
    return results
