"""The physical limit of one `fedmq bench flower` round, measured on the machine the bench runs on.

Every part a synchronous FedAvg round cannot skip is timed on one core (torch and the wire codec held to one
thread), on the bench's own task and model, median of ``repeats``:

* ``encode_down``: the new global model, encoded with the downlink encoding and packed into a message (once);
* ``decode_down``: the message unpacked and decoded (once: the clients of one process share one decode);
* ``train``: one client's local training (the bench's one step), from loading the model into its trainer;
* ``encode_up``: one client encodes its update with the uplink encoding (a delta) and packs it;
* ``decode_up``: the aggregator unpacks and decodes one update;
* ``fold``: FedAvg folds one update into its running sum;
* ``validate``: the server's validation of the new model (the bench's validation lines);
* ``checkpoint``: the round's checkpoint of this model written to disk.

With S selected clients and P cores that can work in parallel::

    work     = encode_down + decode_down + validate + checkpoint + S × (train + encode_up + decode_up + fold)
    critical = encode_down + decode_down + train + encode_up + decode_up + fold + validate
    limit    = max(work / P, critical)

``work / P``: all the round's core-seconds spread perfectly over the cores; ``critical``: the chain no
parallelism shortens (the model must be encoded before a client decodes it, the last update folded before
the new model is validated). The checkpoint counts as work but not on the chain: it can overlap the next
round. Nothing here waits on a network: the limit is what the CPU work alone allows.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PARTS = ("encode_down", "decode_down", "train", "encode_up", "decode_up", "fold", "validate", "checkpoint")
CODEC = ("encode_down", "decode_down", "encode_up", "decode_up")  # the parts an encoding changes
PER_CLIENT = ("train", "encode_up", "decode_up", "fold")


@dataclass
class Limit:
    parts: dict[str, float]
    selected: int
    cores: int
    up: str
    down: str
    notes: list[str] = field(default_factory=list)

    @property
    def work(self) -> float:
        p = self.parts
        once = p["encode_down"] + p["decode_down"] + p["validate"] + p["checkpoint"]
        return once + self.selected * sum(p[k] for k in PER_CLIENT)

    @property
    def critical(self) -> float:
        p = self.parts
        return sum(p[k] for k in ("encode_down", "decode_down", *PER_CLIENT, "validate"))

    @property
    def seconds(self) -> float:
        return max(self.work / self.cores, self.critical)

    def describe(self) -> str:
        p = self.parts
        parts = ", ".join(f"{k} {1e3 * p[k]:.1f} ms" for k in PARTS)
        return (
            f"round limit {self.seconds:.2f} s = max(work / P, critical) with P = {self.cores} cores, "
            f"S = {self.selected}: work = encode_down + decode_down + validate + checkpoint + S × (train + "
            f"encode_up + decode_up + fold) = {self.work:.2f} core-s, critical = {self.critical:.2f} s "
            f"(uplink {self.up}, downlink {self.down}; one core each: {parts})"
        )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def _one_core() -> Iterator[None]:
    """torch and the wire codec held to one thread each, as they were before afterwards."""
    import torch

    from fedmq.broker.wire.threads import codec_threads, set_codec_threads

    threads, codec = torch.get_num_threads(), codec_threads()
    torch.set_num_threads(1)
    set_codec_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        set_codec_threads(codec)


def _message(kind: Any, tensors: dict) -> bytes:
    from fedmq.broker.wire.envelope import Envelope, pack

    return pack(Envelope(kind, "bench", 1, "c0", 1, {"tensors": tensors}))


def _common_parts(task: Any, model: Any, cfg: Any, repeats: int) -> tuple[dict[str, float], dict, dict]:
    """The parts no encoding changes (train, fold, validate, checkpoint), and the global model before and
    after one client's training, as arrays."""
    import torch

    from fedmq import ClientUpdate
    from fedmq.aggregator.checkpoint import save_checkpoint
    from fedmq.aggregator.strategies.fedavg import FedAvg
    from fedmq.tasks.base import load_state, model_state

    base = {k: v.clone() for k, v in model_state(model).items()}
    base_np = {k: v.numpy() for k, v in base.items()}
    common: dict[str, float] = {}

    def train() -> None:
        load_state(model, base)
        task.train(model, 0, cfg)

    common["train"] = _median(train, repeats)
    trained = {k: v.detach().numpy().copy() for k, v in model_state(model).items()}
    delta = {k: torch.from_numpy(trained[k] - base_np[k]) for k in trained}
    strategy = FedAvg()
    strategy.begin(base)
    update = ClientUpdate("c0", 16, delta, loss=1.0, delta=True)
    common["fold"] = _median(lambda: strategy.fold(update), repeats)
    load_state(model, base)
    common["validate"] = _median(lambda: task.evaluate(model, "valid"), repeats)
    with tempfile.TemporaryDirectory(prefix="fedmq-limit-") as tmp:
        common["checkpoint"] = _median(
            lambda: save_checkpoint(
                tmp,
                round=1,
                model_version=1,
                global_state=base,
                strategy_state={},
                mediator_state={},
                rng_state=None,
                folded={},
                extra={},
            ),
            repeats,
        )
    return common, base_np, trained


def _codec_parts(
    up: str, down: str, base_np: dict, trained: dict, manifest: Any, repeats: int
) -> dict[str, float]:
    """The parts an encoding changes, with uplink ``up`` and downlink ``down``."""
    from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
    from fedmq.broker.wire.envelope import Kind, unpack

    up_spec, down_spec = EncodingSpec.parse(up), EncodingSpec.parse(down)
    down_msg = _message(Kind.MODEL, encode_state(base_np, down_spec))
    up_msg = _message(Kind.UPDATE, encode_state(trained, up_spec, base_np))
    return {
        "encode_down": _median(lambda: _message(Kind.MODEL, encode_state(base_np, down_spec)), repeats),
        "decode_down": _median(lambda: decode_state(unpack(down_msg).payload["tensors"], manifest), repeats),
        "encode_up": _median(lambda: _message(Kind.UPDATE, encode_state(trained, up_spec, base_np)), repeats),
        "decode_up": _median(
            lambda: decode_state(unpack(up_msg).payload["tensors"], manifest, base_np, as_delta=True),
            repeats,
        ),
    }


def measure(
    data: str,
    clients: int,
    selected: int,
    encodings: tuple[tuple[str, str], ...] = (("delta+bf16", "bf16"),),
    repeats: int = 5,
    bptt: int = 8,
    max_eval_lines: int = 1,
    batch_size: int = 2,
    max_steps: int = 1,
    model_name: str = "gru-small",
) -> list[Limit]:
    """Time each part of the bench's round on this machine, one core each (see the module docstring): the
    codec's parts for each (uplink, downlink) pair of ``encodings``, the others once; a Limit per pair."""
    from fedmq import TrainConfig
    from fedmq.tasks.registry import make_task

    with _one_core():
        task = make_task(
            "lm",
            data=data,
            model=model_name,
            tied=True,
            clients=clients,
            bptt=bptt,
            max_eval_lines=max_eval_lines,
        )
        model = task.build_model(0)
        manifest = task.manifest(model)
        cfg = TrainConfig(epochs=1, batch_size=batch_size, max_steps=max_steps)
        common, base_np, trained = _common_parts(task, model, cfg, repeats)
        return [
            Limit(
                {**common, **_codec_parts(up, down, base_np, trained, manifest, repeats)},
                selected,
                usable_cores(),
                up,
                down,
            )
            for up, down in encodings
        ]
