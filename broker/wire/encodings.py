"""Tensor encodings of the wire format: raw, fp16, bf16, int8/6/5/4 (affine), top-k sparse,
optionally as deltas.

``encode_state`` turns a name -> tensor mapping into a msgpack-able dict::

    {"fmt": 2, "enc": "delta+int8-row", "t": [record, ...]}

with one record per tensor, ``{"n": name, "s": shape, "dt": source dtype, "e": kind, "x": delta, ...}`` plus
the kind's fields (byte blobs, see broker.wire.blobs). Choices where the spec is silent:

* Everything decodes to float32. ``dt`` records the sender's dtype and must equal the manifest's.
* ``raw`` is bit-exact, also as a delta: the raw delta is the XOR of the float32 bit patterns (an arithmetic
  difference would not round-trip exactly); close weights share their high bits, so the XOR compresses.
* Lossy deltas are arithmetic: the sender encodes θ - base, the receiver adds the decoded Δ to its base.
* ``int8``: q = round((x - lo) / scale) in 0..255 with scale = (hi - lo) / 255 per tensor or per row (first
  dimension); |x - x̂| <= scale / 2 (+ float rounding). Scale and zero point travel as float32.
* ``int4``: the same with 16 levels (scale = (hi - lo) / 15), two values a byte (low nibble first); for a
  downlink that must be small for clients that hold no recent version (docs/benchmarks.md "Round cost").
* ``int6`` / ``int5``: 64 / 32 levels, one value a byte, left to zstd to pack: a model's quantized values fill
  their levels almost evenly, so zstd's entropy stage stores them in about 6 / 5 bits (measured on the trained
  GRU-small: 0.748 / 0.623 bytes per value; at zstd level 0 they take a whole byte).
  The decoder refuses a value above the top level.
* ``topk``: keeps k = ceil(density · numel) largest-|x| entries; indices ascending, delta-coded as uint32
  (first absolute), byte-shuffled and zstd'ed; values fp16 (2^-11 relative error) unless one exceeds the
  fp16 range, then fp32. Dropped entries decode as 0 (or as the base value for a delta).
* int8 and topk refuse NaN/Inf on encode (they cannot represent them); raw/fp16/bf16 carry them and the
  decoder rejects them unless ``reject_nonfinite=False``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmq.broker.wire.blobs import (
    Unpacking,
    bf16_to_f32,
    dequantize_affine,
    f32_to_bf16,
    make_blob,
    pack_array,
    quantize_affine,
    read_blob,
    unpack_array,
)
from fedmq.broker.wire.threads import Task, run_all
from fedmq.errors import CodecError
from fedmq.manifest import Manifest

FORMAT = 2  # 2: shuffled arrays may use byte groups (broker.wire.blobs); 1 had one plane per byte
READS_FORMATS = (1, 2)  # a format-1 message is a format-2 message with no multi-byte group
KINDS = ("raw", "fp16", "bf16", "int8", "int6", "int5", "int4", "topk")
_LEVELS = {"int8": 255, "int6": 63, "int5": 31, "int4": 15}  # the affine kinds: top quantization level
DEFAULT_MAX_BYTES = 4 << 30  # decoded float32 bytes of one state
_FP16_MAX = 65504.0
# measured: faster than level 3 and as small or smaller for every encoding (docs/benchmarks.md)
DEFAULT_LEVEL = 1
_SPEC_RE = re.compile(
    r"^(?:(delta)\+)?(raw|fp16|bf16|int[8654](?:-row)?|topk)(?::([^@]+))?(?:@(-?\d+))?(?:,(noshuffle))?$"
)
_KIND_LIST = "raw, fp16, bf16, int8, int6, int5, int4 (each also -row), topk"


@dataclass(frozen=True)
class EncodingSpec:
    kind: str = "raw"  # raw | fp16 | bf16 | int8 | int6 | int5 | int4 | topk
    delta: bool = False  # encode θ - base instead of θ (needs base on both sides)
    per_row: bool = False  # intN: one scale per row instead of per tensor
    density: float = 0.01  # topk: fraction of entries kept
    level: int = DEFAULT_LEVEL  # zstd level (0 = no compression; 1 = byte-plane tuned, see broker.wire.blobs)
    shuffle: bool = True  # byte-shuffle float data before zstd where it helps

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CodecError(
                "bad-encoding", f"unknown encoding kind {self.kind!r}; use one of {', '.join(KINDS)}"
            )
        if not (isinstance(self.density, (int, float)) and 0.0 < self.density <= 1.0):
            raise CodecError("bad-encoding", f"topk density must be in (0, 1], got {self.density!r}")
        if type(self.level) is not int or not -7 <= self.level <= 22:
            raise CodecError("bad-encoding", f"zstd level must be an int in -7..22, got {self.level!r}")
        if self.per_row and self.kind not in _LEVELS:
            raise CodecError("bad-encoding", "per_row applies to int8, int6, int5 and int4 only")

    @classmethod
    def parse(cls, text: str) -> EncodingSpec:
        """Parse the CLI syntax ``[delta+]KIND[:DENSITY][@LEVEL][,noshuffle]``.

        KIND is raw, fp16, bf16, int8, int6, int5, int4 (each also -row, one scale per row) or topk; e.g.
        "bf16", "int8-row", "topk:0.01", "delta+int8", "delta+topk:0.05", "raw@3" (zstd level 3), "raw@0" (no
        compression); the default level is 1.
        """
        m = _SPEC_RE.match(text.strip().lower()) if isinstance(text, str) else None
        if not m:
            raise CodecError(
                "bad-encoding",
                f"cannot parse encoding {text!r}; use [delta+]KIND[:DENSITY][@LEVEL][,noshuffle] "
                f"with KIND one of {_KIND_LIST} (e.g. bf16, int8-row, topk:0.01, delta+int8)",
            )
        delta, kind, arg, level, noshuffle = m.groups()
        kw: dict[str, Any] = {"delta": bool(delta), "shuffle": not noshuffle}
        if kind.endswith("-row"):
            kind, kw["per_row"] = kind[:-4], True
        if arg is not None:
            if kind != "topk":
                raise CodecError("bad-encoding", f"{kind} takes no ':' argument (only topk:DENSITY does)")
            try:
                kw["density"] = float(arg)
            except ValueError:
                raise CodecError("bad-encoding", f"topk density {arg!r} is not a number") from None
        if level is not None:
            kw["level"] = int(level)
        return cls(kind=kind, **kw)

    def __str__(self) -> str:
        s = ("delta+" if self.delta else "") + self.kind
        if self.kind in _LEVELS and self.per_row:
            s += "-row"
        if self.kind == "topk":
            s += f":{self.density:g}"
        if self.level != DEFAULT_LEVEL:
            s += f"@{self.level}"
        if not self.shuffle:
            s += ",noshuffle"
        return s


def _as_f32(t: Any, name: str) -> tuple[np.ndarray, str]:
    """A C-contiguous float32 numpy array (no copy when already one) and the source dtype name."""
    if hasattr(t, "detach"):  # torch.Tensor, without importing torch here
        dt = str(t.dtype).replace("torch.", "")
        t = t.detach()
        if dt != "float32":
            t = t.float()
        arr = t.cpu().contiguous().numpy()
    elif isinstance(t, (np.ndarray, np.generic)):
        dt = t.dtype.name
        arr = np.asarray(t, dtype=np.float32, order="C")
    else:
        raise CodecError(
            "bad-tensor", f"tensor {name!r} is a {type(t).__name__}, not a numpy array or torch tensor"
        )
    return arr, dt


def raw_nbytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of the tensors as raw float32 (the baseline of every byte metric)."""
    return sum(4 * int(np.prod(tuple(t.shape), dtype=np.int64)) for t in tensors.values())


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15, two a byte: element 2i in the low nibble, 2i+1 in the high one
    (a zero pads an odd count)."""
    if q.size % 2:
        q = np.concatenate([q, np.zeros(1, np.uint8)])
    return q[0::2] | (q[1::2] << 4)


def _unpack_nibbles(p: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(2 * p.size, np.uint8)
    np.bitwise_and(p, 15, out=out[0::2])
    np.right_shift(p, 4, out=out[1::2])
    return out[:n]


def _rows(shape: tuple[int, ...], n: int) -> int:
    return shape[0] if len(shape) >= 2 and shape[0] > 0 else 1


def _encode_one(
    name: str, x: np.ndarray, dt: str, spec: EncodingSpec, b: np.ndarray | None, tasks: list[Task]
) -> dict:
    flat = x.reshape(-1)
    n = flat.size
    rec: dict[str, Any] = {"n": name, "s": list(x.shape), "dt": dt, "e": spec.kind, "x": b is not None}
    kind, level = spec.kind, spec.level
    if kind == "raw":
        if b is None:
            rec["p"] = pack_array(flat, level, spec.shuffle, tasks)
        else:  # the XOR is done by the packing tasks, group by group
            rec["p"] = pack_array(flat.view(np.uint32), level, spec.shuffle, tasks, xor=b.view(np.uint32))
        return rec
    d = flat if b is None else flat - b
    if kind == "fp16":
        rec["p"] = pack_array(d.astype(np.float16), level, spec.shuffle, tasks, owned=True)
        return rec
    if kind == "bf16":
        rec["p"] = pack_array(f32_to_bf16(np.ascontiguousarray(d)), level, spec.shuffle, tasks, owned=True)
        return rec
    if n and not np.isfinite(d).all():
        raise CodecError("non-finite", f"tensor {name!r} has NaN/Inf; {kind} cannot encode it")
    if kind in _LEVELS:
        top = _LEVELS[kind]
        rows = _rows(x.shape, n) if spec.per_row else 1
        m = d.reshape(rows, -1) if n else d.reshape(rows, 0)
        lo = m.min(axis=1) if n else np.zeros(rows, np.float32)
        hi = m.max(axis=1) if n else np.zeros(rows, np.float32)
        scale = ((hi.astype(np.float64) - lo) / float(top)).astype(np.float32)
        scale[scale <= 0] = 1.0
        q8 = quantize_affine(m, lo, (1.0 / scale.astype(np.float64)).astype(np.float32), top)
        rec["r"] = bool(spec.per_row)
        rec["sc"] = make_blob(scale.astype(np.float32), 0, owned=True)
        rec["lo"] = make_blob(lo.astype(np.float32), 0, owned=True)
        rec["p"] = pack_array(_pack_nibbles(q8) if kind == "int4" else q8, level, False, tasks, owned=True)
        return rec
    # topk
    k = min(n, max(1, math.ceil(spec.density * n))) if n else 0
    if k < n:
        idx = np.argpartition(np.abs(d), n - k)[n - k :]
        idx.sort()
    else:
        idx = np.arange(n)
    vals = d[idx]
    diffs = np.diff(idx, prepend=0).astype(np.uint32)
    vd = "float16" if (k == 0 or float(np.abs(vals).max()) <= _FP16_MAX) else "float32"
    rec["k"] = int(k)
    rec["vd"] = vd
    rec["i"] = pack_array(diffs, level, spec.shuffle, tasks, owned=True)
    rec["v"] = pack_array(vals.astype(vd), level, spec.shuffle, tasks, owned=True)
    return rec


def encode_state(
    tensors: Mapping[str, Any],
    spec: EncodingSpec,
    base: Mapping[str, Any] | None = None,
) -> dict:
    """Encode ``tensors`` (any subset of the model) as a msgpack-able dict;
    ``base`` is required for a delta."""
    if not isinstance(spec, EncodingSpec):
        raise CodecError("bad-encoding", f"spec must be an EncodingSpec, got {type(spec).__name__}")
    if spec.delta and base is None:
        raise CodecError("missing-base", f"encoding {spec} needs the base model")
    records = []
    tasks: list[Task] = []  # shuffling and compression, run on the codec threads once every tensor is planned
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise CodecError("bad-tensor", f"tensor names must be str, got {type(name).__name__}")
        x, dt = _as_f32(t, name)
        b = None
        if spec.delta:
            if name not in base:  # type: ignore[operator]
                raise CodecError("missing-base", f"base has no tensor {name!r}")
            b, _ = _as_f32(base[name], name)  # type: ignore[index]
            if b.shape != x.shape:
                raise CodecError("bad-base", f"base {name!r} has shape {b.shape}, tensor has {x.shape}")
            b = b.reshape(-1)
        records.append(_encode_one(name, x, dt, spec, b, tasks))
    run_all(tasks)
    return {"fmt": FORMAT, "enc": str(spec), "t": records}


_KEYS = {
    "raw": {"p"},
    "fp16": {"p"},
    "bf16": {"p"},
    "int8": {"r", "sc", "lo", "p"},
    "int6": {"r", "sc", "lo", "p"},
    "int5": {"r", "sc", "lo", "p"},
    "int4": {"r", "sc", "lo", "p"},
    "topk": {"k", "vd", "i", "v"},
}
_COMMON = {"n", "s", "dt", "e", "x"}


def _raw_post(
    b: np.ndarray | None, xor: bool, shift: int, bad: list, reject: bool
) -> Callable[[np.ndarray, int, int], None]:
    """Per assembled block of a raw tensor (while in cache): undo the XOR delta, check for NaN/Inf, then
    subtract the base when a delta is wanted (``shift`` −1)."""
    b32 = None if b is None else b.view(np.uint32)

    def post(a: np.ndarray, i: int, j: int) -> None:
        blk = a[i:j]
        if xor:
            np.bitwise_xor(blk, b32[i:j], out=blk)  # type: ignore[index]
        f = blk.view(np.float32)
        if reject and not bad and not np.isfinite(f).all():
            bad.append(True)
        if shift < 0:
            np.subtract(f, b[i:j], out=f)  # type: ignore[index]

    return post


def _decode_one(
    rec: dict,
    name: str,
    n: int,
    shape: tuple[int, ...],
    b: np.ndarray | None,
    work: Unpacking,
    reject: bool,
    as_delta: bool,
) -> Task:
    """Check ``rec`` and plan its decoding into ``work``; returns the task that finishes the float32 array.

    ``b`` is the flat float32 base tensor when the record is a delta or ``as_delta`` is set. The result is
    θ (a delta record plus the base) or, with ``as_delta``, θ − base (a delta record as it is).
    """
    kind = rec["e"]
    bad: list = []
    shift = 0 if rec["x"] == as_delta else (-1 if as_delta else 1)  # arithmetic kinds: −b, nothing or +b

    def finite(a: np.ndarray) -> np.ndarray:
        if bad or (reject and kind != "raw" and not np.isfinite(a).all()):
            raise CodecError("non-finite", f"tensor {name!r} contains NaN or Inf")
        return a

    if kind == "raw":  # its delta is a bit-pattern XOR: undone, it yields θ either way
        xor = rec["x"]
        get = unpack_array(
            rec["p"],
            np.uint32 if xor else np.float32,
            n,
            work,
            writeable=True,
            post=_raw_post(b, xor, -1 if as_delta else 0, bad, reject),
        )
        return 0, lambda: finite(get().view(np.float32))
    if kind == "fp16" or kind == "bf16" or kind in _LEVELS:
        fin = _plan_dense(kind, rec, n, shape, work)
    else:
        return 4 * n, _plan_topk(rec, n, b, shift, work, finite)

    def values() -> np.ndarray:
        v = fin()
        if shift > 0:
            v += b
        elif shift < 0:
            v -= b
        return finite(v)

    return 4 * n, values


def _plan_dense(
    kind: str, rec: dict, n: int, shape: tuple[int, ...], work: Unpacking
) -> Callable[[], np.ndarray]:
    """Plan an fp16, bf16 or quantized record's unpacking; returns what makes its float32 values (before any
    base is added or subtracted)."""
    if kind == "fp16":
        get16 = unpack_array(rec["p"], np.float16, n, work)
        return lambda: get16().astype(np.float32)
    if kind == "bf16":
        getb = unpack_array(rec["p"], np.uint16, n, work)
        return lambda: bf16_to_f32(getb())
    per_row = rec["r"]
    if type(per_row) is not bool:
        raise CodecError("bad-tensor", f"{kind} per-row flag must be a bool")
    rows = _rows(shape, n) if per_row else 1
    scale = np.frombuffer(read_blob(rec["sc"], 4 * rows), np.float32)
    lo = np.frombuffer(read_blob(rec["lo"], 4 * rows), np.float32)
    if not (np.isfinite(scale).all() and np.isfinite(lo).all()):
        raise CodecError("non-finite", f"{kind} scale or zero point is NaN/Inf")
    nibbles = kind == "int4"
    getq = unpack_array(rec["p"], np.uint8, (n + 1) // 2 if nibbles else n, work)
    top = _LEVELS[kind]

    def dequantized() -> np.ndarray:
        q = _unpack_nibbles(getq(), n) if nibbles else getq()
        if top < 255 and not nibbles and n and int(q.max()) > top:
            raise CodecError("bad-tensor", f"{kind} value above its top level {top}")
        return dequantize_affine(q, scale, lo, rows)

    return dequantized


def _plan_topk(
    rec: dict,
    n: int,
    b: np.ndarray | None,
    shift: int,
    work: Unpacking,
    finite: Callable[[np.ndarray], np.ndarray],
) -> Callable[[], np.ndarray]:
    """Plan a top-k record's unpacking; returns what scatters its values into the float32 tensor, the base
    added (``shift`` 1) or subtracted (−1) as _decode_one wants."""
    k, vd = rec["k"], rec["vd"]
    if type(k) is not int or not 0 <= k <= n:
        raise CodecError("bad-tensor", f"topk count {k!r} outside 0..{n}")
    if vd not in ("float16", "float32"):
        raise CodecError("bad-tensor", f"topk value dtype {vd!r} is not float16/float32")
    getd = unpack_array(rec["i"], np.uint32, k, work)
    getv = unpack_array(rec["v"], np.dtype(vd), k, work)

    def topk() -> np.ndarray:
        diffs, vals = getd(), getv()
        idx = np.cumsum(diffs, dtype=np.int64)
        if k and ((diffs[1:] == 0).any() or idx[-1] >= n):
            raise CodecError("bad-tensor", "topk indices are not strictly increasing within the tensor")
        d = np.zeros(n, np.float32)
        if shift == 0:
            d[idx] = vals
            return finite(d)
        assert b is not None  # a delta record, or as_delta: the caller passes the base
        if shift > 0:
            out = b.copy()
            out[idx] += vals.astype(np.float32)
            return finite(out)
        d[idx] = vals
        return finite(d - b)

    return topk


def decode_state(
    obj: Any,
    manifest: Manifest,
    base: Mapping[str, Any] | None = None,
    *,
    reject_nonfinite: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tensors: int = 100_000,
    as_delta: bool = False,
) -> dict[str, np.ndarray]:
    """Decode and validate an ``encode_state`` dict against ``manifest``; float32 arrays by name.

    Checks before any decompression that every name is in the manifest (once), shapes and dtypes match and
    the decoded size fits ``max_bytes``; resolves deltas against ``base``. With ``as_delta`` every tensor
    comes back as θ − ``base`` instead (a delta record as sent, a full one minus the base), in the same
    single pass. All or nothing: any problem raises CodecError and returns no tensor.
    """
    if as_delta and base is None:
        raise CodecError("missing-base", "decoding as deltas needs the base model")
    try:
        return _decode_state(obj, manifest, base, reject_nonfinite, max_bytes, max_tensors, as_delta)
    except CodecError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError, MemoryError) as exc:
        raise CodecError("malformed", f"tensor data could not be decoded ({type(exc).__name__})") from None


def _decode_state(
    obj: Any,
    manifest: Manifest,
    base: Mapping[str, Any] | None,
    reject_nonfinite: bool,
    max_bytes: int,
    max_tensors: int,
    as_delta: bool,
) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict) or set(obj) != {"fmt", "enc", "t"}:
        raise CodecError("malformed", "tensor payload must be a map with keys fmt, enc, t")
    if type(obj["fmt"]) is not int or obj["fmt"] not in READS_FORMATS:
        raise CodecError(
            "unknown-version",
            f"tensor format {obj['fmt']!r} is not supported (this build reads {READS_FORMATS})",
        )
    records = obj["t"]
    if not isinstance(records, list):
        raise CodecError("malformed", "tensor list must be an array")
    if len(records) > max_tensors:
        raise CodecError("too-large", f"{len(records)} tensors exceed the limit of {max_tensors}")
    specs = {t.name: t for t in manifest}
    plan = []
    total = 0
    seen: set[str] = set()
    for rec in records:
        if not isinstance(rec, dict) or "e" not in rec or not _COMMON <= set(rec):
            raise CodecError("malformed", "tensor record lacks n, s, dt, e or x")
        kind = rec["e"]
        if kind not in _KEYS:
            raise CodecError("unknown-encoding", f"tensor encoding {kind!r} is not one of {', '.join(KINDS)}")
        if set(rec) != _COMMON | _KEYS[kind]:
            raise CodecError("malformed", f"{kind} record has fields {sorted(rec)}")
        name = rec["n"]
        if not isinstance(name, str):
            raise CodecError("malformed", "tensor name must be a str")
        if name not in specs:
            raise CodecError("unknown-tensor", f"tensor {name!r} is not in the model manifest")
        if name in seen:
            raise CodecError("duplicate-tensor", f"tensor {name!r} appears twice")
        seen.add(name)
        spec = specs[name]
        shape = rec["s"]
        if (
            not isinstance(shape, list)
            or any(type(s) is not int for s in shape)
            or tuple(shape) != spec.shape
        ):
            raise CodecError(
                "shape-mismatch", f"tensor {name!r} has shape {shape!r}, the manifest says {list(spec.shape)}"
            )
        if rec["dt"] != spec.dtype:
            raise CodecError(
                "dtype-mismatch", f"tensor {name!r} has dtype {rec['dt']!r}, the manifest says {spec.dtype}"
            )
        if type(rec["x"]) is not bool:
            raise CodecError("malformed", f"tensor {name!r} delta flag must be a bool")
        total += 4 * spec.numel
        if total > max_bytes:
            raise CodecError("too-large", f"decoded tensors exceed {max_bytes} bytes")
        b = None
        if rec["x"] or as_delta:
            if base is None or name not in base:
                raise CodecError("missing-base", f"the base model lacks tensor {name!r}")
            b, _ = _as_f32(base[name], name)
            if b.shape != spec.shape:
                raise CodecError(
                    "bad-base", f"base {name!r} has shape {b.shape}, the manifest says {spec.shape}"
                )
            b = b.reshape(-1)
        plan.append((rec, name, spec, b))
    work = Unpacking()  # every record is checked before any decompression starts
    finish = [
        _decode_one(rec, name, spec.numel, spec.shape, b, work, reject_nonfinite, as_delta)
        for rec, name, spec, b in plan
    ]
    run_all(work.tasks(), ordered=True)
    arrays = run_all(finish)
    return {name: arr.reshape(spec.shape) for (_, name, spec, _), arr in zip(plan, arrays)}
