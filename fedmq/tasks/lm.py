"""Word-level language modelling task (FedAtt / FedMed setting).

Client shards: the training *lines* are partitioned (``iid``: seeded shuffle, K contiguous equal parts; see
``partition``); a client's lines, kept in corpus order, with ``<eos>`` after each, form its token stream, laid
out in ``batch_size`` columns and cut into ``bptt``-step windows (the hidden state is carried across windows
and reset every epoch). Every token of the shard is a training target once per epoch; n_samples = that token
count. Perplexity = exp(total NLL / total target tokens) over the full split, the last partial batch included.

A population larger than the corpus has lines (a cross-device study: 100,000 keyboards over WikiText-2's
36,718 lines) is split below the line: ``iid`` then cuts the token stream of the shuffled lines into K
contiguous equal parts (each client holds a few words).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmq.tasks.base import Progress, Task, TrainConfig, TrainResult
from fedmq.tasks.catalog import MIN_COUNT
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm_cohort import can_train_together, cohort_size, train_cohort
from fedmq.tasks.lm_data import LMCorpus, StreamBatches, Vocabulary, load_corpus
from fedmq.tasks.lm_models import RNNLanguageModel, detach_hidden, rnn_config
from fedmq.tasks.partition import PartitionSpec, dirichlet_shards, iid_shards, natural_shards
from fedmq.tasks.training import run_training

EVAL_BATCH = 10


class LanguageModelTask(Task):
    name = "lm"
    metric = "perplexity"
    higher_is_better = False

    def __init__(
        self,
        data: str | Path = "builtin",
        model: str = "gru-small",
        tied: bool | None = None,
        dropout: float = 0.2,
        clients: int | None = None,  # iid and dirichlet: 100 unless given; natural: one per document
        partition: str = "iid",
        vocab_size: int | None = None,
        min_count: int = MIN_COUNT,
        max_lines: int | None = None,
        max_eval_lines: int | None = None,
        bptt: int = 35,
        seed: int = 0,
        emb: int | None = None,
        hidden: int | None = None,
        layers: int | None = None,
        corpus: LMCorpus | None = None,
    ) -> None:
        if bptt < 1:
            raise TaskError(f"bptt (--bptt) must be at least 1, got {bptt}")
        self.model_name = model
        self.model_cfg = rnn_config(model, tied, dropout, emb, hidden, layers)
        self.corpus = corpus if corpus is not None else load_corpus(data, max_lines, max_eval_lines)
        self.vocab = Vocabulary.build(self.corpus.lines["train"], vocab_size, min_count)
        self.min_count = min_count
        self.bptt = bptt
        self.seed = seed
        self.partition = PartitionSpec.parse(partition)
        self._stream: torch.Tensor | None = None  # the shuffled lines' tokens, when clients outnumber lines
        self.shards = self._partition(clients)
        self._train_ids: dict[int, torch.Tensor] = {}
        self._eval: dict[str, StreamBatches] = {}

    def _partition(self, clients: int | None) -> list[np.ndarray]:
        n = len(self.corpus.lines["train"])
        p = self.partition
        if p.kind == "iid" and (clients or 100) > n:  # below the line (module docstring)
            perm = np.random.default_rng(self.seed).permutation(n)  # iid_shards' shuffle
            lines = self.corpus.lines["train"]
            self._stream = self.vocab.encode_lines([lines[i] for i in perm])
            assert clients is not None
            if len(self._stream) < clients:
                raise TaskError(
                    f"cannot give {clients} clients a token each: the corpus has {len(self._stream)} "
                    "training tokens; lower clients (--clients) or use more data"
                )
            bounds = np.linspace(0, len(self._stream), clients + 1).round().astype(np.int64)
            return [bounds[i : i + 2] for i in range(clients)]
        if p.kind == "iid":
            return iid_shards(n, clients or 100, self.seed)
        if p.kind == "dirichlet":
            return dirichlet_shards(self.corpus.categories, clients or 100, p.alpha, self.seed)
        if not self.corpus.natural_categories:
            raise TaskError(
                f"partition natural (--partition) needs documents; {self.corpus.name} has none "
                "(add train.docid): use iid or dirichlet:ALPHA"
            )
        shards, _ = natural_shards(self.corpus.categories)
        if clients is not None and clients != len(shards):
            raise TaskError(
                f"partition natural (--partition) gives one client per document ({len(shards)} here) but "
                f"clients (--clients) is {clients}: drop clients or use iid"
            )
        return shards

    # --- Task interface -------------------------------------------------------------------------------------
    def build_model(self, seed: int = 0) -> nn.Module:
        return RNNLanguageModel(len(self.vocab), self.model_cfg, seed)

    _groups: dict[str, str] | None = None

    def groups(self) -> dict[str, str]:
        if self._groups is None:  # built once: it takes a whole model to list the names
            self._groups = {name: "model" for name, _ in self.build_model().named_parameters()}
        return dict(self._groups)

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def client_ids(self, client: int) -> torch.Tensor:
        if not 0 <= client < len(self.shards):
            raise TaskError(
                f"client {client} does not exist: this task has clients 0..{len(self.shards) - 1}"
            )
        if self._stream is not None:  # a few words of the shuffled stream: sliced, not kept
            lo, hi = self.shards[client]
            return self._stream[int(lo) : int(hi)]
        if client not in self._train_ids:
            lines = self.corpus.lines["train"]
            self._train_ids[client] = self.vocab.encode_lines([lines[i] for i in self.shards[client]])
        return self._train_ids[client]

    def train(
        self, model: nn.Module, client: int, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        ids = self.client_ids(client)
        batches = StreamBatches.build(ids, cfg.batch_size, self.vocab.eos)
        bptt = self.bptt

        n_windows = batches.num_windows(bptt)
        counts: dict[int, int] = {}  # real targets of a window, counted on the CPU when first reached
        on_device: dict[torch.device, StreamBatches] = {}

        def epoch(
            m: nn.Module, gen: torch.Generator, device: torch.device
        ) -> Iterator[tuple[torch.Tensor, int]]:
            hidden = m.init_hidden(batches.inputs.size(1), device)
            if device not in on_device:
                on_device[device] = batches.to(device)
            here = on_device[device]
            # a run capped by max_steps covers only part of the shard: start it at a seeded window (the
            # agent's seed differs per round) so successive rounds see the whole shard,
            # not always its beginning; windows are cut as they are reached (one step needs one)
            start = int(torch.randint(n_windows, (1,), generator=gen)) if cfg.max_steps and n_windows else 0
            for i, w in enumerate(itertools.chain(range(start, n_windows), range(start))):
                x, y, mask = here.window(w, bptt)
                if w not in counts:
                    counts[w] = int(batches.window(w, bptt)[2].sum())
                n = counts[w]
                if start and i == n_windows - start:
                    hidden = m.init_hidden(batches.inputs.size(1), device)  # wrapped to the shard's start
                hidden = detach_hidden(hidden)
                logits, hidden = m(x, hidden)
                nll = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="none"
                )
                yield (nll * mask.reshape(-1)).sum() / n, n

        return run_training(model, epoch, n_windows, cfg, client, batches.n_targets, progress)

    def train_cohort(
        self,
        models: list[nn.Module],
        clients: list[int],
        cfgs: list[TrainConfig],
        progress: list[Progress | None],
    ) -> list[TrainResult]:
        """Batched runs (fedmq.tasks.lm_cohort) of as many clients as ``cohort_size`` lets the device hold,
        when their settings allow it and every shard fills the batch's columns (a shorter one has fewer: its
        windows would not stack); otherwise one after the other."""
        if not (
            can_train_together(cfgs)
            and all(self.client_ids(c).numel() >= cfgs[0].batch_size for c in clients)
        ):
            return super().train_cohort(models, clients, cfgs, progress)
        size = cohort_size(len(self.vocab), self.bptt, cfgs[0].batch_size)
        results: list[TrainResult] = []
        for i in range(0, len(models), size):
            part = slice(i, i + size)
            if len(models[part]) > 1:
                results += train_cohort(self, models[part], clients[part], cfgs[part], progress[part])
            else:
                results += super().train_cohort(models[part], clients[part], cfgs[part], progress[part])
        return results

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str = "valid") -> float:
        nll = self.mean_nll(model, split)
        # a diverged model (a mean NLL past exp's range, or NaN) scores inf: no OverflowError, and a NaN would
        # never be beaten as the best validation score
        return math.exp(nll) if nll < 709.0 else math.inf

    @torch.no_grad()
    def mean_nll(self, model: nn.Module, split: str = "valid") -> float:
        """Mean NLL (nats) per target token over the full split."""
        if split not in ("valid", "test", "train"):
            raise TaskError(f"unknown split {split!r}: use valid or test")
        if split not in self._eval:
            ids = self.vocab.encode_lines(self.corpus.lines[split])
            self._eval[split] = StreamBatches.build(ids, EVAL_BATCH, self.vocab.eos)
        device = next(model.parameters()).device
        batches = self._eval[split].to(device)
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        hidden = model.init_hidden(batches.inputs.size(1), device)
        for x, y, mask in batches.windows(self.bptt):
            logits, hidden = model(x, hidden)
            nll = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="none"
            )
            total += (nll * mask.reshape(-1)).sum()
        model.train(was_training)
        return float(total) / batches.n_targets

    def describe(self) -> dict[str, Any]:
        sizes = [len(s) for s in self.shards]
        return {
            "task": self.name,
            "corpus": self.corpus.name,
            "source": self.corpus.source,
            "model": self.model_name,
            "model_config": vars(self.model_cfg)
            if hasattr(self.model_cfg, "__dict__")
            else str(self.model_cfg),
            "vocab_size": len(self.vocab),
            "min_count": self.min_count,
            "train_lines": len(self.corpus.lines["train"]),
            "valid_lines": len(self.corpus.lines["valid"]),
            "test_lines": len(self.corpus.lines["test"]),
            "clients": len(self.shards),
            "partition": str(self.partition),
            "shard_lines_min": min(sizes),
            "shard_lines_max": max(sizes),
            "bptt": self.bptt,
            "shard_seed": self.seed,  # the seed that drew the shards; "seed" in config.json is the job's
        }
