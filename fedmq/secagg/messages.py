"""The typed messages of one secure aggregation (what a protocol layer carries; encoding them is its job).

Rounds as in Bonawitz et al. 2017, Fig. 4 (Round 3, ConsistencyCheck, is for an actively malicious server and
is not part of this semi-honest core): 0 AdvertiseKeys (``keys.PublicKeys``), 1 ShareKeys (``SharedKeys``),
2 MaskedInputCollection (a uint32 vector), 4 Unmasking (``UnmaskRequest``, ``UnmaskShares``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedmq.errors import SecAggError
from fedmq.secagg.shamir import SECRET_BYTES, Share

COMMITMENT_BYTES = 32
_INDEX_BYTES = 2


@dataclass(frozen=True)
class SharedKeys:
    """Round 1, client → server: for each neighbour, AE.enc(key share ‖ seed share), and a commitment to the
    self-mask seed b_u (SHA-256) so that a reconstructed seed can be checked."""

    ciphertexts: Mapping[str, bytes]  # neighbour → ciphertext for it
    seed_commitment: bytes


@dataclass(frozen=True)
class UnmaskRequest:
    """Round 4, server → survivors: whose self-mask seeds (``survivors``) and whose mask keys (``dropped``)
    it needs. The two are disjoint: a client answers only a request that never asks for both of one client."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskShares:
    """Round 4, survivor → server: its shares of survivors' seeds and of dropped clients' mask keys."""

    seeds: Mapping[str, Share]
    keys: Mapping[str, Share]


def pack_shares(key_share: Share, seed_share: Share) -> bytes:
    """The plaintext a client encrypts for one neighbour: index ‖ share of s_u^SK ‖ share of b_u."""
    return key_share.index.to_bytes(_INDEX_BYTES, "big") + key_share.data + seed_share.data


def unpack_shares(plaintext: bytes, sender: str) -> tuple[Share, Share]:
    if len(plaintext) != _INDEX_BYTES + 2 * SECRET_BYTES:
        raise SecAggError("bad-share", f"the shares {sender} sent are {len(plaintext)} bytes")
    index = int.from_bytes(plaintext[:_INDEX_BYTES], "big")
    body = plaintext[_INDEX_BYTES:]
    return Share(index, body[:SECRET_BYTES]), Share(index, body[SECRET_BYTES:])
