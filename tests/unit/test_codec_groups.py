"""Byte-group layouts of shuffled arrays: what the encoder writes, every valid layout decodes,
lies rejected."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fedmq.broker.wire.blobs import STORED, ZSTD, make_blob
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
from fedmq.errors import CodecError
from fedmq.manifest import Manifest

W = np.random.default_rng(5).standard_normal((200, 50), dtype=np.float32) * np.float32(0.05)
STATE = {"w": W}
MAN = Manifest.from_arrays(STATE)
N = W.size


def _layout(widths: list[int], level: int = 1) -> dict:
    """A raw record of W whose blobs are the byte groups ``widths`` (low bytes first)."""
    u8 = W.reshape(-1).view(np.uint8).reshape(N, 4)
    blobs, off = [], 0
    for g in widths:
        blobs.append(make_blob(np.ascontiguousarray(u8[:, off : off + g]).reshape(-1), level, owned=True))
        off += g
    return {
        "fmt": 1,
        "enc": "raw",
        "t": [{"n": "w", "s": [200, 50], "dt": "float32", "e": "raw", "x": False, "p": blobs}],
    }


def test_encoder_groups_the_two_random_low_bytes() -> None:
    obj = encode_state(STATE, EncodingSpec())
    assert obj["fmt"] == 2  # an older reader refuses it as an unknown version, not as a malformed tensor
    rec = obj["t"][0]
    assert [b[1] for b in rec["p"]] == [2 * N, N, N]
    assert [b[0] for b in rec["p"]] == [STORED, STORED, ZSTD]  # only the sign/exponent plane compresses
    halves = encode_state({"h": W.astype(np.float16)}, EncodingSpec(kind="fp16"))["t"][0]["p"]
    assert [b[1] for b in halves] == [N, N]  # 2-byte items: plain byte-shuffle


@pytest.mark.parametrize("widths", [[1, 1, 1, 1], [2, 1, 1], [1, 3], [3, 1], [2, 2], [4]])
def test_every_byte_group_layout_decodes_bit_exact(widths: list[int]) -> None:
    """[1, 1, 1, 1] is the format-1 layout of the previous revision; _layout writes fmt 1."""
    obj = msgpack.unpackb(msgpack.packb(_layout(widths)))
    out = decode_state(obj, MAN)
    assert out["w"].tobytes() == W.tobytes()


@pytest.mark.parametrize(
    "sizes", [[N, N, N], [2 * N, N, N, N], [N + 1, N - 1, N, N], [0, 2 * N, N, N], [4 * N, 0]]
)
def test_group_sizes_that_do_not_split_the_items_are_rejected(sizes: list[int]) -> None:
    obj = _layout([1, 1, 1, 1], level=0)
    obj["t"][0]["p"] = [[STORED, sz, bytes(sz)] for sz in sizes]
    with pytest.raises(CodecError) as e:
        decode_state(obj, MAN)
    assert e.value.reason == "bad-tensor"
