"""t-of-n Shamir secret sharing of 16-byte secrets (what self-mask seeds b_u and mask private keys s_u^SK are
expanded from: masking.py).

Bonawitz et al. 2017, Fig. 4, Round 1 (ShareKeys) shares b_u and s_u^SK t-out-of-n; Bell et al. 2020 (CCS,
"Secure single-server aggregation with (poly)logarithmic overhead") share them among a client's k neighbours
only. Each secret is one element of GF(2^128): 128 bits, the security level of X25519 itself.

The scheme is pycryptodome's (`Crypto.Protocol.SecretSharing.Shamir`, ``ssss=False``), share for share: the
same field (GF(2)[x] modulo x^128 + x^7 + x^2 + x + 1, an element's bits its coefficients, the least
significant bit the constant one, 16 bytes big-endian), the secret as the constant term of a polynomial of
degree t - 1 whose other coefficients are 16 bytes each from the operating system's secure random source,
share i its value at the element i (1..n), and reconstruction by Lagrange interpolation at 0. Its shares and
pycryptodome's combine into each other's secrets (tests/unit/test_secagg_primitives.py checks both ways).
The field arithmetic is FLINT's (python-flint: ``fq_default`` over that modulus, compiled C), where
pycryptodome's is pure Python: on a 2-core x86 VM, splitting a secret into 34 shares at t = 11 takes 0.75 ms
here against about 4 ms, and rebuilding it from 11 shares 0.3 ms against 5 ms, so at 100 clients a round the
sharing and the rebuilding cost about 0.2 CPU seconds instead of one. Unlike pycryptodome's multiplication,
FLINT's is not written to take the same time whatever its operands, nor is the conversion of a value to an
element here (a loop over its bits up to the highest one set).

A wrong share makes Shamir reconstruct a wrong secret without noticing, so every reconstruction here is
checked against what the owner committed to (``check``): with more shares than needed, the server looks for a
subset that passes and names the holders whose shares disagree with it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import flint

from fedmq.errors import SecAggError

SECRET_BYTES = 16  # one GF(2^128) element
MAX_SUBSETS = 64  # subsets of the shares tried before a reconstruction that fails its check is given up

Points = list[tuple[int, bytes]]  # (index, data) of the shares to combine: what a worker process is sent

# GF(2^128) as pycryptodome defines it: the coefficients of x^0..x^128 of its modulus
_FIELD = flint.fq_default_ctx(2, modulus=flint.fmpz_poly([1, 1, 1, 0, 0, 0, 0, 1] + [0] * 120 + [1]))
_POLYNOMIALS = flint.fq_default_poly_ctx(_FIELD)


def _element(value: int) -> flint.fq_default:
    """The field element whose polynomial's coefficients are ``value``'s bits (< 2^128)."""
    return flint.fq_default([(value >> i) & 1 for i in range(value.bit_length())], _FIELD)


def _decode(data: bytes) -> flint.fq_default:
    return _element(int.from_bytes(data, "big"))


def _encode(element: flint.fq_default) -> bytes:
    bits = "".join("1" if bit else "0" for bit in reversed(element.to_list()))  # x^127 first
    return int(bits, 2).to_bytes(SECRET_BYTES, "big")


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
    if not 1 <= threshold <= count < 2**16:
        raise SecAggError(
            "bad-parameter", f"threshold {threshold} of {count} shares: 1 ≤ t ≤ n ≤ 65535 needed"
        )
    # p(x) = secret + a_1 x + ... + a_{t-1} x^{t-1}, each a_i uniform over the field
    coefficients = [_decode(secret), *(_decode(os.urandom(SECRET_BYTES)) for _ in range(threshold - 1))]
    p = flint.fq_default_poly(coefficients, _POLYNOMIALS)
    return [Share(i, _encode(p(_element(i)))) for i in range(1, count + 1)]


def combine(shares: list[Share]) -> bytes:
    """SS.recon: p(0) from ``threshold`` shares (more give the same secret while every one is right)."""
    if not shares or len({s.index for s in shares}) != len(shares):
        raise SecAggError("bad-share", "shares do not combine: none, or one index twice")
    xs = [_element(s.index) for s in shares]
    secret = _FIELD.zero()
    for j, share in enumerate(shares):  # Lagrange at 0: y_j Π_{m≠j} x_m / (x_j - x_m), and - is + here
        numerator, denominator = _FIELD.one(), _FIELD.one()
        for m, x in enumerate(xs):
            if m != j:
                numerator *= x
                denominator *= xs[j] + x
        secret += _decode(share.data) * numerator / denominator
    return _encode(secret)


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
    ``combine_batch``: the interpolation is a Python loop over field operations and holds the GIL, so the
    aggregator hands the batch to worker processes (aggregator.secret_pool). A request whose first subset
    fails its check, or that has too few shares, goes through ``recover`` itself, which names the wrong
    shares or refuses."""
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
