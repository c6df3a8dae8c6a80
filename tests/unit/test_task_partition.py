"""Client partitions: IID shards cover the data exactly once; Dirichlet is reproducible;
natural follows categories."""

from __future__ import annotations

import numpy as np
import pytest

from fedmq.tasks.errors import TaskError
from fedmq.tasks.partition import PartitionSpec, dirichlet_shards, iid_shards, natural_shards


def _covers_once(shards, n):
    joined = np.concatenate(shards)
    assert sorted(joined.tolist()) == list(range(n))


@pytest.mark.parametrize("n,k", [(100, 100), (1000, 7), (37, 5), (5, 1)])
def test_iid_shards_cover_exactly_once_and_are_equal(n, k):
    shards = iid_shards(n, k, seed=3)
    assert len(shards) == k
    _covers_once(shards, n)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_iid_shards_are_seeded():
    a, b, c = iid_shards(500, 10, 1), iid_shards(500, 10, 1), iid_shards(500, 10, 2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    # a shard is a shuffled sample, not a contiguous block of the corpus
    assert a[0].max() - a[0].min() > 100


def test_dirichlet_reproducible_covering_and_skewed():
    cats = [f"doc{i // 50}" for i in range(2000)]  # 40 documents of 50 items
    a = dirichlet_shards(cats, 8, alpha=0.1, seed=5)
    b = dirichlet_shards(cats, 8, alpha=0.1, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    _covers_once(a, 2000)
    assert min(len(s) for s in a) >= 1
    # small alpha: most of each document lands on one client
    owner = np.empty(2000, dtype=int)
    for client, s in enumerate(a):
        owner[s] = client
    top_share = [np.bincount(owner[d * 50 : (d + 1) * 50], minlength=8).max() / 50 for d in range(40)]
    assert np.mean(top_share) > 0.6
    # large alpha: close to an even split of every document
    big = dirichlet_shards(cats, 8, alpha=1000.0, seed=5)
    sizes = [len(s) for s in big]
    assert max(sizes) - min(sizes) < 0.2 * 250


def test_dirichlet_impossible_raises():
    with pytest.raises(TaskError, match="raise alpha"):
        dirichlet_shards(["a"] * 10, 10, alpha=1e-4, seed=0, max_tries=5)


def test_natural_one_shard_per_category():
    cats = ["movie-b", "movie-a", "movie-b", "movie-c", "movie-a"]
    shards, names = natural_shards(cats)
    assert names == ["movie-a", "movie-b", "movie-c"]
    assert [s.tolist() for s in shards] == [[1, 4], [0, 2], [3]]


@pytest.mark.parametrize(
    "text,kind,alpha",
    [
        ("iid", "iid", 0.0),
        ("natural", "natural", 0.0),
        ("dirichlet:0.3", "dirichlet", 0.3),
        ("dirichlet", "dirichlet", 0.5),
    ],
)
def test_parse(text, kind, alpha):
    spec = PartitionSpec.parse(text)
    assert (spec.kind, spec.alpha) == (kind, alpha)


@pytest.mark.parametrize("text", ["random", "dirichlet:x", "dirichlet:0", "dirichlet:-2", "dirichlet:nan"])
def test_parse_errors(text):
    with pytest.raises(TaskError):
        PartitionSpec.parse(text)


def test_more_clients_than_items():
    with pytest.raises(TaskError, match=r"lower clients \(--clients\)"):
        iid_shards(3, 4, 0)
    with pytest.raises(TaskError, match="at least 1"):
        iid_shards(3, 0, 0)
