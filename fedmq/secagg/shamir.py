"""t-of-n Shamir secret sharing of 16-byte secrets (what self-mask seeds b_u and mask private keys s_u^SK are
expanded from: masking.py).

Bonawitz et al. 2017, Fig. 4, Round 1 (ShareKeys) shares b_u and s_u^SK t-out-of-n; Bell et al. 2020 (CCS,
"Secure single-server aggregation with (poly)logarithmic overhead") share them among a client's k neighbours
only. The field arithmetic is pycryptodome's (`Crypto.Protocol.SecretSharing.Shamir`, a maintained library):
it shares one 16-byte secret over GF(2^128), in pure Python, so each secret is one 16-byte block: 128 bits,
the security level of X25519 itself, at half the cost of sharing and rebuilding 32 bytes as two blocks.

A wrong share makes Shamir reconstruct a wrong secret without noticing, so every reconstruction here is
checked against what the owner committed to (``check``): with more shares than needed, the server looks for a
subset that passes and names the holders whose shares disagree with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from Crypto.Protocol.SecretSharing import Shamir

from fedmq.errors import SecAggError

SECRET_BYTES = 16  # one GF(2^128) element: what pycryptodome shares
MAX_SUBSETS = 64  # subsets of the shares tried before a reconstruction that fails its check is given up

Points = list[tuple[int, bytes]]  # (index, data) of the shares to combine: what a worker process is sent


@dataclass(frozen=True)
class Share:
    index: int  # the x-coordinate, 1..n
    data: bytes  # SECRET_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.index < 2**16 or len(self.data) != SECRET_BYTES:
            raise SecAggError("bad-share", f"a share is an index in 1..65535 and {SECRET_BYTES} bytes")


def split(secret: bytes, threshold: int, count: int) -> list[Share]:
    """SS.share: ``count`` shares (indices 1..count) of which any ``threshold`` give the secret back."""
    if len(secret) != SECRET_BYTES:
        raise SecAggError("bad-secret", f"a shared secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= count:
        raise SecAggError("bad-parameter", f"threshold {threshold} is not within 1..{count} shares")
    return [Share(i, data) for i, data in Shamir.split(threshold, count, secret, ssss=False)]


def combine(shares: list[Share]) -> bytes:
    """SS.recon from exactly ``threshold`` shares (pycryptodome wants no more than needed)."""
    try:
        return Shamir.combine([(s.index, s.data) for s in shares], ssss=False)
    except ValueError as exc:
        raise SecAggError("bad-share", f"shares do not combine: {exc}") from None


def combine_points(points: Points) -> bytes | None:
    """``combine`` of (index, data) pairs, None where they do not combine (a task a worker process runs)."""
    try:
        return combine([Share(index, data) for index, data in points])
    except SecAggError:
        return None


def recover(
    shares: Mapping[str, Share], threshold: int, check: Callable[[bytes], bool], what: str
) -> tuple[bytes, list[str]]:
    """The secret ``what`` from its holders' shares, checked; also the holders whose shares disagree with it.

    Fewer than ``threshold`` shares, or no subset (of the first MAX_SUBSETS tried) that reconstructs a secret
    passing ``check``, is a SecAggError: nothing is returned that was not checked."""
    holders = sorted(shares)
    if len(holders) < threshold:
        raise SecAggError(
            "too-few-shares", f"{what} needs {threshold} shares, {len(holders)} came ({', '.join(holders)})"
        )
    for subset in itertools.islice(itertools.combinations(holders, threshold), MAX_SUBSETS):
        secret = combine([shares[h] for h in subset])
        if check(secret):
            break
    else:
        raise SecAggError(
            "bad-share", f"no {threshold} of the shares from {', '.join(holders)} reconstruct {what}"
        )
    if subset == tuple(holders[:threshold]):
        return secret, []  # the first subset passed: the others were not needed and are not judged
    base = [shares[h] for h in subset[: threshold - 1]]
    bad = [h for h in holders if h not in subset and not check(combine([*base, shares[h]]))]
    return secret, sorted(set(bad))


Request = tuple[Mapping[str, Share], Callable[[bytes], bool], str]  # recover()'s shares, check and what


def combine_each(batch: list[Points]) -> list[bytes | None]:
    """``combine_points`` of each item, in this process."""
    return [combine_points(points) for points in batch]


def recover_all(
    requests: Sequence[Request],
    threshold: int,
    combine_batch: Callable[[list[Points]], list[bytes | None]] = combine_each,
) -> list[tuple[bytes, list[str]]]:
    """``recover`` of each request, in order, with the same results and the same first error.

    The first subset of every request (its first ``threshold`` holders) is combined in one batch by
    ``combine_batch``: pycryptodome's arithmetic is pure Python and holds the GIL, so the aggregator hands the
    batch to worker processes (aggregator.secret_pool). A request whose first subset fails its check, or that
    has too few shares, goes through ``recover`` itself, which names the wrong shares or refuses."""
    ready = [i for i, (shares, _, _) in enumerate(requests) if len(shares) >= threshold]
    firsts = [
        [(requests[i][0][h].index, requests[i][0][h].data) for h in sorted(requests[i][0])[:threshold]]
        for i in ready
    ]
    combined = dict(zip(ready, combine_batch(firsts)))
    out = []
    for i, (shares, check, what) in enumerate(requests):
        secret = combined.get(i)
        out.append(
            (secret, []) if secret is not None and check(secret) else recover(shares, threshold, check, what)
        )
    return out
