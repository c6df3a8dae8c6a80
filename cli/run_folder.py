"""`fedmq simulate`'s run folder: one run per folder, created only once the flags are valid, gone again when
the command fails before its first round.

- ``--out`` holding a run (config.json or metrics.jsonl) without ``--resume`` is refused in one line naming
  ``--resume`` (as Lightning and NVFlare users expect): no silently mixed metrics, checkpoints or summaries.
- ``--out`` that is a file, sits under a file, or cannot be created is one line, not a traceback.
- Nothing is created until every flag is checked; what the command created (the folder, or new entries in an
  existing empty one) is removed again when it fails or is interrupted before the engine wrote config.json (it
  does so right before the first round): a typo, a refused option or an unreachable broker leaves nothing
  behind.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedmq.aggregator.runlog import CONFIG_FILE, RunFolderError, holds_run, read_config
from fedmq.cli.errors import UsageError


def default_dir(strategy: str) -> Path:
    # package.module:Class -> Class
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", strategy.rpartition(":")[2] or strategy)
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


def check(run_dir: Path, resume: bool) -> dict[str, Any] | None:
    """Check ``run_dir`` for this command (nothing is created): on --resume its saved config.json,
    else None."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file; give a folder for the run")
    if resume:
        path = run_dir / CONFIG_FILE
        try:
            config = read_config(run_dir)
        except RunFolderError as exc:
            if exc.__cause__ is None:  # JSON, but not an object; else the error that made it unreadable
                raise UsageError(f"--resume: {path} is not a run config (a JSON object)") from None
            raise UsageError(
                f"--resume: cannot read {path} ({exc.__cause__}); the run cannot be rebuilt from it"
            ) from None
        if config is None:
            raise UsageError(f"--resume needs an existing run folder; {run_dir} has no {CONFIG_FILE}")
        return config
    held = holds_run(run_dir)
    if held:
        raise UsageError(
            f"--out {run_dir} already holds a run ({held[0]}); pass --resume to continue it, "
            "or choose another --out"
        )
    _check_writable(run_dir)
    return None


def create(run_dir: Path) -> Callable[[], None]:
    """Create ``run_dir``; returns ``discard``: it removes what this command made there (the folders it
    created, or, in a folder that existed, the entries that were not there before) unless a round started."""
    first_new = None
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        first_new = folder
    before = set(os.listdir(run_dir)) if first_new is None else set()

    def discard() -> None:
        if (run_dir / CONFIG_FILE).exists():  # written right before round 1: a resumable run
            return
        if first_new is not None:
            shutil.rmtree(first_new, ignore_errors=True)
            return
        for name in set(os.listdir(run_dir)) - before:
            path = run_dir / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".fedmq-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        discard()
        raise UsageError(f"cannot write the run folder {run_dir}: {exc.strerror or exc}") from None
    return discard


def check_checkpoint_fits(run_dir: Path, task: Any, seed: int, strategy: str) -> None:
    """On --resume: the newest checkpoint's tensors must have this task's model shapes, and the strategy's
    tensors beside the model theirs (ClientHook.extra_tensors: SCAFFOLD's control variates). A mismatch (the
    corpus changed, or an old folder lacked the options) is one line here instead of agents rejecting every
    model."""
    from fedmq.aggregator.checkpoint import load_checkpoint
    from fedmq.aggregator.strategies.registry import strategy_class
    from fedmq.tasks.base import model_state

    ckpt = load_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return
    want = {k: tuple(v.shape) for k, v in model_state(task.build_model(seed)).items()}
    hook = strategy_class(strategy).client_hook
    if hook is not None:
        want.update({name: want[like] for name, like in hook.extra_tensors(list(want)).items()})
    have = {k: tuple(v.shape) for k, v in ckpt.global_state.items()}
    if want != have:
        name = next(k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k))
        raise UsageError(
            f"the checkpoint in {run_dir} does not fit the model these options build (tensor {name}: "
            f"checkpoint {list(have.get(name, ()))}, model {list(want.get(name, ()))}); resume with "
            "the run's own data and task options"
        )


def _check_writable(run_dir: Path) -> None:
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"cannot create the run folder {run_dir}: {folder} is a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create the run folder {run_dir}: {folder} is not writable")
