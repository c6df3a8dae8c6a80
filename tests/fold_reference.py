"""What the fold-order tests share: a round's synthetic updates and one aggregator's FedAvg of them in a given
order, folded straight from the bytes (the reference the engine's results are held against)."""

from __future__ import annotations

import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state


def one_round_job(job: str, clients: int, **extra) -> JobConfig:
    """A FedAvg job of one round with every client selected and deadlines that never close it first; raw
    both ways, so the updates are folded as they were made and the sums' order is all that can differ."""
    settings = dict(
        job=job,
        strategy="fedavg",
        rounds=1,
        clients=clients,
        fraction=1.0,
        heartbeat_s=600,
        join_timeout_s=600,
        report_deadline_s=600,
        update_deadline_s=600,
        identity="shared:guest",
        encoding="raw",
        down_encoding="raw",
    )
    return JobConfig(**{**settings, **extra})


def noisy_updates(global_state: dict[str, torch.Tensor], job: str, agents: list[str]) -> dict[str, bytes]:
    """Each agent's update of round 1: the model plus its own noise, with its own sample count."""
    out = {}
    for i, client in enumerate(agents):
        gen = torch.Generator().manual_seed(i)
        state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in global_state.items()}
        tensors = encode_state(state, EncodingSpec.parse("raw"))
        env = messages.update(job, 1, client, 0, 1.0, 1 + i % 7, tensors)
        out[client] = messages.encode(env)
    return out


def fedavg(task, start: dict, bodies: dict[str, bytes], order: list[str]) -> dict[str, torch.Tensor]:
    """FedAvg of ``bodies`` folded in ``order`` by one strategy, as one aggregator would."""
    strategy = FedAvg()
    strategy.begin(start)
    manifest = task.manifest(task.build_model(0))
    for client in order:
        env = messages.decode(bodies[client])
        tensors = decode_state(env.payload["tensors"], manifest, start, as_delta=True)
        strategy.fold(
            ClientUpdate(
                client,
                env.payload["n_samples"],
                {k: torch.from_numpy(v) for k, v in tensors.items()},
                delta=True,
            )
        )
    return strategy.finish()


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
