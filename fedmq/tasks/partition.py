"""Client partitions of a list of items (lines, sentence pairs);
every scheme is seeded and covers each item once.

- ``iid``: shuffle the item indices with ``seed``, split into K contiguous parts whose sizes differ by at most
  one (the papers' "shuffle, split into K equal client shards").
- ``dirichlet:ALPHA``: label/topic skew. Items carry a category (domain, docid, or a block of consecutive
  lines); for each category c draw q_c ~ Dir(ALPHA·1_K) and deal the category's items to the clients in those
  proportions. Resampled (same RNG stream) until every client holds at least one item.
- ``natural``: one category per client, in sorted category order (K = number of categories).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedmq.tasks.errors import TaskError


@dataclass(frozen=True)
class PartitionSpec:
    kind: str  # "iid" | "dirichlet" | "natural"
    alpha: float = 0.0

    @classmethod
    def parse(cls, text: str) -> PartitionSpec:
        t = text.strip().lower()
        if t in ("iid", "natural"):
            return cls(t)
        if t.startswith("dirichlet"):
            _, _, a = t.partition(":")
            try:
                alpha = float(a) if a else 0.5
            except ValueError:
                raise TaskError(
                    f"bad partition {text!r}: use dirichlet:ALPHA with ALPHA a positive number, "
                    "e.g. dirichlet:0.5"
                ) from None
            if not alpha > 0 or not np.isfinite(alpha):
                raise TaskError(
                    f"bad partition {text!r}: the Dirichlet alpha must be a positive number, "
                    "e.g. dirichlet:0.5"
                )
            return cls("dirichlet", alpha)
        raise TaskError(
            f"unknown partition {text!r}: use iid, dirichlet:ALPHA (e.g. dirichlet:0.5) or natural"
        )

    def __str__(self) -> str:
        return f"dirichlet:{self.alpha:g}" if self.kind == "dirichlet" else self.kind


def iid_shards(n_items: int, k: int, seed: int) -> list[np.ndarray]:
    """Seeded shuffle of range(n_items), split into k contiguous parts (sizes differ by at most one)."""
    _check_k(n_items, k)
    perm = np.random.default_rng(seed).permutation(n_items)
    return [np.sort(p) for p in np.array_split(perm, k)]


def dirichlet_shards(
    categories: Sequence[object], k: int, alpha: float, seed: int, max_tries: int = 200
) -> list[np.ndarray]:
    """Deal each category's items to k clients in Dir(alpha) proportions; every client gets >= 1 item."""
    n = len(categories)
    _check_k(n, k)
    cats = _category_ids(categories)
    members = [np.flatnonzero(cats == c) for c in range(int(cats.max()) + 1)]
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for idx in members:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(k, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).round().astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        shards = [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]
        if min(len(s) for s in shards) > 0:
            return shards
    raise TaskError(
        f"dirichlet:{alpha:g} left a client with no data after {max_tries} draws "
        f"for {k} clients and {n} items: raise alpha or lower --clients"
    )


def natural_shards(categories: Sequence[object]) -> tuple[list[np.ndarray], list[str]]:
    """One shard per distinct category, in sorted category order; returns (shards, category names)."""
    if len(categories) == 0:
        raise TaskError("cannot partition an empty dataset")
    names = sorted({str(c) for c in categories})
    index = {name: i for i, name in enumerate(names)}
    ids = np.fromiter((index[str(c)] for c in categories), dtype=np.int64, count=len(categories))
    return [np.flatnonzero(ids == i) for i in range(len(names))], names


def _category_ids(categories: Sequence[object]) -> np.ndarray:
    names = sorted({str(c) for c in categories})
    index = {name: i for i, name in enumerate(names)}
    return np.fromiter((index[str(c)] for c in categories), dtype=np.int64, count=len(categories))


def _check_k(n_items: int, k: int) -> None:
    if k < 1:
        raise TaskError(f"clients (--clients) must be at least 1, got {k}")
    if n_items < k:
        raise TaskError(
            f"cannot split {n_items} items into {k} client shards: lower clients (--clients) or use more data"
        )
