"""The language-modelling grids (data): which federations make each named experiment at each scale,
and which of them ``--only`` picks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedmq.aggregator.config import JobConfig
from fedmq.benchmarks.experiments.spec import DEADLINES, SCHEDULE, ExperimentError, RunSpec, corpus_folder
from fedmq.files import write_atomic

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


def lm_client(scale: str) -> dict[str, Any]:
    """The LM experiments' local SGD at ``scale``: batch size, lr, momentum and clipping (TrainConfig's)."""
    return {k: _LM_JOB[scale][k] for k in ("batch_size", "lr", "momentum", "clip")}


_CORPORA = {"paper": ["wikitext-2", "ptb"], "cpu": ["ptb"], "smoke": ["wikitext-2"]}
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
    options = {**_LM_TASK[scale], "data": corpus_folder(corpus), "tied": True, **(task or {})}
    settings = {**_LM_JOB[scale], **DEADLINES, **SCHEDULE, **job}
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


def trace_file(out: Path, clients: int, rounds: int) -> Path:
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
