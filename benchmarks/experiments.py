"""Named reproductions of the seed papers' experiments: ``fedmq experiment NAME --scale S --out DIR``.

Papers: FedAtt (Ji et al. 2019), FedMed (Wu et al. 2020), dynamic pulling (Passban et al. 2022).
Every experiment is a grid of federations run one after the other with :class:`fedmq.simulation.Simulation`
over the in-process broker (``memory://``, the same engine/agent/codec code path as RabbitMQ). Each federation
writes a normal run folder ``OUT/NAME/<run>/`` (aggregator.runlog: config, metrics, summary); the experiment
writes ``OUT/NAME/results.json`` + ``results.md`` (one row per run), ``OUT/NAME/report/`` (``fedmq report`` of
all its runs) and ``OUT/NAME/NAME.SCALE.json``, the small results file that is kept in git under
benchmarks/results/ (benchmarks/results_file.py: the final numbers of each run and seed, the command and the
commit). Reruns into the same folder replace that experiment's run folders.

The caller hands in the Simulation class and the report function (``run_experiment(simulation=, report=)``):
the CLI (``fedmq experiment``), scripts/reproduce.py and the tests. This package sits below cli, which imports
it for ``fedmq bench`` and ``fedmq experiment``; importing them back would make the two packages a cycle
(tests/unit/test_layering.py), and both live in cli for good reasons (``fedmq simulate``, ``fedmq report``).

Scales (same code path, only numbers differ):

* ``paper``: the papers' settings (100 IID clients, 50 rounds, GRU-300 / LSTM 2x400, full vocabulary, full
  validation and test splits; Transformer-base for translation). Meant for a GPU machine.
* ``cpu``: what finishes on 2 shared CPU cores: Penn Treebank (the 6,645 words of its first 4,000 training
  lines), 20 clients (so C = 0.1 selects 2), those 4,000 lines (~85k words, ~4.2k a client), 12 rounds of
  E = 1 epoch, every method on the same GRU-small tied, validation/test on the first 1,000 lines (~21k words
  each) -- absolute perplexities are far from the papers' (a fraction of an epoch of PTB),
  only the ordering of methods is read.
* ``smoke``: CI; a reduced grid, one or two rounds, tiny slices, tiny models.

Local training follows FedAtt's Algorithm 2 ("z ← βz + ∇L(θ); θ ← θ − ηz": SGD with momentum) and its
reference code (shaoxiongji/fed-att: momentum 0.5, E = 5, B = 10, no gradient clipping) at the paper scale,
with lr 0.5 where the reference has 0.01: the papers give no learning rate, and ``sweep --scale paper``
(FedAvg, PTB, C = 0.1, 25 rounds on a GPU) found 0.01 far from trained, 0.5 best, 1.0 flat from round 16 and
2.0 divergent in its first rounds (docs/results/paper-scale.md). At the cpu scale, where a client takes ~12
steps a round, momentum comes from the validation sweep ``fedmq experiment sweep --scale cpu`` and lr (0.5)
with FedMed's "decayed learning rate" (x 0.9 a round) from a second sweep on the C = 0.1 cells whose
validation curves spiked at lr 1.0 (docs/results/method.md). Every method shares this one client regime, so
that only the aggregation differs. The score is the test perplexity of the best-on-validation global model
(as both LM papers report).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from fedmq.aggregator.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from fedmq.aggregator.config import JobConfig, read_former_keys
from fedmq.aggregator.records import RoundRecord
from fedmq.aggregator.runlog import (
    CONFIG_FILE,
    RunLog,
    finished,
    read_config,
    read_rounds,
    read_summary,
    write_summary,
)
from fedmq.benchmarks import results_file
from fedmq.errors import FedmqError
from fedmq.files import write_atomic
from fedmq.tasks.base import Task, TrainConfig, load_state, model_state
from fedmq.tasks.corpora import corpus_dir, find
from fedmq.tasks.errors import TaskError
from fedmq.tasks.training import resolve_device

log = structlog.get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
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
    central: bool = False  # no federation: the centralized baseline (Runner.centralize)


# ----------------------------------------------------------------------------------------------- LM scales
# task options and job settings shared by the language-modelling experiments, per scale; min_count=1: every
# training word in the vocabulary, as the archived results were made (the task's default is now 2)
_LM_TASK = {
    "paper": dict(
        model="gru-small", vocab_size=0, min_count=1, max_lines=0, max_eval_lines=0, clients=100, dropout=0.1
    ),
    "cpu": dict(
        model="gru-small",
        vocab_size=0,
        min_count=1,
        max_lines=4000,
        max_eval_lines=1000,
        clients=20,
        dropout=0.1,
    ),
    "smoke": dict(model="gru-tiny", vocab_size=300, min_count=1, max_lines=120, max_eval_lines=10, clients=4),
}
# SGD with momentum, no clipping (FedAtt Algorithm 2 and its reference code); cpu momentum: the sweep's pick;
# cpu lr and its decay across rounds (FedMed: "decayed learning rate"): chosen on validation curves at
# C = 0.1, where lr 1.0 without decay spiked (docs/results/method.md)
CPU_LR, CPU_MOMENTUM, CPU_ROUND_LR_DECAY = 0.5, 0.5, 0.9
# paper lr: the paper-scale sweep's pick (the reference code's 0.01 left the model at 4.7-5.4x the papers'
# perplexities after 50 rounds); momentum, E, B and no clipping are the reference code's
PAPER_LR = 0.5
# FedSGD's one step a round is on the gradient of the mean loss over the whole shard, whatever the batch size;
# for a stream-batched LM the batch size only sets how many streams the shard is cut into (each starts from a
# zero hidden state). At the paper scale a shard is cut into 100 streams instead of 10: the same targets and
# mean loss in a ninth of the sequential forward/backward passes (a PTB shard: 28 windows of 10 x 35 tokens, 3
# of 100 x 35; WikiText-2: 64 and 7), which is what a latency-bound GPU client's step costs
# (docs/results/method.md)
PAPER_FEDSGD_STREAMS = 100
# cpu FedSGD's own lr (McMahan et al. 2017 tune each method's lr): seed 0's best validation perplexity in
# the 12 rounds (x 0.9 a round, as every cell) at lr 0.5 / 1 / 1.5 / 2 / 3 / 5: 5720.8 / 4104.9 / 1145.5 /
# 1172.1 (a spike in round 10) / 1280.4 (spikes in rounds 5-6) / diverged from round 4
# (docs/results/table2.md)
CPU_FEDSGD_LR = 1.5
_LM_JOB = {
    "paper": dict(
        clients=100, rounds=50, epochs=5, batch_size=10, lr=PAPER_LR, momentum=0.5, clip=0.0, max_steps=0
    ),
    "cpu": dict(
        clients=20,
        rounds=12,
        epochs=1,
        batch_size=10,
        lr=CPU_LR,
        momentum=CPU_MOMENTUM,
        clip=0.0,
        max_steps=0,
        round_lr_decay=CPU_ROUND_LR_DECAY,
    ),
    "smoke": dict(clients=4, rounds=1, epochs=1, batch_size=4, lr=1.0, momentum=0.5, clip=0.0, max_steps=2),
}
_CORPORA = {"paper": ["wikitext-2", "ptb"], "cpu": ["ptb"], "smoke": ["wikitext-2"]}
_DEADLINES = dict(report_deadline_s=120.0, update_deadline_s=120.0, join_timeout_s=60.0, heartbeat_s=1.0)
# the grids' clients' lr follows their own schedule (round_lr_decay), as their archived runs did: no annealing
# on validation, whatever fedmq simulate's default
_SCHEDULE = dict(lr_anneal=1.0)
# FedMed's model is an LSTM (300 + 2x400); at the smoke scale a tiny LSTM keeps CI fast
_FEDMED_MODEL = {
    "paper": dict(model="lstm", tied=False),
    "cpu": dict(model="lstm", tied=False),
    "smoke": dict(model="lstm", tied=False, emb=16, hidden=16, layers=2),
}


# FedMed's forms (aggregator/strategies/fedmed.py): "fedmed", the paper's JS weights, is a cell of every grid
# that has FedMed; its variants are cells of the same grids (``grid``) that run only where --only names them
# (``select``), so that the results made with them (benchmarks/results/) keep their own names
FEDMED_VARIANTS = ("fedmed-relative", "fedmed-standardised")
FEDMED_FORMS = ("fedmed", *FEDMED_VARIANTS)


def _corpus(name: str) -> str:
    """The folder of a corpus in the data folder ($FEDMQ_DATA_DIR, fedmq.tasks.corpora); ``check_corpora``
    checks that it is there."""
    return str(corpus_dir(name))


def _lm(
    scale: str,
    name: str,
    labels: dict[str, Any],
    corpus: str | None = None,
    task: dict | None = None,
    lstm: bool = False,
    **job: Any,
) -> RunSpec:
    """An LM federation (on the scale's first corpus unless ``corpus``); ``lstm``: FedMed runs on FedMed's
    LSTM (Table 2; paper scale only: at the smaller scales every method shares one GRU so that they can be
    ranked)."""
    corpus = corpus or _CORPORA[scale][0]
    options = {**_LM_TASK[scale], "data": _corpus(corpus), "tied": True, **(task or {})}
    settings = {**_LM_JOB[scale], **_DEADLINES, **_SCHEDULE, **job}
    options["clients"] = settings["clients"]
    if settings.get("strategy") in FEDMED_FORMS and lstm and scale == "paper":
        options.update(_FEDMED_MODEL[scale])
    return RunSpec(name, "lm", options, settings, {"corpus": corpus, **labels})


def _model(scale: str, strategy: str) -> str:
    return (_FEDMED_MODEL if strategy in FEDMED_FORMS and scale == "paper" else _LM_TASK)[scale]["model"]


def _pick(scale: str, smoke: list, cpu: list, paper: list) -> list:
    return {"smoke": smoke, "cpu": cpu, "paper": paper}[scale]


def table2(scale: str, fedmed: Sequence[str] = ("fedmed",)) -> list[RunSpec]:
    """FedAtt Table II + FedMed Table 2: FedSGD, FedAvg, FedAtt (GRU), FedMed (LSTM at the paper scale) at
    C = 0.1 and 0.5, each C beside a centralized baseline with the same token passes (``central-cC``);
    ``fedmed``: the FedMed forms in the grid (FEDMED_FORMS)."""
    runs = []
    for corpus in _CORPORA[scale]:
        streams = {"batch_size": PAPER_FEDSGD_STREAMS} if scale == "paper" else {}
        own_lr = {"lr": CPU_FEDSGD_LR} if scale == "cpu" else {}
        runs.append(
            _lm(
                scale,
                f"{corpus}-fedsgd",
                {"strategy": "fedsgd", "C": 1.0},
                corpus,
                strategy="fedsgd",
                fraction=1.0,
                **streams,
                **own_lr,
            )
        )
        for c in _pick(scale, [0.5], [0.1, 0.5], [0.1, 0.5]):
            for s in ("fedavg", "fedatt", *fedmed):
                runs.append(
                    _lm(
                        scale,
                        f"{corpus}-{s}-c{c}",
                        {"strategy": s, "C": c, "model": _model(scale, s)},
                        corpus,
                        lstm=True,
                        strategy=s,
                        fraction=c,
                    )
                )
            central = _lm(
                scale,
                f"{corpus}-central-c{c}",
                {"strategy": "central", "C": c, "model": _LM_TASK[scale]["model"]},
                corpus,
                fraction=c,
            )
            central.central = True
            runs.append(central)
    return runs


def sweep(scale: str) -> list[RunSpec]:
    """The validation sweep behind a scale's lr and momentum (the papers give no lr): FedAvg, half the rounds,
    lr x momentum at a constant lr; pick the best validation perplexity whose curve does not jump. C = 0.5 at
    the smaller scales (the cpu lr and its decay were then chosen on the C = 0.1 cells:
    docs/results/method.md); PTB at C = 0.1 at the paper scale, the cell whose reference lr 0.01 left the
    model far from trained after 50 rounds (docs/results/paper-scale.md) and a fifth of C = 0.5's client
    work."""
    grid = _pick(
        scale,
        [(1.0, 0.5), (0.5, 0.9)],
        [(0.5, 0.5), (1.0, 0.5), (2.0, 0.5), (1.0, 0.0), (0.1, 0.9), (0.2, 0.9)],
        [(0.1, 0.5), (0.5, 0.5), (1.0, 0.5), (2.0, 0.5), (4.0, 0.5)],
    )
    rounds = max(1, _LM_JOB[scale]["rounds"] // 2)
    fraction, corpus = (0.1, "ptb") if scale == "paper" else (0.5, None)
    return [
        _lm(
            scale,
            f"fedavg-lr{lr}-m{m}",
            {"strategy": "fedavg", "lr": lr, "momentum": m},
            corpus,
            strategy="fedavg",
            fraction=fraction,
            lr=lr,
            momentum=m,
            rounds=rounds,
            round_lr_decay=1.0,
        )
        for lr, m in grid
    ]


def fraction(scale: str, fedmed: Sequence[str] = ("fedmed",)) -> list[RunSpec]:
    """FedAtt Fig. 2 / FedMed Fig. 4: test perplexity vs the client fraction C."""
    cs = _pick(scale, [0.5], [0.1, 0.2, 0.5, 0.7, 0.9], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    return [
        _lm(scale, f"{s}-c{c}", {"strategy": s, "C": c}, strategy=s, fraction=c)
        for c in cs
        for s in ("fedavg", "fedatt", *fedmed)
    ]


def rounds_to_target(scale: str, fedmed: Sequence[str] = ("fedmed",)) -> list[RunSpec]:
    """FedAtt Fig. 3 / FedMed Fig. 6: rounds (and bytes) until validation perplexity reaches a target."""
    runs = []
    for e in _pick(scale, [1], [1, 2], [1, 5, 10]):
        for s in ("fedavg", "fedatt", *fedmed):
            runs.append(
                _lm(
                    scale,
                    f"{s}-e{e}",
                    {"strategy": s, "E": e, "encoding": "raw"},
                    strategy=s,
                    fraction=0.5,
                    epochs=e,
                    max_steps=_LM_JOB[scale]["max_steps"] * e,
                )
            )
    for enc in _pick(scale, ["delta+int8"], ["fp16", "delta+int8"], ["fp16", "delta+int8", "delta+topk:0.1"]):
        safe = enc.replace("+", "-").replace(":", "")
        runs.append(
            _lm(
                scale,
                f"fedavg-e1-{safe}",
                {"strategy": "fedavg", "E": 1, "encoding": enc},
                strategy="fedavg",
                fraction=0.5,
                encoding=enc,
            )
        )
    return runs


def topk(scale: str, fedmed: Sequence[str] = ("fedmed",)) -> list[RunSpec]:
    """FedMed Fig. 5: top-K share β of the reporting clients allowed to upload, vs upload bytes."""
    betas = _pick(
        scale, [0.5, 1.0], [0.3, 0.5, 0.7, 0.8, 0.9, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    )
    return [
        _lm(scale, f"{s}-beta{b}", {"strategy": s, "beta": b}, strategy=s, fraction=0.5, beta=b)
        for s in fedmed
        for b in betas
    ]


def randomization(scale: str) -> list[RunSpec]:
    """FedAtt Table III: FedAvg vs FedAtt with the clients adding noise·N(0, 1) to their weights."""
    noises = _pick(scale, [0.0, 0.01], [0.0, 0.001, 0.005, 0.01, 0.05], [0.0, 0.001, 0.005, 0.01, 0.05])
    return [
        _lm(scale, f"{s}-noise{n}", {"strategy": s, "noise": n}, strategy=s, fraction=0.5, noise=n)
        for n in noises
        for s in ("fedavg", "fedatt")
    ]


def model_scale(scale: str) -> list[RunSpec]:
    """FedAtt Table IV: small / medium / large GRU, tied / untied, FedAvg beside FedAtt.
    Large only at the paper scale."""
    sizes = _pick(scale, ["gru-tiny"], ["gru-small", "gru-medium"], ["gru-small", "gru-medium", "gru-large"])
    return [
        _lm(
            scale,
            f"{s}-{m}-{'tied' if t else 'untied'}",
            {"strategy": s, "model": m, "tied": t},
            task={"model": m, "tied": t},
            strategy=s,
            fraction=0.5,
        )
        for m in sizes
        for t in (True, False)
        for s in ("fedavg", "fedatt")
    ]


def dropout(scale: str, out: Path | None = None) -> list[RunSpec]:
    """Beyond the papers: FedAvg with clients going offline (availability models) and crashing mid-round."""
    specs = [
        ("always", ""),
        ("bernoulli:0.9", ""),
        ("bernoulli:0.7", ""),
        ("bernoulli:0.5", ""),
        ("markov:0.8,0.5", ""),
        ("trace", ""),
        ("always", "crash-train:0.2"),
    ]
    if scale == "smoke":
        specs = [("bernoulli:0.7", "crash-train:0.2"), ("trace", "")]
    # a missing selected client costs a deadline: keep the deadlines short at the small scales, but above a
    # round's local training (cpu: the ten clients of a C = 0.5 round train one after another on one core,
    # ~30 s)
    deadlines = {
        "paper": {},
        "cpu": dict(report_deadline_s=60.0, update_deadline_s=60.0),
        "smoke": dict(report_deadline_s=5.0, update_deadline_s=5.0),
    }[scale]
    runs = []
    for avail, faults in specs:
        name = avail.replace(":", "").replace(",", "-") + (f"-{faults.replace(':', '')}" if faults else "")
        spec = _lm(
            scale,
            name,
            {"availability": avail, "faults": faults or "-"},
            strategy="fedavg",
            fraction=0.5,
            **deadlines,
        )
        spec.availability, spec.faults = avail, faults
        runs.append(spec)
    return runs


def _trace_file(out: Path, clients: int, rounds: int) -> Path:
    """A FedScale-style trace: client i is offline for 2 rounds out of every (3 + i % 4), shifted by i."""
    spans: dict[str, list[list[int]]] = {}
    for i in range(clients):
        period, off = 3 + i % 4, 2
        spans[f"agent-{i}"] = [
            [s, s + period - off] for s in range(-period + i % period, rounds + period, period)
        ]
    path = out / "availability-trace.json"
    write_atomic(path, json.dumps(spans))
    return path


# ----------------------------------------------------------------------------------------------- NMT
# task: TranslationTask options. pretrain_*: phase 1, Adam on the pairs of ``pretrain_domains`` (the first
# ``pretrain_max_lines`` of each, 0 = all; minus every pair whose source is in a valid/test split; pairs
# longer than max_len subwords skipped) for ``pretrain_steps`` steps of ``pretrain_batch`` pairs, lr warm-up
# over ``pretrain_warmup`` steps to ``pretrain_lr`` then linear decay to 0. lr: the clients' Adam lr (local
# only and federated); rounds x max_steps local steps of batch_size pairs; per_domain_test: BLEU on the first
# N test pairs of each domain.
# Passban et al.'s five clients are WMT, OpenSubtitles, TED, PHP and Ubuntu; the corpora here have one
# software domain (GNOME/KDE/PHP/Ubuntu strings, not split by source), so the fifth client is another small
# technical domain, EMEA medicine documentation (a departure, docs/results/nmt-domains.md)
FIVE_DOMAINS = ["news_wmt", "subtitles_opensubs", "ted_iwslt14", "software_it", "medical_emea"]
_NMT = {
    "paper": dict(
        task=dict(model="base", domains=FIVE_DOMAINS, max_lines=0, vocab_size=32000, eval_max_sentences=0),
        pretrain_domains=["news_wmt"],
        pretrain_max_lines=0,
        pretrain_steps=100_000,
        pretrain_batch=64,
        pretrain_lr=7e-4,
        pretrain_warmup=4000,
        lr=5e-4,
        rounds=5,
        max_steps=0,
        batch_size=64,
        per_domain_test=0,
        fractions=(0.5, 0.33),
    ),
    "cpu": dict(
        task=dict(
            model="mini",
            domains=FIVE_DOMAINS,
            max_lines=3000,
            vocab_size=4000,
            eval_max_sentences=40,
            max_len=64,
            dropout=0.0,
        ),
        pretrain_domains=["news_wmt"],
        pretrain_max_lines=0,
        pretrain_steps=4000,
        pretrain_batch=32,
        pretrain_lr=4e-3,
        pretrain_warmup=200,
        lr=5e-4,
        rounds=5,
        max_steps=0,
        batch_size=24,
        per_domain_test=0,
        fractions=(0.5, 0.33),
    ),
    "smoke": dict(
        task=dict(
            model="tiny",
            domains=["news_wmt", "ted_iwslt14"],
            max_lines=60,
            vocab_size=300,
            eval_max_sentences=6,
        ),
        pretrain_domains=["news_wmt"],
        pretrain_max_lines=60,
        pretrain_steps=2,
        pretrain_batch=8,
        pretrain_lr=5e-4,
        pretrain_warmup=0,
        lr=5e-4,
        rounds=2,
        max_steps=1,
        batch_size=8,
        per_domain_test=3,
        fractions=(0.5, 0.33),
    ),
}


def pretrain_pairs(task: Any, domains: list[str], max_lines: int) -> list[Any]:
    """The pre-training pairs: every pair of ``domains`` (the first ``max_lines`` lines of each, 0 = all)
    whose source sentence is not in any valid or test split of ``task``
    (so no evaluated sentence is trained on)."""
    from fedmq.tasks.nmt_data import load_parallel

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


def domain_pairs(task: Any, domain: str, split: str = "test", per_domain: int = 0) -> list[Any]:
    """The pairs of ``domain`` a model is scored on: the first ``per_domain`` of its ``split`` (0 = all)."""
    pairs = [p for p in task.corpus.splits[split] if p.domain == domain]
    return pairs[:per_domain] if per_domain else pairs


def domain_bleu(
    task: Any, model: torch.nn.Module, split: str = "test", per_domain: int = 0
) -> dict[str, float]:
    """BLEU of ``model`` on each domain's ``split`` pairs (the first ``per_domain`` of each; 0 = all)."""
    from fedmq.tasks.nmt import corpus_bleu

    scores = {}
    for domain in task.corpus.domains:
        pairs = domain_pairs(task, domain, split, per_domain)
        hyps = task.translate(model, [p.src for p in pairs])
        scores[domain] = corpus_bleu(hyps, [p.tgt for p in pairs])
    return scores


def domain_ce(
    task: Any, model: torch.nn.Module, split: str = "test", per_domain: int = 0
) -> dict[str, float]:
    """Cross-entropy (nats per reference token, teacher forcing) of ``model`` on each domain's ``split``
    pairs."""
    return {
        domain: task.cross_entropy(model, domain_pairs(task, domain, split, per_domain))
        for domain in task.corpus.domains
    }


def _server_domain_scores(
    task: Any, run_dir: Path, summary: dict[str, Any], seed: int, n: int
) -> tuple[dict[str, float], dict[str, float] | None]:
    """Per-domain test BLEU and cross-entropy of a run's best global model, kept in its summary.json
    (``test_bleu_by_domain``, ``test_ce_by_domain``) so that a run folder kept without its weights (no
    best.pt) keeps its row; a finished run with no BLEU and no best.pt is refused
    rather than scored on another model. Cross-entropy is None for a restored run from before it was
    measured."""
    bleu, ce = summary.get("test_bleu_by_domain"), summary.get("test_ce_by_domain")
    if isinstance(bleu, dict) and isinstance(ce, dict):
        return bleu, ce
    best = run_dir / "best.pt"
    if not best.is_file():
        if isinstance(bleu, dict):
            return bleu, None
        raise ExperimentError(
            f"run {run_dir.name} has no best.pt and no per-domain BLEU in its summary.json "
            f"(restored from an older archive?): delete {run_dir} to run it again"
        )
    server = task.build_model(seed)
    load_state(server, torch.load(best, weights_only=True))
    if not isinstance(bleu, dict):
        summary["test_bleu_by_domain"] = bleu = domain_bleu(task, server, "test", n)
    summary["test_ce_by_domain"] = ce = domain_ce(task, server, "test", n)
    write_summary(run_dir, summary)
    return bleu, ce


def _ce_pick(task: Any, run_dir: Path, summary: dict[str, Any], seed: int, n: int) -> dict[str, Any] | None:
    """The server read at the round whose global model has the lowest validation cross-entropy (the mean over
    domains of each domain's, on all its validation pairs) rather than the engine's pick by BLEU on a few
    validation pairs: that round, every round's validation cross-entropy, and the chosen model's per-domain
    test BLEU and cross-entropy. Kept in summary.json (``ce_pick``); None for a run without every round's
    checkpoint (one from before they were kept, or restored from its small files)."""
    if isinstance(summary.get("ce_pick"), dict):
        return summary["ce_pick"]
    states = {}
    for path in sorted((run_dir / "checkpoints").glob("ckpt-*.fmq")):
        ckpt = read_checkpoint(path)
        states[ckpt.model_version] = ckpt.global_state  # a skipped round's checkpoint repeats its version
    if sorted(states) != list(range(1, summary.get("rounds_completed", 0) + 1)):
        return None
    server = task.build_model(seed)
    valid = {}
    for version, state in states.items():
        load_state(server, state)
        ce = domain_ce(task, server, "valid")
        valid[version] = sum(ce.values()) / len(ce)
    best = min(valid, key=valid.get)
    if best == summary.get("best_round"):  # the engine's pick: scored already
        bleu, ce = summary["test_bleu_by_domain"], summary["test_ce_by_domain"]
    else:
        load_state(server, states[best])
        bleu, ce = domain_bleu(task, server, "test", n), domain_ce(task, server, "test", n)
    summary["ce_pick"] = pick = {
        "round": best,
        "valid_ce_by_round": {str(k): v for k, v in valid.items()},
        "test_bleu_by_domain": bleu,
        "test_ce_by_domain": ce,
    }
    write_summary(run_dir, summary)
    return pick


# ----------------------------------------------------------------------------------------------- running
EXPERIMENTS: dict[str, Callable[..., list[RunSpec]]] = {
    "table2": table2,
    "sweep": sweep,
    "fraction": fraction,
    "rounds-to-target": rounds_to_target,
    "topk": topk,
    "randomization": randomization,
    "scale": model_scale,
    "dropout": dropout,
}
NAMES = (*EXPERIMENTS, "nmt-domains")


def grid(name: str, scale: str) -> list[RunSpec]:
    """Every cell of experiment ``name``'s grid at ``scale``: what ``EXPERIMENTS[name]`` runs, then its FedMed
    cells in each variant of FedMed (FEDMED_VARIANTS; ``select`` runs them only where --only names them)."""
    specs = EXPERIMENTS[name](scale)
    if any(s.job.get("strategy") == "fedmed" for s in specs):
        variants = EXPERIMENTS[name](scale, fedmed=FEDMED_VARIANTS)
        specs += [s for s in variants if s.job.get("strategy") in FEDMED_VARIANTS]
    return specs


# a federation's wire unless its spec says otherwise: the reproductions compare algorithms, not encodings
_LOSSLESS = {"encoding": "raw", "down_encoding": "raw"}
_TASKS: dict[str, Task] = {}  # built tasks by options, shared by the experiments of one process


@dataclass
class Runner:
    """Runs the federations of an experiment one after the other; tasks with equal options are built once.

    ``simulation``: fedmq.simulation.Simulation (module docstring), called as ``simulation(cfg, task, url,
    run_dir, availability=, faults=, device=, cohort=, resume=)``; its ``run()`` returns the run's summary."""

    out: Path
    simulation: Callable[..., Any]
    tasks: dict[str, Task] = field(default_factory=lambda: _TASKS)
    device: str = "cpu"  # local training: cpu | cuda | auto (the aggregator evaluates on the CPU)
    cohort: bool = (
        False  # train a round's selected clients together (Simulation.cohort): how, not what, it runs
    )
    shared: Path | None = (
        None  # where other experiments' finished runs are looked up (``reuse``); None: nowhere
    )

    def task(self, kind: str, options: dict[str, Any]) -> Task:
        from fedmq.tasks.registry import make_task

        key = json.dumps([kind, options], sort_keys=True, default=str)
        if key not in self.tasks:
            self.tasks[key] = make_task(kind, **options)
        return self.tasks[key]

    def federate(self, spec: RunSpec, task: Any = None, seed: int = 0) -> dict[str, Any]:
        """Run ``spec`` into OUT/<run>. A run folder this spec and seed already finished is kept (its summary
        is returned); one they started and did not finish resumes from its last checkpoint; anything else is
        replaced. So an interrupted grid is rerun with the same command and loses at most a round per run."""
        run_dir = self.out / spec.name
        key = json.dumps({"spec": asdict(spec), "seed": seed}, sort_keys=True, default=str)
        marker = run_dir / "spec.json"
        saved = json.loads(marker.read_text()) if marker.is_file() else {}
        job = re.sub(r"[^A-Za-z0-9_-]", "_", f"exp-{spec.name}")[:64]
        cfg = JobConfig(job=job, seed=seed, **{**_LOSSLESS, **spec.job})
        resume = saved.get("key") == key and ran_as(run_dir, cfg)
        if resume and saved.get("done") and finished(run_dir):
            log.info("experiment run already done", run=spec.name)
            return read_summary(run_dir)
        if run_dir.exists() and not resume:
            shutil.rmtree(run_dir)
        if not resume and (source := self.reuse(spec, seed, run_dir, cfg)) is not None:
            write_atomic(marker, json.dumps({"key": key, "done": True, "reused": str(source)}))
            log.info("experiment run reused", run=spec.name, source=str(source))
            return read_summary(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, json.dumps({"key": key, "done": False}))
        task = task if task is not None else self.task(spec.task, spec.task_options)
        started = time.time()
        if spec.central:
            summary = self.centralize(spec, cfg, run_dir, resume=resume)
        else:
            sim = self.simulation(
                cfg,
                task,
                f"memory://{job}",
                run_dir,
                availability=spec.availability,
                faults=spec.faults,
                device=self.device,
                cohort=self.cohort,
                resume=resume and (run_dir / CONFIG_FILE).is_file(),
            )
            summary = sim.run()
        summary["run_wall_s"] = time.time() - started
        write_summary(run_dir, summary)
        write_atomic(marker, json.dumps({"key": key, "done": True}))
        log.info(
            "experiment run done",
            run=spec.name,
            test=summary.get("test"),
            wall_s=round(summary["run_wall_s"], 1),
        )
        return summary

    def reuse(self, spec: RunSpec, seed: int, run_dir: Path, cfg: JobConfig) -> Path | None:
        """Copy a finished run of another experiment under ``shared`` that is the same federation as ``spec``
        with ``seed`` (equal ``work_key``, and run with ``cfg``'s settings: ``ran_as``) into ``run_dir``; its
        folder, or None. The experiments repeat one configuration (e.g. FedAvg at C = 0.5 is a cell of table2,
        fraction, rounds-to-target and randomization): it is trained once and read by all of them."""
        if self.shared is None or not self.shared.is_dir():
            return None
        wanted = work_key(asdict(spec), seed)
        for marker in sorted(
            self.shared.rglob("spec.json")
        ):  # run_dir has none: federate removed it or never had one
            source = marker.parent
            try:
                saved = json.loads(marker.read_text())
                done = json.loads(saved["key"]) if saved.get("done") else None
                same = done is not None and work_key(done["spec"], done["seed"]) == wanted
            except (OSError, ValueError, KeyError, TypeError, FedmqError):
                continue  # not a run folder of this module's (or a damaged one): never a source
            if same and finished(source) and ran_as(source, cfg):
                shutil.copytree(
                    source, run_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("spec.json")
                )
                return source
        return None

    def centralize(
        self, spec: RunSpec, job: JobConfig, run_dir: Path, resume: bool = False
    ) -> dict[str, Any]:
        """The centralized baseline: one model trained on the union of every client's data, no federation, for
        the token passes of the federation it stands beside (C x K clients x E epochs of their shards a round,
        i.e. C x E epochs of the union), evaluated and kept best-on-validation round by round like a
        federation. As on a client, the optimizer (and its momentum) starts afresh each round, at the round's
        learning rate (``round_lr_decay``), and a round's training seed is fixed by (``job.seed``, round):
        every round is checkpointed (the aggregator's atomic format) and ``resume`` continues from the last
        one to the same numbers as an uninterrupted run. ``job``:
        the run's settings as the federation beside it would run them."""
        seed = job.seed
        union = self.task(spec.task, {**spec.task_options, "clients": 1})
        # the model lives on the run's device: training returns it to where it was, and a GPU run's full-split
        # evaluation on one CPU thread took 60-70 s a round where its training took 10-20 s
        # (WikiText-2, 2026-11-24)
        model = union.build_model(seed).to(resolve_device(self.device))
        from fedmq.tasks.lm_data import StreamBatches

        ids = union.client_ids(0)
        windows = StreamBatches.build(ids, job.batch_size, union.vocab.eos).num_windows(union.bptt)
        steps = max(1, math.ceil(job.fraction * job.epochs * windows))
        best, best_round, best_state, done = math.inf, 0, None, 0
        checkpoints = run_dir / "checkpoints"
        saved = load_checkpoint(checkpoints) if resume else None
        if saved is not None:
            load_state(model, saved.global_state)
            done, best, best_round = saved.round, saved.extra["best"], saved.extra["best_round"]
            best_state = saved.extra["best_state"]
            log.info("centralized baseline resumed", run=spec.name, round=done)
        runlog = RunLog(run_dir)
        runlog.truncate_after(done)  # rows of a round the checkpoint does not hold are run again
        for r in range(done + 1, job.rounds + 1):
            cfg = TrainConfig(
                epochs=job.epochs + 1,
                batch_size=job.batch_size,
                lr=job.round_lr(r),
                momentum=job.momentum,
                clip=job.clip,
                max_steps=steps,
                amp=job.amp,
                seed=seed * 1000 + r,
                device=self.device,
            )
            result = union.train(model, 0, cfg)
            valid = union.evaluate(model, "valid")
            if valid < best:
                best, best_round = valid, r
                best_state = {k: v.detach().clone() for k, v in model_state(model).items()}
            runlog.append(
                RoundRecord(round=r, valid=valid, extra={"train_loss": result.loss, "steps": steps})
            )
            save_checkpoint(
                checkpoints,
                round=r,
                model_version=r,
                global_state=model_state(model),
                strategy_state={},
                mediator_state={},
                rng_state=None,
                folded={},
                keep=1,
                extra={"best": best, "best_round": best_round, "best_state": best_state},
            )
        runlog.close()
        if best_state is not None:
            load_state(model, best_state)
        return {
            "test": union.evaluate(model, "test"),
            "best_valid": best,
            "best_round": best_round,
            "rounds_completed": job.rounds,
            "rounds_skipped": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "steps_per_round": steps,
        }


def ran_as(run_dir: Path, cfg: JobConfig) -> bool:
    """The run in ``run_dir`` ran with ``cfg``'s settings, as far as its strategy reads them: every JobConfig
    key its config.json records has ``cfg``'s value (a key the run predates must be at its default in
    ``cfg``), but the job's name, the seed (the spec key holds it; config.json records the task's seed under
    "shard_seed", and older run folders under "seed", so an archived run's "seed" may not be its own) and
    ``heartbeat_s`` (presence timing, not a result: simulations once raised it with K, so a K = 100 run made
    then records 2.0 where its spec says 1.0 and, before this was ignored, was deleted and started again on
    every rerun); the strategy's parameters compare as it runs them, its constructor's defaults filled in
    (a run recorded with the former job keys, such as FedAtt's ``att_eps``, as the parameters they were
    read as; another strategy's never counted). A spec names only the settings it changes, so without this a
    changed default would leave the runs made under the old one counted as done. A folder without
    config.json (the centralized baseline, whose spec names every setting it uses) passes. A run recorded as
    ``fedmed`` with JS weights other than the paper's (``fedmed_js``, the setting FedMed's variants were
    before they had names) ran as that variant (``ran_strategy``)."""
    from fedmq.params import with_defaults

    recorded = read_config(run_dir)
    if recorded is None:
        return True
    recorded = {k: v for k, v in recorded.items() if k != "fedmed_js"} | {"strategy": ran_strategy(recorded)}
    recorded = read_former_keys(recorded)
    ignored = {"job", "extra", "seed", "heartbeat_s", "fedmed_js", "strategy_args"}
    now, default = cfg.to_dict(), JobConfig().to_dict()
    cls = cfg.strategy_class
    return with_defaults(cls, recorded.get("strategy_args") or {}) == with_defaults(
        cls, cfg.strategy_args
    ) and all(
        recorded[k] == v if k in recorded else v == default[k] for k, v in now.items() if k not in ignored
    )


def ran_strategy(recorded: dict[str, Any]) -> Any:
    """The strategy a run folder's config.json says the run ran: its ``strategy``, but a ``fedmed`` run that
    records ``fedmed_js`` (JS weights as a job setting, before FedMed's variants had names) ran as the variant
    of that weighting. Where JobConfig still has the setting, its default is what every run records, and a
    ``fedmed`` run recording it is taken as FedMed."""
    strategy, js = recorded.get("strategy"), recorded.get("fedmed_js")
    if strategy != "fedmed" or js in (None, "raw", getattr(JobConfig(), "fedmed_js", None)):
        return strategy
    return f"fedmed-{js}"


def work_key(spec: dict[str, Any], seed: int) -> str:
    """What a federation computes: its spec (``asdict(RunSpec)``) without the run's name and table labels, its
    job settings as the JobConfig they make (a setting given at its default equals one left out),
    and the seed."""
    job = JobConfig.from_dict({"job": "-", **_LOSSLESS, **spec["job"]}).to_dict()
    job.pop("job")
    work = {k: v for k, v in spec.items() if k not in ("name", "labels", "job")}
    return json.dumps({**work, "job": job, "seed": seed}, sort_keys=True, default=str)


def _row(spec: RunSpec, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    rows = read_rounds(run_dir).records
    return {
        "run": spec.name,
        **spec.labels,
        "fraction": spec.job.get("fraction"),
        "test": summary.get("test"),
        "best_valid": summary.get("best_valid"),
        "best_round": summary.get("best_round"),
        "rounds_completed": summary.get("rounds_completed"),
        "rounds_skipped": summary.get("rounds_skipped"),
        "bytes_up": summary.get("bytes_up"),
        "bytes_down": summary.get("bytes_down"),
        "bytes_up_raw": sum(r.bytes_up_raw or 0 for r in rows),
        "bytes_down_raw": sum(r.bytes_down_raw or 0 for r in rows),
        "updates_received": sum(len(r.received) for r in rows),
        "valid_curve": [r.valid for r in rows],
        "max_jump": max_jump([r.valid for r in rows]),
        "wall_s": round(summary.get("run_wall_s", 0.0), 1),
    }


def max_jump(curve: list[float | None], after: int = 3) -> float | None:
    """Largest round-to-round rise of validation perplexity after round ``after`` (valid_r / valid_{r-1});
    a curve that trains keeps it at most 1.5. None with fewer rounds than that."""
    ratios = [b / a for a, b in zip(curve[after - 1 :], curve[after:]) if a and b]
    return max(ratios) if ratios else None


def rounds_to(rows: Sequence[RoundRecord], target: float) -> tuple[int | None, int | None]:
    """(first round whose validation perplexity <= target, cumulative bytes up+down until then) or
    (None, None)."""
    total = 0
    for r in rows:
        total += (r.bytes_up or 0) + (r.bytes_down or 0)
        if r.valid is not None and r.valid <= target:
            return r.round, total
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
        r["rounds_to_target"], r["bytes_to_target"] = rounds_to(read_rounds(out / r["run"]).records, target)
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


def _default_cell(spec: RunSpec) -> bool:
    """Whether ``spec`` runs when --only names nothing: every cell but a FedMed variant's."""
    return spec.job.get("strategy") not in FEDMED_VARIANTS


def _picks(wanted: str, spec: RunSpec, names: set[str]) -> bool:
    """Whether the --only alternative ``wanted`` picks ``spec`` (``select``); ``names``: the grid's."""
    variant = None if _default_cell(spec) else spec.job["strategy"]
    hit = wanted == spec.name if wanted in names else wanted in spec.name
    return hit and (variant is None or variant in wanted)


def select(specs: list[RunSpec], only: str | None, overrides: dict[str, Any] | None) -> list[RunSpec]:
    """Keep the runs ``only`` names (comma-separated alternatives; one that is a run's whole name picks that
    run, any other every run whose name contains it) and apply job ``overrides``. A cell of a FedMed variant
    (FEDMED_VARIANTS) runs only where an alternative names the variant (``fedmed-relative``,
    ``ptb-fedmed-relative-c0.1``): ``fedmed`` or ``c0.1`` alone leave it out."""
    wanted = [w for w in (only or "").split(",") if w]
    names = {s.name for s in specs}
    picked = [s for s in specs if (any(_picks(w, s, names) for w in wanted) if wanted else _default_cell(s))]
    if not picked:
        raise ExperimentError(f"no run name contains {only!r}; runs: {', '.join(s.name for s in specs)}")
    for spec in picked:
        spec.job.update(overrides or {})
        if (
            "clients" in (overrides or {}) and "clients" in spec.task_options
        ):  # the task's shards follow the job's K
            spec.task_options = {**spec.task_options, "clients": spec.job["clients"]}
        JobConfig.from_dict({"job": "check", **spec.job})  # a bad override fails here, before anything runs
    return picked


def run_lm_experiment(
    name: str,
    scale: str,
    out: Path,
    simulation: Callable[..., Any],
    seed: int = 0,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    shared: Path | None = None,
    cohort: bool = False,
) -> dict[str, Any]:
    runner = Runner(out, simulation, device=device, shared=shared, cohort=cohort)
    specs = select(grid(name, scale), only, overrides)
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


def _nmt_train(s: dict[str, Any]) -> dict[str, Any]:
    """The clients' optimiser settings (a federation's and the local-only baselines')."""
    return dict(batch_size=s["batch_size"], lr=s["lr"], optimizer="adam", clip=1.0)


def nmt_options(scale: str, seed: int, cache: Path) -> dict[str, Any]:
    """The translation task's options at ``scale`` (one client per domain;
    the vocabulary cached under ``cache``)."""
    options = {
        **_NMT[scale]["task"],
        "data": _corpus("de-en"),
        "partition": "natural",
        "seed": seed,
        "cache_dir": str(cache / "spm-cache"),
    }
    return {k: v for k, v in options.items() if v is not None}


def nmt_specs(scale: str, options: dict[str, Any] | None = None) -> list[RunSpec]:
    """The federations of ``nmt-domains`` (one client per domain, C = 1): FedAvg, then DP_l / DP_g / random
    pulling at each of the scale's fractions."""
    s = _NMT[scale]
    options = options or {}
    job = dict(
        clients=len(s["task"]["domains"]),
        fraction=1.0,
        rounds=s["rounds"],
        epochs=1,
        max_steps=s["max_steps"],
        keep_checkpoints=s["rounds"],
        **_DEADLINES,
        **_SCHEDULE,
        **_nmt_train(s),
    )
    specs = [
        RunSpec("fedavg", "nmt", options, {**job, "strategy": "fedavg"}, {"strategy": "fedavg", "pull": 1.0})
    ]
    for f in s["fractions"]:
        down = (
            f < 0.5
        )  # Passban et al.'s 33 % variant pulls in both directions (the server pushes a third too)
        for mode in ("pull-local", "pull-global", "pull-random"):
            specs.append(
                RunSpec(
                    f"{mode}-{f}" + ("-both" if down else ""),
                    "nmt",
                    options,
                    {**job, "strategy": mode, "pull_fraction": f, "pull_down": down},
                    {"strategy": mode, "pull": f, "directions": "both" if down else "up"},
                )
            )
    return specs


_PRE_SEED = 0  # phases 1-2 do not depend on the run's seed: one engine for every seed, as in the paper


def _cache_key(options: dict[str, Any], settings: dict[str, Any]) -> str:
    """What a cached phase depends on: the task's options
    (not the run's seed or the cache folder) and ``settings``."""
    shared = {
        k: v for k, v in options.items() if k not in ("seed", "cache_dir")
    }  # the vocabulary does not vary
    return json.dumps({**shared, **settings, "seed": _PRE_SEED}, sort_keys=True)


def _pretrained_engine(
    task: Any, s: dict[str, Any], options: dict[str, Any], cache: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], float, dict[str, Any]]:
    """Phase 1: pre-train on the news/WMT data (not only the news client's shard; evaluated sentences
    excluded). Cached in ``cache`` (pretrained.pt + pretrain.json) keyed by the task and the pre-training
    settings alone, so that changing how the clients train does not pre-train again. Returns the state, its
    BLEU and cross-entropy rows, the seconds it took and its summary."""
    key = _cache_key(
        options, {k: v for k, v in s.items() if k.startswith("pretrain_") or k in ("task", "per_domain_test")}
    )
    cache_pt, cache_json = cache / "pretrained.pt", cache / "pretrain.json"
    cached = json.loads(cache_json.read_text()) if cache_json.is_file() and cache_pt.is_file() else {}
    if cached.get("key") == key:
        return (
            torch.load(cache_pt, weights_only=True),
            cached["table"],
            cached["ce"],
            cached["pretrain_s"],
            cached.get("pretrain", {}),
        )
    started = time.time()
    data = task.encode_pairs(pretrain_pairs(task, s["pretrain_domains"], s["pretrain_max_lines"]))
    model = task.build_model(_PRE_SEED)
    every = max(1, s["pretrain_steps"] // 20)

    def progress(step: int, total: int) -> None:
        if step % every == 0:
            log.info("pre-training", step=step, of=total, seconds=round(time.time() - started, 1))

    cfg = TrainConfig(
        batch_size=s["pretrain_batch"],
        lr=s["pretrain_lr"],
        optimizer="adam",
        clip=1.0,
        max_steps=s["pretrain_steps"],
        warmup_steps=s["pretrain_warmup"],
        linear_decay=True,
        adam_betas=(0.9, 0.98),
        seed=_PRE_SEED,
    )
    result = task.pretrain(model, data, cfg, progress)
    pretrained = {k: v.detach().clone() for k, v in model_state(model).items()}
    pretrain_s = time.time() - started
    info = {
        "pairs": len(data),
        "tokens": result.tokens,
        "loss": round(result.loss, 4),
        "train_s": round(result.seconds, 1),
    }
    log.info("pre-training done", **info)
    label = f"pre-trained ({'+'.join(s['pretrain_domains'])})"
    table = {label: domain_bleu(task, model, "test", s["per_domain_test"])}
    ce = {label: domain_ce(task, model, "test", s["per_domain_test"])}
    torch.save(pretrained, cache_pt)
    write_atomic(
        cache_json,
        json.dumps({"key": key, "table": table, "ce": ce, "pretrain_s": pretrain_s, "pretrain": info}),
    )
    return pretrained, table, ce, pretrain_s, info


def _local_only(
    task: Any, s: dict[str, Any], pretrained: dict[str, torch.Tensor], options: dict[str, Any], cache: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Phase 2: each client alone -- the pre-trained engine fine-tuned on its own domain for as many epochs
    (or steps) as a federation gives it. Its BLEU and cross-entropy rows are cached in
    ``cache``/local-only.json, keyed by the pre-training and the clients' settings."""
    key = _cache_key(options, {k: v for k, v in s.items() if k != "fractions"})
    path = cache / "local-only.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if cached.get("key") == key:
        return cached["table"], cached["ce"]
    local_steps = s["rounds"] * (s["max_steps"] or 0)
    table, ce = {}, {}
    for i, client in enumerate(task.shard_names):
        m = task.build_model(_PRE_SEED)
        load_state(m, pretrained)
        task.train(
            m,
            i,
            TrainConfig(
                epochs=s["rounds"] if not local_steps else 100,
                max_steps=local_steps,
                seed=_PRE_SEED,
                **_nmt_train(s),
            ),
        )
        table[f"client {client} (local only)"] = domain_bleu(task, m, "test", s["per_domain_test"])
        ce[f"client {client} (local only)"] = domain_ce(task, m, "test", s["per_domain_test"])
    write_atomic(path, json.dumps({"key": key, "table": table, "ce": ce}))
    return table, ce


def run_nmt_domains(
    scale: str,
    out: Path,
    simulation: Callable[..., Any],
    seed: int = 0,
    cache: Path | None = None,
    only: str | None = None,
) -> dict[str, Any]:
    """Passban et al.: pre-train on news, one client per domain, FedAvg; then DP_l / DP_g / random pulling.

    Phases 1-2 (pre-training, each client alone) do not depend on ``seed``: as in the paper, every federation
    starts from one pre-trained engine ("we initialize all the clients with WMT parameters"), so the seeds
    vary the federations (batch order, pull-random's draws), and the pre-trained model is built once (seed 0)
    and cached in ``cache`` (default ``out``) for every seed."""
    s = _NMT[scale]
    runner = Runner(out, simulation)
    cache = cache or out
    options = nmt_options(scale, seed, cache)
    task = runner.task("nmt", options)
    names = list(task.shard_names)
    n = s["per_domain_test"]
    pretrained, table, ce, pretrain_s, pretrain_info = _pretrained_engine(task, s, options, cache)
    local_bleu, local_ce = _local_only(task, s, pretrained, options, cache)
    table, ce = {**table, **local_bleu}, {**ce, **local_ce}
    warm = WarmStartTask(task, pretrained)
    # 3. FedAvg from the pre-trained model; then the dynamic-pulling variants
    specs = nmt_specs(scale, options)
    results = []
    for spec in select(specs, only, None):
        summary = runner.federate(spec, task=warm, seed=seed)
        row = _row(spec, summary, out / spec.name)
        per_domain, per_domain_ce = _server_domain_scores(task, out / spec.name, summary, seed, n)
        table[f"server {spec.name}"] = per_domain
        row["bleu_mean_domains"] = sum(per_domain.values()) / len(per_domain)
        if per_domain_ce is not None:
            ce[f"server {spec.name}"] = per_domain_ce
            row["ce_mean_domains"] = sum(per_domain_ce.values()) / len(per_domain_ce)
        pick = _ce_pick(task, out / spec.name, summary, seed, n) if per_domain_ce is not None else None
        if pick is not None:
            table[f"server {spec.name}, CE pick"] = pick["test_bleu_by_domain"]
            ce[f"server {spec.name}, CE pick"] = pick["test_ce_by_domain"]
            row["ce_pick_round"] = pick["round"]
            row["bleu_ce_pick"] = sum(pick["test_bleu_by_domain"].values()) / len(pick["test_bleu_by_domain"])
            row["ce_ce_pick"] = sum(pick["test_ce_by_domain"].values()) / len(pick["test_ce_by_domain"])
        rounds = len(read_rounds(out / spec.name).records)
        row["bytes_up_per_round"] = row["bytes_up"] / max(rounds, 1)
        results.append(row)
    return {
        "runs": results,
        "bleu_by_domain": table,
        "ce_by_domain": ce,
        "domains": names,
        "pretrain_s": round(pretrain_s, 1),
        "pretrain_steps": s["pretrain_steps"],
        "pretrain": pretrain_info,
        "settings": {k: v for k, v in s.items() if k != "fractions"} | {"fractions": list(s["fractions"])},
    }


def domain_markdown(table: dict[str, dict[str, float]], domains: list[str], digits: int = 2) -> str:
    """A model x domain table (BLEU, or cross-entropy with ``digits`` 3) with each model's mean over
    domains."""
    lines = ["| model | " + " | ".join(domains) + " | mean |", "|" + "---|" * (len(domains) + 2)]
    for name, scores in table.items():
        vals = [scores[d] for d in domains]
        cells = [f"{v:.{digits}f}" for v in (*vals, sum(vals) / len(vals))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_COLUMNS = {
    "table2": ["run", "corpus", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "sweep": ["run", "lr", "momentum", "best_valid", "best_round", "max_jump", "valid_curve", "wall_s"],
    "fraction": ["run", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "rounds-to-target": [
        "run",
        "strategy",
        "E",
        "encoding",
        "test",
        "target",
        "rounds_to_target",
        "bytes_to_target",
        "bytes_up",
        "bytes_up_raw",
        "wall_s",
    ],
    "topk": ["run", "beta", "test", "best_valid", "updates_received", "bytes_up", "wall_s"],
    "randomization": ["run", "strategy", "noise", "test", "best_valid", "best_round", "wall_s"],
    "scale": ["run", "model", "tied", "test", "best_valid", "best_round", "wall_s"],
    "dropout": [
        "run",
        "availability",
        "faults",
        "test",
        "best_valid",
        "rounds_completed",
        "rounds_skipped",
        "updates_received",
        "wall_s",
    ],
    "nmt-domains": [
        "run",
        "strategy",
        "pull",
        "directions",
        "test",
        "bleu_mean_domains",
        "ce_mean_domains",
        "best_round",
        "ce_pick_round",
        "bleu_ce_pick",
        "ce_ce_pick",
        "bytes_up_per_round",
        "bytes_up",
        "bytes_up_raw",
        "bytes_down_raw",
        "wall_s",
    ],
}


def check_args(name: str, scale: str, threads: int = 1, device: str = "cpu") -> None:
    """One clear error line for a bad experiment name, scale, thread count or device
    (before anything is written)."""
    from fedmq.tasks.training import resolve_device

    if name not in NAMES:
        raise ExperimentError(f"unknown experiment {name!r}; choose one of {', '.join(NAMES)}")
    if scale not in SCALES:
        raise ExperimentError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if threads < 1:
        raise ExperimentError(f"threads must be at least 1, got {threads}")
    resolve_device(device)  # --device cuda without a GPU


def corpora_needed(name: str, scale: str, only: str | None = None) -> list[str]:
    """The corpora experiment ``name`` reads at ``scale`` (the runs ``only`` picks: ``select``): names in the
    data folder (fedmq.tasks.corpora)."""
    if name == "nmt-domains":
        return ["de-en"]
    return sorted({spec.labels["corpus"] for spec in select(grid(name, scale), only, None)})


def check_corpora(name: str, scale: str, only: str | None = None) -> None:
    """One error line naming the folder looked in when a corpus the experiment reads is not on this machine
    (before anything is written)."""
    for corpus in corpora_needed(name, scale, only):
        try:
            find(corpus)
        except TaskError as exc:
            raise ExperimentError(str(exc)) from None


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = math.fsum(values) / len(values)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def across_seeds(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run of the grid: its labels, and test / best-validation perplexity as mean ± sd over
    seeds."""
    rows = []
    for first in per_seed[0]:
        same = [r for runs in per_seed for r in runs if r["run"] == first["run"]]
        row = {k: v for k, v in first.items() if k not in (*_PER_RUN, *_EACH_SEED)}
        for metric in _MEAN_SD:
            if not any(metric in r for r in same):
                continue
            vals = [r[metric] for r in same if r.get(metric) is not None and math.isfinite(r[metric])]
            row[metric], row[f"{metric}_sd"] = mean_sd(vals) if vals else (None, None)
        for count in _MEAN_COUNTS:
            vals = [r[count] for r in same if r.get(count) is not None]
            row[count] = round(mean_sd(vals)[0]) if vals else None
        for (
            each
        ) in _EACH_SEED:  # values that differ by seed and do not average (a round; None: never reached)
            if any(each in r for r in same):
                row[each] = " / ".join(_fmt(r.get(each)) for r in same)
        jumps = [r["max_jump"] for r in same if r.get("max_jump") is not None]
        row["max_jump"] = max(jumps) if jumps else None
        row["seeds"] = len(same)
        row["wall_s"] = round(math.fsum(r.get("wall_s") or 0.0 for r in same), 1)
        rows.append(row)
    return rows


_PER_RUN = (
    "test",
    "best_valid",
    "bleu_mean_domains",
    "ce_mean_domains",
    "bleu_ce_pick",
    "ce_ce_pick",
    "best_round",
    "valid_curve",
    "max_jump",
    "wall_s",
    "bytes_up",
    "bytes_down",
    "bytes_up_raw",
    "bytes_down_raw",
    "bytes_up_per_round",
    "updates_received",
    "rounds_completed",
    "rounds_skipped",
)
# in a several-seed row: _MEAN_SD as mean and sd over seeds, counts as their mean,
# _EACH_SEED listed seed by seed ("3 / 5 / —")
_MEAN_SD = ("test", "best_valid", "bleu_mean_domains", "ce_mean_domains", "bleu_ce_pick", "ce_ce_pick")
_MEAN_COUNTS = (
    "bytes_up",
    "bytes_down",
    "bytes_up_raw",
    "bytes_down_raw",
    "updates_received",
    "rounds_completed",
    "rounds_skipped",
    "bytes_up_per_round",
)
_EACH_SEED = ("best_round", "ce_pick_round", "target", "rounds_to_target", "bytes_to_target")


def orderings(
    per_seed: list[list[dict[str, Any]]],
    metric: str = "test",
    higher_is_better: bool = False,
    digits: int = 2,
) -> list[str]:
    """Pairwise comparisons of ``metric`` (test perplexity; nmt-domains: the per-domain mean BLEU, higher
    better) between the runs that share a corpus and client fraction C (every pair of a C = 0.5 grid such as
    randomization's: strategy against strategy, noise against noise; every pair of nmt-domains' grid, all at
    C = 1), paired by seed (a seed fixes the initial model, the client sampling and local batch order; the LM
    tasks' IID shards are seed 0's in every seed): "A < B in k/n seeds, difference mean ± sd" (A is the better
    one: ">" when higher is better). An ordering is called resolved when it holds in every seed and the mean
    difference exceeds its sd."""
    lines = []
    runs = per_seed[0]
    sign = (
        -1.0 if higher_is_better else 1.0
    )  # diffs are "how much worse the second is", so > 0 favours the first
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if a.get("fraction") is None or (a.get("corpus"), a["fraction"]) != (
                b.get("corpus"),
                b.get("fraction"),
            ):
                continue
            diffs = []
            for seed_runs in per_seed:
                ta = next((r.get(metric) for r in seed_runs if r["run"] == a["run"]), None)
                tb = next((r.get(metric) for r in seed_runs if r["run"] == b["run"]), None)
                if ta is not None and tb is not None:
                    diffs.append(sign * (tb - ta))
            if not diffs:
                continue
            better, worse = a["run"], b["run"]
            if math.fsum(diffs) < 0:  # b is the better one: state it first
                better, worse, diffs = worse, better, [-d for d in diffs]
            wins = sum(1 for d in diffs if d > 0)
            m, sd = mean_sd(diffs)
            resolved = wins == len(diffs) and len(diffs) > 1 and m > sd
            verdict = " (resolved)" if resolved else " (not resolved)"
            lines.append(
                f"{better} {'>' if higher_is_better else '<'} {worse} in {wins}/{len(diffs)} seeds, "
                f"difference {m:.{digits}f} ± {sd:.{digits}f}{verdict}"
            )
    return lines


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> [0, 1, 2]; one clear error for anything else."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ExperimentError(f"--seeds wants comma-separated whole numbers, got {text!r}") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ExperimentError(f"--seeds wants distinct whole numbers >= 0, got {text!r}")
    return seeds


def run_experiment(
    name: str,
    scale: str = "cpu",
    out: Path | str | None = None,
    seeds: Sequence[int] = (0,),
    threads: int = 1,
    *,
    simulation: Callable[..., Any],
    report: Callable[[list[Path], Path], Any] | None = None,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    cohort: bool = False,
) -> dict[str, Any]:
    """Run experiment ``name`` at ``scale`` for each seed; results under ``out/name``;
    returns the results dict.

    ``simulation`` runs a federation (:class:`Runner`); ``report`` (cli.report.run_report; None: none) draws
    each results folder's report from its run folders (module docstring).

    One seed writes its run folders to ``out/name/<run>``; several write ``out/name/seed-<s>/<run>`` and the
    results table gives mean ± sd over seeds, plus the paired orderings (``orderings``). Rerunning the same
    command skips finished runs and resumes unfinished ones (``Runner.federate``).
    ``only``: run a subset of the grid (several processes can share one grid this way); ``overrides`` (LM
    experiments only): with changed job settings, for the investigations in docs/results/ (e.g. more rounds);
    the results record them. ``cohort``: train each round's selected clients together (``Simulation.cohort``).
    """
    check_args(name, scale, threads, device)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ExperimentError(f"seeds must be distinct whole numbers >= 0, got {seeds}")
    if name != "nmt-domains":
        select(grid(name, scale), only, overrides)  # validate before anything is written
    elif (
        overrides
    ):  # --set would change the federations but not the local-only baselines they are read against
        raise ExperimentError("--set applies to the language-modelling experiments, not nmt-domains")
    elif only:
        select(nmt_specs(scale), only, None)
    check_corpora(name, scale, only)
    exp_dir = Path(out or "runs/experiments") / name
    exp_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    started = time.time()
    folders = [exp_dir] if len(seeds) == 1 else [exp_dir / f"seed-{s}" for s in seeds]
    per_seed = []
    for seed, folder in zip(seeds, folders):
        folder.mkdir(parents=True, exist_ok=True)
        if name == "nmt-domains":
            per_seed.append(run_nmt_domains(scale, folder, simulation, seed, cache=exp_dir, only=only))
        else:
            per_seed.append(
                run_lm_experiment(
                    name,
                    scale,
                    folder,
                    simulation,
                    seed,
                    only,
                    overrides,
                    device,
                    shared=exp_dir.parent,
                    cohort=cohort,
                )
            )
    if len(seeds) == 1:
        results = per_seed[0]
    else:
        results = {
            "runs": across_seeds([r["runs"] for r in per_seed]),
            "orderings": (
                orderings([r["runs"] for r in per_seed])
                if name != "nmt-domains"
                else orderings([r["runs"] for r in per_seed], "bleu_mean_domains", higher_is_better=True)
            ),
            **(
                {
                    "orderings_ce": orderings([r["runs"] for r in per_seed], "ce_mean_domains", digits=3),
                    "orderings_ce_pick": orderings([r["runs"] for r in per_seed], "ce_ce_pick", digits=3),
                }
                if name == "nmt-domains"
                else {}
            ),
            "per_seed": {str(s): r for s, r in zip(seeds, per_seed)},
        }
    results.update(
        experiment=name,
        scale=scale,
        seeds=seeds,
        threads=threads,
        only=only,
        overrides=overrides or {},
        wall_s=round(time.time() - started, 1),
    )
    write_atomic(exp_dir / "results.json", json.dumps(results, indent=1, default=str))
    changed = f", overrides {overrides}" if overrides else ""
    columns = _COLUMNS[name] if len(seeds) == 1 else _seed_columns(_COLUMNS[name])
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}, mean ± sd"
    text = [
        f"# {name} ({scale} scale{changed}, {seed_text}, wall {results['wall_s']} s)",
        "",
        markdown(results["runs"], columns),
    ]
    if results.get("orderings"):
        what = "test perplexity" if name != "nmt-domains" else "the per-domain mean BLEU"
        text += ["", f"Orderings of {what} (paired by seed):", ""] + [f"- {o}" for o in results["orderings"]]
    if results.get("orderings_ce"):
        text += [
            "",
            "Orderings of the per-domain mean cross-entropy, nats a token, lower is better (paired by seed):",
            "",
        ] + [f"- {o}" for o in results["orderings_ce"]]
    if results.get("orderings_ce_pick"):
        text += [
            "",
            "The same, each server read at its round of lowest validation cross-entropy (ce_pick_round):",
            "",
        ] + [f"- {o}" for o in results["orderings_ce_pick"]]
    for seed, r in zip(seeds, per_seed):
        if "bleu_by_domain" in r:
            text += [
                "",
                f"BLEU on each domain's test pairs (seed {seed}):",
                "",
                domain_markdown(r["bleu_by_domain"], r["domains"]),
            ]
        if r.get("ce_by_domain"):
            text += [
                "",
                "Cross-entropy (nats a reference token, teacher forcing) on each domain's test pairs "
                f"(seed {seed}):",
                "",
                domain_markdown(r["ce_by_domain"], r["domains"], digits=3),
            ]
    write_atomic(exp_dir / "results.md", "\n".join(text) + "\n")
    write_results_file(
        exp_dir, name, scale, seeds, folders, per_seed, threads, only, overrides, device, cohort
    )
    if report is not None:
        for folder, r in zip(folders, per_seed):
            report([folder / row["run"] for row in r["runs"]], folder / "report")
    return results


def write_results_file(
    exp_dir: Path,
    name: str,
    scale: str,
    seeds: list[int],
    folders: list[Path],
    per_seed: list[dict[str, Any]],
    threads: int = 1,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    cohort: bool = False,
) -> Path:
    """Write ``exp_dir/NAME.SCALE.json``, the results file kept in git (benchmarks/results_file.py): each
    run's final numbers by seed, the command that reruns them and the commit. Its path."""
    rows = [
        results_file.run_row(row, folder / row["run"], seed)
        for seed, folder, seed_results in zip(seeds, folders, per_seed)
        for row in seed_results["runs"]
    ]
    first = per_seed[0]
    models = pretrain = None
    if "bleu_by_domain" in first:  # nmt-domains: the pre-trained engine and the clients alone
        models = results_file.nmt_models(first["bleu_by_domain"], first.get("ce_by_domain") or {})
        pretrain = {**first.get("pretrain", {}), "wall_s": first.get("pretrain_s")}
    commit, dirty = results_file.git_commit(ROOT)
    command = results_file.command_line(name, scale, seeds, threads, only, overrides, device, cohort)
    path = exp_dir / results_file.file_name(name, scale)
    doc = results_file.document(name, scale, rows, command, overrides, commit, dirty, models, pretrain)
    results_file.write(path, doc)
    return path


def _seed_columns(columns: list[str]) -> list[str]:
    """The columns of a several-seed table: per-seed-only ones dropped, an sd beside each averaged metric."""
    out = []
    for c in columns:
        if c in _MEAN_SD:
            out += [c, f"{c}_sd"]
        elif c not in _PER_RUN or c in ("max_jump", "wall_s", *_MEAN_COUNTS, *_EACH_SEED):
            out.append(c)
    return out + ["seeds"]
