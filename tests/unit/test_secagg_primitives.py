"""Secure aggregation's primitives (fedmq/secagg): key agreement and derivation, the encryption of shares, the
mask PRG against AES applied to its counter blocks, and Shamir sharing of 16-byte secrets with its checks."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedmq.errors import SecAggError
from fedmq.secagg import keys, prg, shamir


def test_both_ends_derive_one_key_per_purpose_and_context():
    a, b = keys.generate(), keys.generate()
    pa, pb = keys.public_bytes(a), keys.public_bytes(b)
    k_ab = keys.derive(a, pb, keys.MASK_SEED, "job/round-1", "alice", "bob")
    k_ba = keys.derive(b, pa, keys.MASK_SEED, "job/round-1", "bob", "alice")
    assert k_ab == k_ba and len(k_ab) == 32
    others = {
        keys.derive(a, pb, keys.SHARE_KEY, "job/round-1", "alice", "bob"),  # another purpose
        keys.derive(a, pb, keys.MASK_SEED, "job/round-2", "alice", "bob"),  # another round, same key pairs
        keys.derive(a, pb, keys.MASK_SEED, "job/buffer-1", "alice", "bob"),  # a buffer
        keys.derive(a, pb, keys.MASK_SEED, "job/round-1", "alice", "carol"),  # another pair
    }
    assert k_ab not in others and len(others) == 4


def test_a_low_order_public_key_is_refused_by_name():
    with pytest.raises(SecAggError, match="bad-key: key agreement between alice and mallory"):
        keys.derive(keys.generate(), bytes(32), keys.MASK_SEED, "ctx", "alice", "mallory")


def test_shares_in_transit_are_bound_to_their_pair_and_round():
    key = os.urandom(32)
    box = keys.encrypt(key, "job/round-1", "alice", "bob", b"shares")
    assert keys.decrypt(key, "job/round-1", "alice", "bob", box) == b"shares"
    tampered = box[:-1] + bytes([box[-1] ^ 1])
    for args in [
        ("job/round-1", "alice", "bob", tampered),
        ("job/round-2", "alice", "bob", box),
        ("job/round-1", "alice", "carol", box),
    ]:
        with pytest.raises(SecAggError, match=f"bad-ciphertext: the shares {args[1]} sent to {args[2]}"):
            keys.decrypt(key, *args)


def _prg(seed: bytes, n: int) -> np.ndarray:
    """PRG(seed): the mask ``apply`` adds, read off a vector of zeros."""
    mask = np.zeros(n, np.uint32)
    prg.apply(mask, [(seed, 1)])
    return mask


def test_the_prg_is_aes_ctr_keystream_from_counter_two_read_as_little_endian_uint32():
    seed = bytes(range(32))
    n = prg.CHUNK + 1000  # across a chunk's end: the keystream goes on where the last chunk left it
    mask = _prg(seed, n)
    assert mask.dtype == np.dtype("<u4") and mask.shape == (n,)
    # independent cross-check: AES-256 of the counter blocks 0^96 ‖ 2, 0^96 ‖ 3, ...
    ecb = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()
    blocks = b"".join((i + 2).to_bytes(16, "big") for i in range(n // 4))
    assert np.array_equal(mask, np.frombuffer(ecb.update(blocks), "<u4"))
    assert np.array_equal(_prg(seed, n), mask)  # deterministic
    assert np.array_equal(_prg(seed, 10), mask[:10])  # a prefix of the same stream
    assert not np.array_equal(_prg(bytes(32), n), mask)


def test_applying_a_mask_and_its_negation_cancels_in_the_ring():
    total = np.arange(5000, dtype=np.uint32)
    seed = os.urandom(32)
    prg.apply(total, [(seed, 1)])
    assert not np.array_equal(total, np.arange(5000, dtype=np.uint32))
    prg.apply(total, [(seed, -1)])
    assert np.array_equal(total, np.arange(5000, dtype=np.uint32))


def test_masks_added_together_chunk_by_chunk_are_their_keystreams_summed():
    n = 2 * prg.CHUNK + 5  # two whole chunks and a short one
    masks = [(os.urandom(32), 1), (os.urandom(32), -1), (os.urandom(32), 1)]
    total = np.arange(n, dtype=np.uint32)
    prg.apply(total, masks)
    expected = np.arange(n, dtype=np.uint32)
    for seed, sign in masks:
        expected = expected + _prg(seed, n) if sign > 0 else expected - _prg(seed, n)
    assert expected.dtype == np.uint32 and np.array_equal(total, expected)


def test_the_prg_refuses_a_short_seed_a_bad_sign_or_a_wrong_buffer():
    with pytest.raises(SecAggError, match="bad-seed"):
        prg.apply(np.zeros(10, np.uint32), [(b"short", 1)])
    with pytest.raises(SecAggError, match="bad-parameter"):
        prg.apply(np.zeros(10, np.uint32), [(bytes(32), 2)])
    total = np.arange(10, dtype=np.uint32)
    with pytest.raises(SecAggError, match="bad-seed"):  # checked before anything is added
        prg.apply(total, [(bytes(32), 1), (b"short", 1), (bytes(32), -1)])
    assert np.array_equal(total, np.arange(10, dtype=np.uint32))
    for wrong in (np.zeros(10, np.int64), np.zeros((2, 5), np.uint32), np.zeros(20, np.uint32)[::2]):
        with pytest.raises(SecAggError, match="bad-length"):
            prg.apply(wrong, [(bytes(32), 1)])


def test_the_prg_refuses_a_vector_longer_than_one_key_may_encrypt(monkeypatch: pytest.MonkeyPatch):
    assert prg.MAX_LENGTH == (2**39 - 256) // 32  # GCM's limit on one nonce, in uint32 coordinates
    monkeypatch.setattr(prg, "MAX_LENGTH", 9)
    total = np.arange(10, dtype=np.uint32)
    with pytest.raises(SecAggError, match="bad-length: a mask covers at most 9 coordinates, not 10"):
        prg.apply(total, [(bytes(32), 1)])
    assert np.array_equal(total, np.arange(10, dtype=np.uint32))


def test_any_t_of_n_shares_give_the_16_byte_secret_back():
    secret = os.urandom(16)
    shares = shamir.split(secret, 3, 6)
    assert [s.index for s in shares] == [1, 2, 3, 4, 5, 6] and all(len(s.data) == 16 for s in shares)
    for subset in ([0, 1, 2], [5, 3, 1], [2, 4, 5]):
        assert shamir.combine([shares[i] for i in subset]) == secret
    # fewer than t shares still give 16 bytes, but not the secret; hence recover's check
    assert shamir.combine(shares[:2]) != secret
    # more than t right shares lie on the same polynomial: the same secret
    assert shamir.combine(shares) == secret


@pytest.mark.parametrize("threshold, count", [(1, 1), (2, 3), (11, 34), (34, 34), (40, 300)])
def test_shares_are_pycryptodomes_both_ways(threshold: int, count: int):
    """The scheme is pycryptodome's share for share (shamir's docstring): its shares combine here into its
    secret, and shares from here combine in pycryptodome, from any ``threshold`` of them."""
    from Crypto.Protocol.SecretSharing import Shamir

    rng = np.random.default_rng(threshold * 1000 + count)
    for secret in (os.urandom(16), bytes(16), b"\xff" * 16):
        ours = shamir.split(secret, threshold, count)
        theirs = [shamir.Share(i, data) for i, data in Shamir.split(threshold, count, secret, ssss=False)]
        for _ in range(3):
            pick = sorted(rng.choice(count, size=threshold, replace=False))
            assert Shamir.combine([(ours[i].index, ours[i].data) for i in pick], ssss=False) == secret
            assert shamir.combine([theirs[i] for i in pick]) == secret
    # every share of a degree-(t - 1) polynomial is as pycryptodome computes it: t = 1 gives the secret itself
    assert [s.data for s in shamir.split(b"\x01" * 16, 1, 4)] == [b"\x01" * 16] * 4


def test_combine_refuses_no_shares_or_an_index_twice():
    shares = shamir.split(os.urandom(16), 2, 3)
    for bad in ([], [shares[0], shares[0]]):
        with pytest.raises(SecAggError, match="bad-share: shares do not combine"):
            shamir.combine(bad)


def test_recover_checks_the_secret_and_names_a_wrong_share():
    secret = os.urandom(16)
    held = dict(zip("abcdef", shamir.split(secret, 3, 6)))
    held["a"] = shamir.Share(held["a"].index, bytes(16))

    def check(candidate: bytes) -> bool:
        return candidate == secret

    got, bad = shamir.recover(held, 3, check, "alice's seed")
    assert got == secret and bad == ["a"]
    with pytest.raises(SecAggError, match=r"too-few-shares: alice's seed needs 3 shares, 2 came \(b, c\)"):
        shamir.recover({h: held[h] for h in "bc"}, 3, check, "alice's seed")
    with pytest.raises(
        SecAggError, match="bad-share: no 3 of the shares from a, b, c reconstruct alice's seed"
    ):
        shamir.recover({h: held[h] for h in "abc"}, 3, check, "alice's seed")


def test_a_shared_secret_expands_to_its_own_key_for_each_purpose_round_and_owner():
    """What Shamir shares is 16 bytes; the X25519 mask key and the self mask's PRG key are expanded from it,
    so the server that rebuilds it derives the key the owner advertised, and nothing else derives that key."""
    secret = os.urandom(shamir.SECRET_BYTES)
    key = keys.mask_key(secret, "job/round-1", "alice")
    assert key.private_bytes_raw() == keys.expand(secret, keys.MASK_KEY, "job/round-1", "alice")
    assert keys.public_bytes(keys.mask_key(secret, "job/round-1", "alice")) == keys.public_bytes(key)
    expanded = {
        keys.expand(secret, purpose, context, owner)
        for purpose in (keys.MASK_KEY, keys.SELF_MASK)
        for context in ("job/round-1", "job/round-2")
        for owner in ("alice", "bob")
    }
    assert len(expanded) == 8 and {len(x) for x in expanded} == {keys.KEY_BYTES}


def test_shamir_refuses_bad_parameters():
    with pytest.raises(SecAggError, match="bad-secret"):
        shamir.split(b"x" * 32, 2, 3)
    with pytest.raises(SecAggError, match="bad-parameter"):
        shamir.split(b"x" * 16, 4, 3)
    with pytest.raises(SecAggError, match="bad-share"):
        shamir.Share(0, bytes(16))
