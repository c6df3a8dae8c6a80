"""Key agreement, key derivation and the encryption of shares in transit (the `cryptography` package).

Bonawitz et al. 2017 (CCS, "Practical secure aggregation for privacy-preserving machine learning"), Fig. 4,
build the protocol on a key agreement KA (gen, agree) and an authenticated encryption AE, and give every
client two key pairs per run: (c_u^PK, c_u^SK) for the channel that carries its shares to its neighbours
through the server, and (s_u^PK, s_u^SK) for its pairwise masks. Only s_u^SK is ever secret-shared and
reconstructed (for a client that dropped), so the server that learns it still cannot read c-encrypted shares.

Here KA is X25519 and its shared secret goes through HKDF-SHA256 (RFC 5869) with a label saying what the key
is for and the round or buffer it belongs to (``context``), so that the two uses never share a key and no key
is reused across rounds even if a client kept its key pairs. AE is AES-256-GCM with the context and the
(sender, recipient) pair as associated data: a share moved to another pair, round or buffer fails to decrypt.

What a client secret-shares is 16 random bytes in place of each of s_u^SK and b_u (``expand``: HKDF-SHA256 to
the X25519 private key, ``mask_key``, and to the key of the self mask's PRG): Shamir shares one 16-byte
GF(2^128) element at a time (shamir.py), and 128 bits are X25519's own security level, so sharing the 32-byte
keys themselves would double that cost for no security.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedmq.errors import SecAggError

KEY_BYTES = 32  # X25519 keys, derived keys and PRG seeds
NONCE_BYTES = 12  # AES-GCM's nonce
MASK_SEED = "pairwise-mask-seed"
MASK_KEY = "mask-private-key"
SELF_MASK = "self-mask-seed"
SHARE_KEY = "share-encryption-key"


@dataclass(frozen=True)
class PublicKeys:
    """What a client advertises (Bonawitz et al. 2017, Fig. 4, Round 0 AdvertiseKeys): c_u^PK and s_u^PK."""

    channel: bytes  # c_u^PK, 32 bytes
    mask: bytes  # s_u^PK, 32 bytes


def generate() -> X25519PrivateKey:
    """KA.gen: a fresh X25519 private key from the operating system's secure random source."""
    return X25519PrivateKey.generate()


def public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes_raw()


def expand(secret: bytes, purpose: str, context: str, owner: str) -> bytes:
    """HKDF-SHA256 of a client's shared secret (16 random bytes: shamir.SECRET_BYTES) to the 32 bytes of
    ``purpose`` in ``context``: the server that rebuilds the secret derives the same bytes."""
    info = _info(purpose, context, owner, "")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def mask_key(secret: bytes, context: str, owner: str) -> X25519PrivateKey:
    """s_u^SK, expanded from the secret that Shamir shares in its place (Round 1 ShareKeys shares s_u^SK):
    any 32 bytes are an X25519 private key, and 128 random bits are X25519's own security level."""
    return X25519PrivateKey.from_private_bytes(expand(secret, MASK_KEY, context, owner))


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _info(purpose: str, context: str, a: str, b: str) -> bytes:
    """HKDF's info: purpose, context and the pair, each length-prefixed so that no two inputs collide."""
    return b"fedmq-secagg-v1" + b"".join(_field(s.encode()) for s in (purpose, context, a, b))


def check_public(raw: bytes, owner: str) -> None:
    """SecAggError("bad-key") unless ``raw`` is an X25519 public key a neighbour can agree a key with (one of
    small order would make every neighbour's agreement fail, and so knock them all out of the round)."""
    try:
        generate().exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError as exc:
        raise SecAggError("bad-key", f"{owner}'s public key cannot be agreed with: {exc}") from None


def derive(
    private: X25519PrivateKey, peer_public: bytes, purpose: str, context: str, a: str, b: str
) -> bytes:
    """KA.agree then HKDF-SHA256: a 32-byte key for ``purpose`` in ``context`` between clients a and b.

    The pair is put in order, so both ends derive the same key. X25519 with a peer key of small order gives
    an all-zero secret, which `cryptography` refuses: that peer is named."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError("bad-key", f"a public key of the pair {a}, {b} is not {KEY_BYTES} bytes")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise SecAggError("bad-key", f"key agreement between {a} and {b} failed: {exc}") from None
    low, high = sorted((a, b))
    hkdf = HKDF(
        algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_info(purpose, context, low, high)
    )
    return hkdf.derive(shared)


def _aad(context: str, sender: str, recipient: str) -> bytes:
    return b"".join(_field(s.encode()) for s in (context, sender, recipient))


def encrypt(key: bytes, context: str, sender: str, recipient: str, plaintext: bytes) -> bytes:
    """AE.enc (Round 1 ShareKeys): nonce ‖ AES-256-GCM ciphertext, bound to (context, sender, recipient)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(context, sender, recipient))


def decrypt(key: bytes, context: str, sender: str, recipient: str, ciphertext: bytes) -> bytes:
    """AE.dec (Round 4 Unmasking, here on receipt): a ciphertext altered on the way or addressed elsewhere is
    refused, naming its sender."""
    try:
        return AESGCM(key).decrypt(
            ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], _aad(context, sender, recipient)
        )
    except (InvalidTag, ValueError):
        raise SecAggError(
            "bad-ciphertext", f"the shares {sender} sent to {recipient} fail authentication"
        ) from None
