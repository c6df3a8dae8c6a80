"""Run a `fedmq` command that kills itself with SIGKILL at one crash point of one round.

    python crash_at.py POINT ROUND fedmq-args...

Crash points of a round (the phases of tests/fault/fault_plan.py, seen from inside the process):

- ``trained``: a client has trained the round and kept its state (client_agent.state.DiskStore), nothing of
  the round is spooled yet;
- ``during-agg``: the round's first update is spooled (aggregator.spool);
- ``after-agg``: the round's metrics row is written, its checkpoint not yet;
- ``after-checkpoint``: the checkpoint that includes the round is written, the round's spool not yet cleared;
- ``checkpoint-pending``: the checkpoint that includes the round is still being written (held back here)
  while the next round has spooled its first update (aggregator.checkpoint_writer).
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

POINTS = ("trained", "during-agg", "after-agg", "after-checkpoint", "checkpoint-pending")


def _kill_after(owner: Any, name: str, hit: Callable[..., bool]) -> None:
    """Wrap ``owner.name``: after the original, SIGKILL this process when ``hit(*args, **kwargs)`` holds."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if hit(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapper)


def _hold_before(owner: Any, name: str, hit: Callable[..., bool]) -> None:
    """Wrap ``owner.name``: when ``hit(*args, **kwargs)`` holds, wait for ever instead of calling it (the
    process is killed meanwhile)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if hit(*args, **kwargs):
            threading.Event().wait()
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def arm(point: str, rnd: int) -> None:
    from fedmq.aggregator import checkpoint, runlog, spool
    from fedmq.client_agent import state

    if point == "trained":  # a round trains from version rnd - 1 (every round of the test folds)
        _kill_after(
            state.DiskStore,
            "put",
            lambda _self, _client, name, version, _state: name.startswith("hook.") and version == rnd - 1,
        )
    elif point == "during-agg":
        _kill_after(spool.RoundSpool, "save_update", lambda _self, r, _client, _body: r == rnd)
    elif point == "after-agg":
        _kill_after(runlog.RunLog, "append", lambda _self, row: getattr(row, "round", None) == rnd)
    elif point == "after-checkpoint":  # the checkpoint written after round rnd resumes at round rnd + 1
        _kill_after(checkpoint.PreparedCheckpoint, "write", lambda self: self.round == rnd + 1)
    elif point == "checkpoint-pending":
        _hold_before(checkpoint.PreparedCheckpoint, "write", lambda self: self.round == rnd + 1)
        _kill_after(spool.RoundSpool, "save_update", lambda _self, r, _client, _body: r == rnd + 1)
    else:
        raise SystemExit(f"unknown crash point {point!r}: one of {', '.join(POINTS)}")


def killed(point: str, rnd: int, args: Sequence[str], cwd: Any, env: dict[str, str]) -> Any:
    """Run ``fedmq ARGS`` in a fresh interpreter, armed to kill itself at ``point`` of round ``rnd``; the
    completed process (its returncode is -SIGKILL when the point was reached)."""
    import subprocess

    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, point, str(rnd), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=cwd)


if __name__ == "__main__":
    arm(sys.argv[1], int(sys.argv[2]))
    sys.argv = ["fedmq", *sys.argv[3:]]
    runpy.run_module("fedmq.cli.app", run_name="__main__")
