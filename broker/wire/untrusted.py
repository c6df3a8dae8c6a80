"""How the wire format has msgpack decode bytes from the network: str keys and text only, lists, no
extension types, and every length bounded by the caller (what the message can hold), so that a hostile
message can make msgpack allocate no more than the bytes it arrived in."""

from __future__ import annotations

from typing import Any


def msgpack_options(*, bins: int, strs: int, arrays: int, maps: int) -> dict[str, Any]:
    """msgpack.unpackb's and msgpack.Unpacker's keyword arguments for untrusted bytes: at most ``bins``
    bytes in a bin, ``strs`` in a str, ``arrays`` items in an array and ``maps`` pairs in a map."""
    return {
        "raw": False,
        "use_list": True,
        "strict_map_key": True,
        "max_bin_len": bins,
        "max_str_len": strs,
        "max_array_len": arrays,
        "max_map_len": maps,
        "max_ext_len": 0,
    }
