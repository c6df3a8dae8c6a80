"""Local training settings (``TrainConfig``): what a task's ``train`` is given, what a strategy's
``configure_train`` shapes, and what each round's announcement carries to the selected agents (as
``RoundConfig.train``), so the settings are written once and travel whole instead of being copied field by
field. No torch here: the command line and the wire read it.

``RANGES`` are the values an agent agrees to train with: a job whose settings fall outside them is refused
when it is configured, and an announcement that asks for more (a forged or damaged one) is refused by every
agent before it trains."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fedmq import defaults

OPTIMIZERS = ("sgd", "adam")


@dataclass
class TrainConfig:
    epochs: int = defaults.EPOCHS
    batch_size: int = defaults.BATCH_SIZE
    lr: float = defaults.LR
    optimizer: str = defaults.OPTIMIZER  # "sgd" | "adam"
    momentum: float = defaults.MOMENTUM
    lr_decay: float = defaults.LR_DECAY  # multiply lr by this after every local epoch
    clip: float = defaults.CLIP  # gradient-norm clipping (0 = off)
    warmup_steps: int = 0  # lr rises linearly from lr/warmup_steps to lr over the first steps (0 = off)
    linear_decay: bool = False  # after warm-up, lr falls linearly to 0 at the run's last step
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_steps: int = 0  # cap on optimizer steps per local run (0 = no cap); the CPU scale uses it
    # FedSGD (McMahan et al., B = ∞): one step on the gradient of the whole shard per epoch
    full_batch: bool = False
    tail_loss: bool = False  # also measure the trained model's loss on its shard (FedMed's top-K ranks by it)
    device: str = "cpu"  # "auto" | "cpu" | "cuda"; the agent's own choice, never announced
    amp: bool = False  # mixed precision on CUDA
    # announced: the job's seed; each agent trains with a seed derived from it, its id and the round
    seed: int = 0


# (low, high, low is open) per numeric field: the bounds an agent trains within
RANGES: dict[str, tuple[float, float, bool]] = {
    "epochs": (1, 1_000, False),
    "batch_size": (1, 65_536, False),
    "lr": (0, 10_000.0, True),
    "momentum": (0, 1, False),
    "lr_decay": (0, 1, True),
    "clip": (0, 1e6, False),
    "warmup_steps": (0, 10_000_000, False),
    "max_steps": (0, 10_000_000, False),
    "seed": (0, 2**63 - 1, False),
}
# what an announcement carries of a TrainConfig: everything but the agent's device
ANNOUNCED = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "device")


def out_of_range(name: str, value: float) -> str | None:
    """Why ``value`` is outside ``RANGES[name]`` (None when inside, or when the field has no range)."""
    if name not in RANGES:
        return None
    low, high, open_low = RANGES[name]
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        return f"must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value!r}"
    return None


def to_payload(cfg: TrainConfig) -> dict[str, Any]:
    """The announced part of ``cfg`` (``ANNOUNCED``), as plain msgpack-able values."""
    return {name: list(v) if isinstance(v := getattr(cfg, name), tuple) else v for name in ANNOUNCED}


def from_payload(payload: Any) -> TrainConfig:
    """A TrainConfig from an announcement's ``train`` map; ValueError (one line) unless every announced field
    is there with its type and in its range. Fields this version does not know are ignored (a newer
    aggregator's setting an older agent can train without)."""
    if not isinstance(payload, dict):
        raise ValueError("train must be a map")
    missing = [name for name in ANNOUNCED if name not in payload]
    if missing:
        raise ValueError(f"train lacks {', '.join(missing)}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ANNOUNCED:
            continue
        value = payload[f.name]
        if f.type == "bool":
            ok = type(value) is bool
        elif f.type == "int":
            ok = type(value) is int
        elif f.type == "float":
            ok = type(value) in (int, float)
            value = float(value) if ok else value
        elif f.type == "str":
            ok = isinstance(value, str)
        else:  # adam_betas: two numbers in [0, 1)
            ok = (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and all(type(b) in (int, float) and 0 <= b < 1 for b in value)
            )
            value = tuple(float(b) for b in value) if ok else value
        if not ok:
            raise ValueError(f"train {f.name} must be {f.type}")
        values[f.name] = value
    cfg = TrainConfig(**values)
    try:
        check(cfg)
    except ValueError as exc:
        raise ValueError(f"train {exc}") from None
    return cfg


def check(cfg: TrainConfig) -> None:
    """ValueError naming the first setting of ``cfg`` outside ``RANGES`` or of an unknown optimizer."""
    for name in RANGES:
        why = out_of_range(name, getattr(cfg, name))
        if why:
            raise ValueError(f"{name} {why}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
