"""What every task (model + data + local training + evaluation) offers the agent and the aggregator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedmq.manifest import Manifest
from fedmq.train_config import TrainConfig

Progress = Callable[[int, int], None]  # (steps done, steps total)
# a model's federated state, or a change to it: tensors by parameter name (the manifest's names)
State = dict[str, torch.Tensor]


@dataclass
class TrainResult:
    loss: float  # mean training loss per target token over the local run
    n_samples: int  # n_k, the FedAvg weight: target tokens (lm) or sentence pairs (nmt) in the client's shard
    steps: int
    tokens: int
    seconds: float
    # the trained model's loss on the shard it trained on (cfg.tail_loss), no dropout
    tail_loss: float | None = None

    @property
    def reported(self) -> float:
        """The loss an agent reports: the tail loss when measured, else the mean over the local run."""
        return self.loss if self.tail_loss is None else self.tail_loss


def model_state(model: torch.nn.Module) -> State:
    """The federated state: named parameters, tied weights once (named_parameters drops duplicates)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_state(model: torch.nn.Module, state: State) -> None:
    """Copy ``state`` (a subset of the manifest is fine) into the model's parameters in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(torch.as_tensor(value, dtype=params[name].dtype))


class Task(ABC):
    """A federated learning task. One instance is shared by all agents of a process (data loaded once)."""

    name: ClassVar[str]
    metric: ClassVar[str]  # "perplexity" | "bleu"
    higher_is_better: ClassVar[bool]

    @abstractmethod
    def build_model(self, seed: int = 0) -> torch.nn.Module:
        """A freshly initialised model (deterministic for a seed)."""

    @abstractmethod
    def groups(self) -> dict[str, str]:
        """Tensor name -> group ("encoder"/"decoder" for seq2seq, "model" otherwise)."""

    def manifest(self, model: torch.nn.Module) -> Manifest:
        return Manifest.from_arrays(model_state(model), self.groups())

    @property
    @abstractmethod
    def num_clients(self) -> int: ...

    @abstractmethod
    def train(
        self, model: torch.nn.Module, client: int, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        """Train ``model`` in place on client ``client``'s shard (0-based) for cfg.epochs local epochs."""

    def train_cohort(
        self,
        models: list[torch.nn.Module],
        clients: list[int],
        cfgs: list[TrainConfig],
        progress: list[Progress | None],
    ) -> list[TrainResult]:
        """Train ``models[i]`` on client ``clients[i]`` for each i: the clients a round selected, handed over
        together (client_agent.trainers.CohortPool). A task that can batch them overrides this; by default
        they train one after the other, each exactly as ``train`` would."""
        return [self.train(m, c, cfg, p) for m, c, cfg, p in zip(models, clients, cfgs, progress)]

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, split: str = "valid") -> float:
        """The task metric on the full split ("valid" | "test"): perplexity or BLEU."""

    def describe(self) -> dict[str, Any]:
        """Facts for the run folder's config (corpus, vocab size, shard sizes...)."""
        return {"task": self.name}
