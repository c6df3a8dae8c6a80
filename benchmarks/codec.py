"""Codec benchmark: encode/decode MB/s (of fp32 input) and compression ratio per encoding.

Models (synthetic "trained-like" weights, numpy only, seeded): weight matrices N(0, 0.05 · s_row) with a
log-normal per-row scale s_row ~ exp(N(0, 0.5)) (rows of trained embeddings and projections differ in
norm), biases N(0, 0.01), layer-norm gains 1 + N(0, 0.02). Delta encodings encode θ against a base that
differs by N(0, 1e-3) per entry, like one round of local SGD.

* gru-untied / gru-tied: FedAtt's GRU LM, embedding = hidden = 300, vocabulary 33,278 (WikiText-2).
* transformer-base: 6+6 layers, d_model 512, FFN 2048, shared 32k vocabulary (tied): ~60M parameters.

Encode = encode_state + envelope pack; decode = unpack + decode_state (with digest, bounds, manifest and
NaN/Inf checks), i.e. exactly what goes over the wire. Baselines measured in the same run: torch.save /
torch.load(weights_only=True) of the state dict, and plain msgpack of each tensor's raw bytes.
Run: ``python -m fedmq.benchmarks.codec [--repeats N] [--quick] [--threads N] [--no-malloc-tune]``. By default
the allocator is tuned as a service would do at start (broker.wire.malloc.tune_allocator: freed buffers are
reused instead of page-faulted afresh); --no-malloc-tune measures glibc's defaults. --threads sets the codec's
worker threads (default: one per core, at most 4). The machine's load average before and after the run and the
process's CPU time are printed under the table: speeds on a shared machine depend on them.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import msgpack
import numpy as np
import torch

from fedmq.benchmarks import markdown
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state, raw_nbytes
from fedmq.broker.wire.envelope import Envelope, Kind, pack, unpack
from fedmq.broker.wire.malloc import tune_allocator
from fedmq.broker.wire.threads import codec_threads, set_codec_threads
from fedmq.manifest import Manifest

ENCODINGS = [
    "raw",
    "raw@3",
    "raw,noshuffle",
    "fp16",
    "bf16",
    "int8",
    "int8-row",
    "topk:0.01",
    "delta+raw",
    "delta+bf16",
    "delta+int8",
    "delta+int8-row",
    "delta+topk:0.01",
]
QUICK_ENCODINGS = ["raw", "raw@3", "bf16", "delta+int8", "topk:0.01"]


def _w(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    s = np.exp(rng.normal(0, 0.5, (rows, 1))).astype(np.float32)
    return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05)) * s


def _b(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)


def gru_lm(tied: bool, vocab: int = 33278, dim: int = 300, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    st = {
        "encoder.weight": _w(rng, vocab, dim),
        "rnn.weight_ih_l0": _w(rng, 3 * dim, dim),
        "rnn.weight_hh_l0": _w(rng, 3 * dim, dim),
        "rnn.bias_ih_l0": _b(rng, 3 * dim),
        "rnn.bias_hh_l0": _b(rng, 3 * dim),
    }
    if not tied:
        st["decoder.weight"] = _w(rng, vocab, dim)
    st["decoder.bias"] = _b(rng, vocab)
    return st


def transformer_base(
    vocab: int = 32000, d: int = 512, ffn: int = 2048, layers: int = 6, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    st: dict[str, np.ndarray] = {"shared.embedding": _w(rng, vocab, d)}

    def ln(p: str) -> None:
        st[p + ".weight"] = 1 + rng.standard_normal(d, dtype=np.float32) * np.float32(0.02)
        st[p + ".bias"] = _b(rng, d)

    def attn(p: str) -> None:
        for m in ("q", "k", "v", "out"):
            st[f"{p}.{m}_proj.weight"] = _w(rng, d, d)
            st[f"{p}.{m}_proj.bias"] = _b(rng, d)

    def ff(p: str) -> None:
        st[p + ".fc1.weight"], st[p + ".fc1.bias"] = _w(rng, ffn, d), _b(rng, ffn)
        st[p + ".fc2.weight"], st[p + ".fc2.bias"] = _w(rng, d, ffn), _b(rng, d)

    for i in range(layers):
        attn(f"encoder.layers.{i}.self_attn")
        ln(f"encoder.layers.{i}.ln1")
        ff(f"encoder.layers.{i}")
        ln(f"encoder.layers.{i}.ln2")
    for i in range(layers):
        attn(f"decoder.layers.{i}.self_attn")
        ln(f"decoder.layers.{i}.ln1")
        attn(f"decoder.layers.{i}.cross_attn")
        ln(f"decoder.layers.{i}.ln2")
        ff(f"decoder.layers.{i}")
        ln(f"decoder.layers.{i}.ln3")
    ln("encoder.ln")
    ln("decoder.ln")
    return st


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[tuple[float, float], object]:
    """((median wall s, median process CPU s), last result) of ``repeats`` calls of ``fn``."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return (statistics.median(walls), statistics.median(cpus)), out


