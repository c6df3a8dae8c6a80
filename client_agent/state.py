"""What an agent keeps between the rounds it is selected for, in memory or on disk.

Only what the job's algorithm needs is kept (the round config says which: ``keep_model``, ``keep_own``,
``error_feedback``): the global model it trained from (the base of a delta push; under pull-down the values it
keeps for tensors not pushed), its own model after local training (the dynamic-pulling rule compares against
it) and what its sparsified uploads left out (error feedback). A service agent keeps them in memory;
`fedmq simulate` keeps them on disk, so K simulated clients cost no memory for it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedmq.files import replacing
from fedmq.tasks.base import State


class MemoryStore:
    """Kept state in this process's memory (one agent per process)."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, str], tuple[int, State]] = {}

    def put(self, client: str, name: str, version: int, state: State) -> None:
        self._items[(client, name)] = (version, state)

    def get(self, client: str, name: str) -> tuple[int, State] | None:
        return self._items.get((client, name))

    def drop(self, client: str, name: str) -> None:
        self._items.pop((client, name), None)


class DiskStore:
    """Kept state as one file per (client, name) under ``root`` (written atomically)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, client: str, name: str) -> Path:
        return self.root / f"{client}.{name}.pt"

    def put(self, client: str, name: str, version: int, state: State) -> None:
        with replacing(self._path(client, name), private=True) as fh:  # trained on private data: 0600
            torch.save({"version": version, "state": state}, fh)

    def get(self, client: str, name: str) -> tuple[int, State] | None:
        path = self._path(client, name)
        if not path.is_file():
            return None
        item = torch.load(path, weights_only=True)
        return int(item["version"]), item["state"]

    def drop(self, client: str, name: str) -> None:
        self._path(client, name).unlink(missing_ok=True)
