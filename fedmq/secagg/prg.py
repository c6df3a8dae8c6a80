"""The PRG that expands a 32-byte seed into a mask: AES-256 in counter mode (the `cryptography` package).

Bonawitz et al. 2017, Fig. 4 (Round 2 MaskedInputCollection): a client's masks are PRG(b_u) and PRG(s_{u,v}),
vectors of uniform elements of the input's ring; their implementation instantiates the PRG with AES in counter
mode. Here the seed is the AES-256 key, the counter starts at zero (each seed is a fresh key, used for one
vector), and the keystream, read as little-endian uint32, is the vector: uniform in Z_{2^32}, the same on
every machine. OpenSSL's AES-NI path makes 10.6 M coordinates a matter of milliseconds.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedmq.errors import SecAggError
from fedmq.secagg.keys import KEY_BYTES

DTYPE = np.dtype("<u4")  # the ring Z_{2^32}: uint32 arithmetic wraps around
_COUNTER0 = bytes(16)


def expand(seed: bytes, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """PRG(seed): n uniform elements of Z_{2^32}, written into ``out`` when one is given (a uint32 vector)."""
    if len(seed) != KEY_BYTES:
        raise SecAggError("bad-seed", f"a PRG seed is {KEY_BYTES} bytes, got {len(seed)}")
    if out is None:
        out = np.empty(n, DTYPE)
    elif out.dtype != DTYPE or out.shape != (n,) or not out.flags.c_contiguous:
        raise SecAggError("bad-length", f"the PRG writes {n} contiguous uint32, not {out.dtype} {out.shape}")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_COUNTER0)).encryptor()
    # keystream = AES-CTR applied to zeros; np.zeros maps zero pages lazily, so the input costs little
    encryptor.update_into(np.zeros(n, DTYPE).data.cast("B"), out.data.cast("B"))
    return out


def apply(total: np.ndarray, seed: bytes, sign: int, scratch: np.ndarray | None = None) -> None:
    """total ← total + sign · PRG(seed) in Z_{2^32}, in place (sign ±1); ``scratch`` saves an allocation."""
    mask = expand(seed, total.shape[0], scratch)
    if sign > 0:
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)