def _torch_save(tstate: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(tstate, buf)
    return buf.getvalue()


def _torch_load(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _msgpack_pack(state: dict[str, np.ndarray]) -> bytes:
    return msgpack.packb({k: v.tobytes() for k, v in state.items()})


def _msgpack_unpack(blob: bytes) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(v, np.float32) for k, v in msgpack.unpackb(blob).items()}


def _encode(state: dict[str, np.ndarray], spec: EncodingSpec, base: dict[str, np.ndarray] | None) -> bytes:
    """What goes over the wire: encode_state and the envelope around it."""
    env = Envelope(
        Kind.UPDATE, "bench", 1, "c1", 0, {"n_samples": 1, "tensors": encode_state(state, spec, base)}
    )
    return pack(env, level=spec.level)


def _decode(wire: bytes, manifest: Manifest, base: dict[str, np.ndarray] | None) -> dict:
    """What the receiver does: unpack (digest, bounds) and decode_state (manifest, NaN/Inf checks)."""
    return decode_state(unpack(wire).payload["tensors"], manifest, base)


def _row(
    model: str,
    name: str,
    nbytes: int,
    wire: int,
    t_enc: tuple[float, float],
    t_dec: tuple[float, float],
    err: float | None,
) -> dict:
    return {
        "model": model,
        "encoding": name,
        "raw_mb": nbytes / 1e6,
        "wire_mb": wire / 1e6,
        "ratio": nbytes / wire,
        "enc_mbs": nbytes / t_enc[0] / 1e6,
        "dec_mbs": nbytes / t_dec[0] / 1e6,
        "max_abs_err": err,
        "enc_cpu_mbs": nbytes / max(t_enc[1], 1e-9) / 1e6,
        "dec_cpu_mbs": nbytes / max(t_dec[1], 1e-9) / 1e6,
    }


def run(models: list[str], encodings: list[str], repeats: int = 5) -> list[dict]:
    builders = {
        "gru-untied": lambda: gru_lm(False),
        "gru-tied": lambda: gru_lm(True),
        "transformer-base": transformer_base,
    }
    rows = []
    for model in models:
        state = builders[model]()
        rng = np.random.default_rng(1)
        base = {
            k: v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(1e-3) for k, v in state.items()
        }
        manifest = Manifest.from_arrays(state)
        nbytes = raw_nbytes(state)

        # baselines
        tstate = {k: torch.from_numpy(v) for k, v in state.items()}
        t_enc, blob = _median_time(partial(_torch_save, tstate), repeats)
        t_dec, _ = _median_time(partial(_torch_load, blob), repeats)
        rows.append(_row(model, "torch.save", nbytes, len(blob), t_enc, t_dec, 0.0))
        t_enc, blob = _median_time(partial(_msgpack_pack, state), repeats)
        t_dec, _ = _median_time(partial(_msgpack_unpack, blob), repeats)
        rows.append(_row(model, "msgpack raw bytes", nbytes, len(blob), t_enc, t_dec, 0.0))
        del blob, tstate

        for text in encodings:
            spec = EncodingSpec.parse(text)
            b = base if spec.delta else None
            t_enc, enc_wire = _median_time(partial(_encode, state, spec, b), repeats)
            t_dec, out = _median_time(partial(_decode, enc_wire, manifest, b), repeats)
            err = max(float(np.abs(out[k] - v).max()) for k, v in state.items())
            rows.append(_row(model, text, nbytes, len(enc_wire), t_enc, t_dec, err))
            del enc_wire, out
    return rows


def bench_codec(repeats: int = 5, quick: bool = False) -> list[dict]:
    """The `fedmq bench codec` entry: full run, or a quick one (GRU untied, 5 encodings, 2 repeats).

    Tunes the allocator first, as ``main`` does unless --no-malloc-tune (idempotent, process-wide).
    """
    tune_allocator()
    if quick:
        return run(["gru-untied"], QUICK_ENCODINGS, repeats=min(repeats, 2))
    return run(["gru-untied", "gru-tied", "transformer-base"], ENCODINGS, repeats)


def format_table(rows: list[dict]) -> str:
    """Markdown table; ratio is raw fp32 bytes / wire bytes, speeds are MB/s of fp32 input (median wall
    clock), and MB per CPU-second (median process CPU time, all threads): the speed a core would give
    if this process had it to itself, which a loaded machine's wall clock does not show."""
    columns = (
        "model, encoding, fp32 MB, wire MB, ratio vs fp32, encode MB/s, decode MB/s, max abs err, "
        "encode MB/CPU-s, decode MB/CPU-s"
    ).split(", ")
    cells = [
        [
            r["model"],
            r["encoding"],
            f"{r['raw_mb']:.1f}",
            f"{r['wire_mb']:.2f}",
            f"{r['ratio']:.2f}×",
            f"{r['enc_mbs']:.0f}",
            f"{r['dec_mbs']:.0f}",
            "0 (exact)" if r["max_abs_err"] == 0 else f"{r['max_abs_err']:.2e}",
            f"{r['enc_cpu_mbs']:.0f}",
            f"{r['dec_cpu_mbs']:.0f}",
        ]
        for r in rows
    ]
    return markdown.table(columns, cells, right_from=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=None, help="comma list of gru-untied,gru-tied,transformer-base")
    ap.add_argument("--encodings", default=None, help="comma list, e.g. raw,bf16,delta+int8")
    ap.add_argument("--threads", type=int, default=None, help="codec worker threads (1 = none)")
    ap.add_argument("--no-malloc-tune", action="store_true", help="leave glibc's allocator at its defaults")
    a = ap.parse_args(argv)
    if a.threads is not None:
        try:
            set_codec_threads(a.threads)
        except ValueError as exc:
            ap.error(str(exc))
    if not a.no_malloc_tune:
        tune_allocator()
    load0, wall0, cpu0 = os.getloadavg(), time.perf_counter(), time.process_time()
    if a.models or a.encodings:
        rows = run(
            a.models.split(",") if a.models else ["gru-untied", "gru-tied", "transformer-base"],
            a.encodings.split(",") if a.encodings else ENCODINGS,
            a.repeats,
        )
    else:
        rows = bench_codec(a.repeats, a.quick)
    print(format_table(rows))  # noqa: T201 - command-line output
    load1 = os.getloadavg()
    print(  # noqa: T201
        f"\ncodec threads {codec_threads()}; "
        f"load average (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
        f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}; wall {time.perf_counter() - wall0:.0f} s, "
        f"process CPU {time.process_time() - cpu0:.0f} s"
    )


if __name__ == "__main__":
    main()
