"""Atomic aggregator checkpoints (fedmq.files, durable and private: a temp file, fsync, os.replace, fsync the
directory; mode 0600).

File ``ckpt-<round:08d>-<version:08d>.fmq`` = magic ``FMQCKPT1`` + 32-byte SHA-256 of the payload + payload,
the payload being ``torch.save({"tensors": [...], "meta": <json str>})``. Everything that is not a tensor
(strategy and mediator state, RNG state, folded update ids, extra) is JSON; tensors nested anywhere in it
are swapped for ``{"__tensor__": i}`` and tuples for ``{"__tuple__": [...]}``. Loading checks the digest and
uses ``torch.load(weights_only=True)`` only — nothing is ever unpickled. A truncated or corrupt file is
skipped with a logged reason and the previous one is used; the newest ``keep`` checkpoints are kept. An intact
file whose state would not have been kept (:func:`check_resumable`) is refused: the run does not resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from fedmq.aggregator.strategies.base import Strategy
from fedmq.aggregator.strategies.errors import CheckpointError
from fedmq.errors import FedmqError
from fedmq.files import replacing
from fedmq.state_checks import state_problem

log = structlog.get_logger(__name__)

MAGIC = b"FMQCKPT1"
_NAME = re.compile(r"^ckpt-(\d{8})-(\d{8})\.fmq$")


class NoCheckpointToResume(FedmqError):
    """The run folder records rounds that only a checkpoint could continue, and none is readable."""

    exit_code = 1  # the command line was right; the run cannot go on


class CheckpointRefused(FedmqError):
    """The newest checkpoint is intact (its digest matches) but holds state the job may not resume from: a
    global model or strategy state of the wrong shape or type, or non-finite (fedmq.state_checks)."""

    exit_code = 1


@dataclass
class Checkpoint:
    round: int
    model_version: int
    global_state: dict[str, torch.Tensor]
    strategy_state: dict
    mediator_state: dict
    rng_state: Any
    folded: dict[int, list[str]]
    extra: dict = field(default_factory=dict)
    path: Path | None = None


def _encode(obj: Any, tensors: list[torch.Tensor], copy: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        tensors.append(t.clone() if copy else t)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, copy) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, copy) for v in obj]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointError(f"checkpoint state keys must be strings, got {k!r}")
            if k in ("__tensor__", "__tuple__"):
                raise CheckpointError(f"checkpoint state may not use the reserved key {k!r}")
            out[k] = _encode(v, tensors, copy)
        return out
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot checkpoint a value of type {type(obj).__name__}")


def _decode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_checkpoint(path_dir: str | os.PathLike, **state: Any) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``; returns its path
    (``state``: prepare_checkpoint's keyword arguments)."""
    return prepare_checkpoint(path_dir, **state).write()


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A checkpoint taken but not yet written: its state is captured (the JSON part serialized; the global
    model's tensors held by reference, which the engine replaces and never changes in place; the strategy's
    and the rest copied, since a strategy of one's own may update its state in place), so :meth:`write` may
    run on another thread while the job goes on (aggregator.checkpoint_writer)."""

    directory: Path
    round: int
    model_version: int
    tensors: list[torch.Tensor]
    meta: str
    keep: int

    def write(self) -> Path:
        buf = io.BytesIO()
        torch.save({"tensors": self.tensors, "meta": self.meta}, buf)
        payload = buf.getvalue()
        target = self.directory / f"ckpt-{self.round:08d}-{self.model_version:08d}.fmq"
        with replacing(target, durable=True, private=True) as fh:  # the model: its owner's alone
            fh.write(MAGIC)
            fh.write(hashlib.sha256(payload).digest())
            fh.write(payload)
        for old in _candidates(self.directory)[self.keep :]:
            old.unlink(missing_ok=True)
        log.info(
            "checkpoint.saved",
            path=str(target),
            round=self.round,
            model_version=self.model_version,
            bytes=len(payload) + 40,
        )
        return target


def prepare_checkpoint(
    path_dir: str | os.PathLike,
    *,
    round: int,
    model_version: int,
    global_state: dict[str, torch.Tensor],
    strategy_state: dict,
    mediator_state: dict,
    rng_state: Any,
    folded: dict[int, list[str]],
    extra: dict,
    keep: int = 3,
) -> PreparedCheckpoint:
    """Capture one checkpoint's state (checked and serialized now: CheckpointError on a bad value) for a
    later ``write``."""
    if not (
        isinstance(round, int)
        and isinstance(model_version, int)
        and 0 <= round < 10**8
        and 0 <= model_version < 10**8
    ):
        raise CheckpointError(
            f"round and model_version must be integers in [0, 1e8), got {round!r}, {model_version!r}"
        )
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep!r}")
    directory = Path(path_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: list[torch.Tensor] = []
    meta = {
        "round": round,
        "model_version": model_version,
        "global_state": _encode(dict(global_state), tensors),
        "strategy_state": _encode(strategy_state, tensors, copy=True),
        "mediator_state": _encode(mediator_state, tensors, copy=True),
        "rng_state": _encode(rng_state, tensors, copy=True),
        "folded": {str(int(r)): [str(u) for u in ids] for r, ids in folded.items()},
        "extra": _encode(extra, tensors, copy=True),
    }
    return PreparedCheckpoint(directory, round, model_version, tensors, json.dumps(meta), keep)


def _candidates(directory: Path) -> list[Path]:
    """Checkpoint files, newest (highest round, then version) first."""
    found = [(m.group(1), m.group(2), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, _, p in sorted(found, reverse=True)]


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and verify one checkpoint file; CheckpointError with the reason when it is not valid."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {p}: {exc.strerror or exc}") from None
    if len(data) < 40 or data[:8] != MAGIC:
        raise CheckpointError(f"{p.name}: not a fedmq checkpoint (bad header or truncated)")
    payload = data[40:]
    if hashlib.sha256(payload).digest() != data[8:40]:
        raise CheckpointError(f"{p.name}: digest mismatch (truncated or corrupt)")
    try:
        obj = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        tensors, meta = obj["tensors"], json.loads(obj["meta"])
        return Checkpoint(
            round=int(meta["round"]),
            model_version=int(meta["model_version"]),
            global_state=_decode(meta["global_state"], tensors),
            strategy_state=_decode(meta["strategy_state"], tensors),
            mediator_state=_decode(meta["mediator_state"], tensors),
            rng_state=_decode(meta["rng_state"], tensors),
            folded={int(r): list(ids) for r, ids in meta["folded"].items()},
            extra=_decode(meta["extra"], tensors),
            path=p,
        )
    except Exception as exc:  # digest matched but the contents are not ours: still one clear reason
        raise CheckpointError(f"{p.name}: unreadable contents ({type(exc).__name__})") from None


def load_checkpoint(path_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest valid checkpoint in ``path_dir`` (invalid ones are logged and skipped), or None."""
    directory = Path(path_dir)
    if not directory.is_dir():
        return None
    for p in _candidates(directory):
        try:
            return read_checkpoint(p)
        except CheckpointError as exc:
            log.warning("checkpoint.skipped", path=str(p), reason=str(exc))
    return None


def check_fresh_start(path_dir: str | os.PathLike, rounds_recorded: int) -> None:
    """A run with no readable checkpoint may start afresh only if it had not got past its first round (the
    first round's metrics row is written before its checkpoint: a kill between them leaves that row alone).
    Otherwise starting again would train a fresh model under the old run's name and append its rounds to the
    old metrics: :class:`NoCheckpointToResume`."""
    if rounds_recorded > 1:
        raise NoCheckpointToResume(
            f"{path_dir} holds no readable checkpoint, but the run folder records {rounds_recorded} rounds; "
            "refusing to start again from round 1 (restore the checkpoints, or start a new run elsewhere)"
        )


def check_resumable(
    ckpt: Checkpoint, shapes: Mapping[str, tuple[int, ...]], build: Callable[[str], Strategy]
) -> None:
    """A checkpoint's global model and strategy state pass the checks a round's pass before they are kept
    (fedmq.state_checks; each strategy's state loaded into ``build(name)``, then its ``check_state``), its
    model has exactly the tensors of ``shapes``; otherwise :class:`CheckpointRefused`, one line."""
    where = ckpt.path.name if ckpt.path else "checkpoint"
    model = ckpt.global_state
    if not isinstance(model, dict):
        why: str | None = f"is a {type(model).__name__}, not a dict of tensors"
    elif set(model) != set(shapes):
        why = f"tensors {sorted(set(model) ^ set(shapes))[:3]} are not the job's (or missing)"
    else:
        why = state_problem(model, shapes)
    if why is not None:
        raise CheckpointRefused(f"{where}: global model {why}; refusing to resume from it")
    kept = ckpt.strategy_state if ckpt.strategy_state is not None else {}
    if not isinstance(kept, dict):
        raise CheckpointRefused(f"{where}: strategy state is not a dict; refusing to resume from it")
    for name, state in kept.items():
        try:
            if not isinstance(state, dict):
                raise TypeError(f"a {type(state).__name__}, not a dict")
            strategy = build(name)
            strategy.load_state_dict(state)
            why = strategy.check_state(strategy.state_dict(), model)
        except Exception as exc:  # whatever a strategy's load_state_dict makes of a forged state
            why = f"unreadable ({type(exc).__name__}: {exc})"
        if why is not None:
            raise CheckpointRefused(f"{where}: strategy {name!r} state {why}; refusing to resume from it")
