"""The PRG that expands a 32-byte seed into a mask: AES-256 in counter mode (the `cryptography` package).

Bonawitz et al. 2017, Fig. 4 (Round 2 MaskedInputCollection): a client's masks are PRG(b_u) and PRG(s_{u,v}),
vectors of uniform elements of the input's ring; their implementation instantiates the PRG with AES in counter
mode. Here the seed is the AES-256 key (a fresh key for one round's mask), the counter blocks are
0^96 ‖ i for i = 2, 3, ... (a 32-bit counter, NIST SP 800-38D's inc32), and the keystream, read as
little-endian uint32, is the vector: uniform in Z_{2^32}, the same on every machine.

That keystream is exactly what AES-256-GCM with the all-zero 96-bit nonce encrypts a run of zeros with, and
this is how it is computed: OpenSSL's GCM path uses the CPU's vector AES instructions (VAES, AVX-512) where it
has them, which its CTR path does not, and expands a mask about 1.3 times faster on the x86 VM of
docs/benchmarks.md (the authentication tag is computed and thrown away). The tests check the keystream against
AES-256 of the counter blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedmq.errors import SecAggError
from fedmq.secagg.keys import KEY_BYTES

DTYPE = np.dtype("<u4")  # the ring Z_{2^32}: uint32 arithmetic wraps around
_NONCE = bytes(12)  # GCM's nonce: its first counter block is 0^96 ‖ 2 (module docstring)
# GCM encrypts at most 2^39 - 256 bits under one nonce: the longest vector one seed can mask
MAX_LENGTH = ((1 << 39) - 256) // 8 // 4
CHUNK = 1 << 16  # coordinates of every mask one pass of ``apply`` expands: 256 KiB, held in the CPU's cache


def apply(total: np.ndarray, masks: Iterable[tuple[bytes, int]]) -> None:
    """total ← total + Σ sign · PRG(seed) in Z_{2^32}, in place, over ``masks`` (seed, sign ±1). Every mask is
    expanded over one chunk of ``total`` before the next chunk, so the keystream and that chunk of the sum
    stay in the CPU's cache: for 35 masks of 10.6 M coordinates this takes about 0.2 s against 0.65 s for
    whole masks one after another (on the 2-core x86 VM of docs/benchmarks.md)."""
    if total.dtype != DTYPE or total.ndim != 1 or not total.flags.c_contiguous:
        raise SecAggError("bad-length", f"masks are added to a contiguous uint32 vector, not {total.dtype}")
    if total.shape[0] > MAX_LENGTH:
        raise SecAggError(
            "bad-length", f"a mask covers at most {MAX_LENGTH} coordinates, not {total.shape[0]}"
        )
    streams = []
    for seed, sign in masks:
        if len(seed) != KEY_BYTES:
            raise SecAggError("bad-seed", f"a PRG seed is {KEY_BYTES} bytes, got {len(seed)}")
        if sign not in (1, -1):
            raise SecAggError("bad-parameter", f"a mask's sign is 1 or -1, not {sign}")
        streams.append((Cipher(algorithms.AES(seed), modes.GCM(_NONCE)).encryptor(), sign))
    zeros = memoryview(bytes(CHUNK * DTYPE.itemsize))
    scratch = np.empty(CHUNK + 4, DTYPE)  # a cipher may ask for up to one block more room than its input
    out = scratch.data.cast("B")
    for start in range(0, total.shape[0], CHUNK):
        part = total[start : start + CHUNK]
        keystream, data = scratch[: part.shape[0]], zeros[: part.nbytes]
        for encryptor, sign in streams:
            encryptor.update_into(data, out)
            if sign > 0:
                np.add(part, keystream, out=part)
            else:
                np.subtract(part, keystream, out=part)
