"""A job's differential-privacy settings (docs/guide/privacy.md) as aggregator.config reads and checks them:
the modes, a job file's ``[privacy]`` table, and the one line for the first setting that is wrong.
Torch-free, as the rest of a job's settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

DP_MODES = ("none", "central", "client")
# a job file's [privacy] table: its keys and the JobConfig fields they set
PRIVACY_TABLE = {
    "mode": "dp",
    "clip_norm": "clip_norm",
    "clip_quantile": "clip_quantile",
    "noise_multiplier": "noise_multiplier",
    "target_epsilon": "target_epsilon",
    "delta": "delta",
}


def privacy_problem(cfg: Any, key: Callable[[str], str], allowed: Sequence[str]) -> str | None:
    """Why the privacy settings of ``cfg`` (a JobConfig) cannot run, in one line, or None; ``key`` names a
    setting as errors do (its key and flag), ``allowed``: the strategies DP runs with."""
    if cfg.dp not in DP_MODES:
        return f"{key('dp')} {cfg.dp!r}: use none, central or client"
    if cfg.dp == "none":
        given = [n for n in ("noise_multiplier", "target_epsilon", "delta") if getattr(cfg, n) is not None]
        return f"{key(given[0])} needs {key('dp')} central or client" if given else None
    if cfg.dp == "client" and cfg.error_feedback and cfg.encoding.startswith("delta+topk"):
        return (
            f"{key('dp')} client with a top-k encoding: error feedback would add the last round's "
            "residual after the noise, beyond the norm the aggregator accepts; set error_feedback = false"
        )
    if isinstance(cfg.clip_norm, str):
        if cfg.dp == "client":
            return (
                f"{key('clip_norm')} adaptive needs {key('dp')} central: the clipped count it follows "
                "is noised by the aggregator"
            )
    elif not cfg.clip_norm > 0:
        return f"{key('clip_norm')} S must be positive, got {cfg.clip_norm}"
    if not 0 < cfg.clip_quantile < 1:
        return f"{key('clip_quantile')} must be in (0, 1), got {cfg.clip_quantile}"
    return _noise_problem(cfg, key) or _strategy_problem(cfg, key, allowed)


def _noise_problem(cfg: Any, key: Callable[[str], str]) -> str | None:
    """z, the target ε and δ."""
    z, target, delta = cfg.noise_multiplier, cfg.target_epsilon, cfg.delta
    if z is not None and target is not None:
        return f"give {key('noise_multiplier')} or {key('target_epsilon')}, not both: z is derived from ε"
    if z is not None and z < 0:
        return f"{key('noise_multiplier')} z must not be negative, got {z}"
    if target is not None and not target > 0:
        return f"{key('target_epsilon')} ε must be positive, got {target}"
    if delta is not None and not 0 < delta < 1 / cfg.clients:
        return (
            f"{key('delta')} δ={delta} must be in (0, 1/K) = (0, {1 / cfg.clients:.3g}) "
            f"for K={cfg.clients} clients (a larger δ allows publishing a client's data outright)"
        )
    return None


def _strategy_problem(cfg: Any, key: Callable[[str], str], allowed: Sequence[str]) -> str | None:
    """Under DP the result must be a clipped, noised average: what is not."""
    if cfg.strategy not in allowed:
        return (
            f"{key('dp')} needs an averaging strategy ({', '.join(allowed)}); {cfg.strategy!r} weighs or "
            "picks clients by their models or losses, which no clipping bounds"
        )
    if cfg.beta < 1:
        return f"{key('dp')} with {key('beta')} < 1: picking the top clients by loss reveals their losses"
    if cfg.robust != "none":
        return (
            f"{key('dp')} with {key('robust')} {cfg.robust}: the guard's choice depends on every "
            "client's model; under DP the clip norm bounds each update instead"
        )
    if cfg.noise > 0:
        return (
            f"{key('noise')} is FedAtt's randomization, which states no ε; under {key('dp')} the "
            f"noise is {key('noise_multiplier')}"
        )
    return None
