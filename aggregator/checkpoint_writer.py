"""Writing a round's files off the round's critical path: the checkpoint, ``best.pt``, then the round's spool
cleared, on a thread of their own while the next round selects, trains and folds.

Crash safety is the spool's, as before: a round's spool is deleted only once the checkpoint that includes
the round is on disk, so a process killed while that checkpoint is still being written restarts from the
checkpoint before it, and folds the round again from its spool (the same updates in the same order: the same
model), then the round after it from its own spool. At most one write is pending: ``submit`` waits for the
previous one first, so a restart never has more than the two newest rounds to fold again. A write that fails
(a full disk) is raised in the engine's thread at the next ``submit`` or ``wait``, as one error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class CheckpointWriter:
    """One write at a time, in order, on a background thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], object]) -> None:
        """Run ``write`` in the background, once the previous write is done (its error raised here)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._run, args=(write,), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Until the pending write (if any) is on disk; raise its error, once."""
        self._join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def join(self) -> None:
        """Until the pending write (if any) is done, when the job is failing already: its error is logged
        (and kept for ``wait``), not raised over the job's own."""
        self._join()
        if self._error is not None:
            log.error("checkpoint write failed", error=f"{type(self._error).__name__}: {self._error}")

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as exc:  # handed to the engine's thread (wait)
            self._error = exc
