"""German->English translation task (Passban et al. setting): Transformer, shared BPE, BLEU by sacrebleu.

Clients: ``natural`` = one domain per client (or, for a single domain with ``X.docid`` files, one document per
client); ``iid`` / ``dirichlet:ALPHA`` over the pooled training pairs (Dirichlet categories = domains, or
docids for a single domain). n_samples = the client's sentence pairs. Training: teacher forcing, cross-entropy
with label smoothing over target tokens (padding ignored); batch_size = sentence pairs per batch, batched by
length. BLEU: sacrebleu ``corpus_bleu`` on the sentencepiece-decoded hypotheses against the raw references, on
the first ``eval_max_sentences`` pairs of the split (round-robin over domains; default 200,
0 = the full split).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import sacrebleu
import torch
import torch.nn.functional as F
from torch import nn

from fedmq.tasks.base import Progress, Task, TrainConfig, TrainResult
from fedmq.tasks.errors import TaskError
from fedmq.tasks.nmt_data import (
    PAD,
    EncodedPairs,
    Pair,
    SubwordVocab,
    batches_by_length,
    collate,
    load_parallel,
    pad,
)
from fedmq.tasks.nmt_decode import beam_search, greedy
from fedmq.tasks.nmt_model import TransformerNMT, transformer_config
from fedmq.tasks.partition import PartitionSpec, dirichlet_shards, iid_shards, natural_shards
from fedmq.tasks.training import run_training


class TranslationTask(Task):
    name = "nmt"
    metric = "bleu"
    higher_is_better = True

    def __init__(
        self,
        data: str | Path,
        model: str = "small",
        clients: int | None = None,
        partition: str = "natural",
        domains: list[str] | None = None,
        vocab_size: int = 8000,
        max_lines: int | None = None,
        dropout: float | None = None,
        label_smoothing: float = 0.1,
        max_len: int = 128,
        eval_max_sentences: int = 200,
        beam: int = 1,
        eval_batch: int = 50,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        eval_fraction: float = 0.05,
    ) -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise TaskError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if eval_max_sentences < 0 or beam < 1 or eval_batch < 1:
            raise TaskError("eval_max_sentences must be >= 0, beam and eval_batch >= 1")
        self.model_name = model
        self.model_cfg = transformer_config(model, dropout, max_len + 2)
        self.max_len = max_len
        self.corpus = load_parallel(data, domains, max_lines, eval_fraction)
        train = self.corpus.splits["train"]
        self.vocab = SubwordVocab.train_or_load(
            [p.src for p in train] + [p.tgt for p in train], vocab_size, cache_dir
        )
        self.label_smoothing = label_smoothing
        self.eval_max_sentences = eval_max_sentences
        self.beam = beam
        self.eval_batch = eval_batch
        self.seed = seed
        self.partition = PartitionSpec.parse(partition)
        self.shards, self.shard_names = self._partition(clients)
        self._encoded: dict[int, EncodedPairs] = {}
        self._eval_pairs: dict[str, list[Pair]] = {}

    def _partition(self, clients: int | None) -> tuple[list[np.ndarray], list[str]]:
        train = self.corpus.splits["train"]
        multi = len(self.corpus.domains) > 1
        cats = [p.domain if multi else p.docid for p in train]
        kind = self.partition.kind
        if kind == "natural":
            shards, names = natural_shards(cats)
            if clients is not None and clients != len(shards):
                raise TaskError(
                    "partition natural (--partition) gives one client per "
                    f"{'domain' if multi else 'document'} ({len(shards)} here) but clients (--clients) is "
                    f"{clients}: drop clients or use iid"
                )
            return shards, names
        k = clients if clients is not None else max(1, len(self.corpus.domains))
        if kind == "iid":
            shards = iid_shards(len(train), k, self.seed)
        else:
            shards = dirichlet_shards(cats, k, self.partition.alpha, self.seed)
        return shards, [f"client-{i}" for i in range(k)]

    def build_model(self, seed: int = 0) -> nn.Module:
        return TransformerNMT(len(self.vocab), self.model_cfg, seed)

    _groups: dict[str, str] | None = None

    def groups(self) -> dict[str, str]:
        if self._groups is None:  # built once: it takes a whole model to list the names
            self._groups = {name: name.split(".", 1)[0] for name, _ in self.build_model().named_parameters()}
        return dict(self._groups)

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def client_data(self, client: int) -> EncodedPairs:
        if not 0 <= client < len(self.shards):
            raise TaskError(
                f"client {client} does not exist: this task has clients 0..{len(self.shards) - 1}"
            )
        if client not in self._encoded:
            train = self.corpus.splits["train"]
            self._encoded[client] = self._encode_truncated([train[i] for i in self.shards[client]])
        return self._encoded[client]

    def _encode_truncated(self, pairs: list[Pair]) -> EncodedPairs:
        """Both sides encoded with the task's vocabulary, each cut at ``max_len`` subwords."""
        return EncodedPairs(
            self.vocab.encode([p.src for p in pairs], self.max_len),
            self.vocab.encode([p.tgt for p in pairs], self.max_len),
        )

    def train(
        self, model: nn.Module, client: int, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        data = self.client_data(client)
        steps = -(-len(data) // cfg.batch_size) if cfg.batch_size > 0 else 0
        return run_training(
            model, self._epoch_fn(data, cfg.batch_size), steps, cfg, client, len(data), progress
        )

    def _epoch_fn(self, data: EncodedPairs, batch_size: int):
        """One epoch over ``data`` in length-bucketed batches, for :func:`run_training`."""

        def epoch(
            m: nn.Module, gen: torch.Generator, device: torch.device
        ) -> Iterator[tuple[torch.Tensor, int]]:
            for idx in batches_by_length(data, batch_size, gen):
                yield self._loss(m, data, idx, device)

        return epoch

    def _loss(
        self,
        m: nn.Module,
        data: EncodedPairs,
        idx: list[int],
        device: torch.device,
        smoothing: float | None = None,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, int]:
        """Cross-entropy over the batch's target tokens (label-smoothed by the task's ``label_smoothing``
        unless ``smoothing`` is given; their mean, or with ``reduction`` "sum" their sum),
        and their number."""
        src, tin, tout = (t.to(device) for t in collate(data, idx))
        logits = m(src, tin)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            tout.reshape(-1),
            ignore_index=PAD,
            label_smoothing=self.label_smoothing if smoothing is None else smoothing,
            reduction=reduction,
        )
        return loss, int((tout != PAD).sum())

    def encode_pairs(self, pairs: list[Pair]) -> EncodedPairs:
        """Encode pairs with the task's vocabulary, skipping those longer than ``max_len - 1`` subwords on
        either side (not truncating them: a truncated source and target no longer translate each other)."""
        src, tgt = self.vocab.sp.encode([p.src for p in pairs]), self.vocab.sp.encode([p.tgt for p in pairs])
        keep = [
            i for i in range(len(pairs)) if 0 < len(src[i]) < self.max_len and 0 < len(tgt[i]) < self.max_len
        ]
        return EncodedPairs([src[i] for i in keep], [tgt[i] for i in keep])

    def pretrain(
        self, model: nn.Module, data: EncodedPairs, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        """Train ``model`` on ``data`` -- e.g. a pre-training corpus outside the clients' shards -- for
        exactly ``cfg.max_steps`` steps (as many epochs as that takes),
        with the shared loop and batching of ``train``."""
        if cfg.max_steps < 1:
            raise TaskError(f"pre-training needs max_steps >= 1, got {cfg.max_steps}")
        if len(data) == 0:
            raise TaskError(f"no pre-training pairs of at most {self.max_len - 1} subwords per side")
        steps = -(-len(data) // cfg.batch_size) if cfg.batch_size > 0 else 0
        epochs = -(-cfg.max_steps // steps) if steps else 1
        return run_training(
            model,
            self._epoch_fn(data, cfg.batch_size),
            steps,
            replace(cfg, epochs=epochs),
            0,
            len(data),
            progress,
        )

    def eval_pairs(self, split: str) -> list[Pair]:
        if split not in ("valid", "test"):
            raise TaskError(f"unknown split {split!r}: use valid or test")
        if split not in self._eval_pairs:
            pairs = self.corpus.splits[split]
            cap = self.eval_max_sentences
            if cap and cap < len(pairs):
                by_domain = [[p for p in pairs if p.domain == d] for d in self.corpus.domains]
                picked: list[Pair] = []
                for i in range(max(len(b) for b in by_domain)):
                    picked.extend(b[i] for b in by_domain if i < len(b))
                pairs = picked[:cap]
            self._eval_pairs[split] = pairs
        return self._eval_pairs[split]

    @torch.no_grad()
    def translate(self, model: nn.Module, sources: list[str], beam: int | None = None) -> list[str]:
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        ids = self.vocab.encode(sources, self.max_len)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[str] = [""] * len(ids)
        beam = self.beam if beam is None else beam
        for start in range(0, len(order), self.eval_batch):
            idx = order[start : start + self.eval_batch]
            src = pad([ids[i] + [3] for i in idx]).to(device)
            hyps = greedy(model, src) if beam == 1 else beam_search(model, src, beam)
            for i, text in zip(idx, self.vocab.decode(hyps)):
                out[i] = text
        model.train(was_training)
        return out

    @torch.no_grad()
    def cross_entropy(self, model: nn.Module, pairs: list[Pair]) -> float:
        """Mean cross-entropy (nats) per reference target token of ``pairs`` under teacher forcing, without
        label smoothing; exp() of it is the perplexity. Unlike BLEU of greedy output it does not depend on
        decoding, so it still ranks models whose translations are too poor for BLEU to
        (docs/results/nmt-domains.md)."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        data = self._encode_truncated(pairs)
        total, tokens = 0.0, 0
        for start in range(0, len(data), self.eval_batch):
            idx = list(range(start, min(start + self.eval_batch, len(data))))
            loss, n = self._loss(model, data, idx, device, smoothing=0.0, reduction="sum")
            total, tokens = total + float(loss), tokens + n
        model.train(was_training)
        return total / max(tokens, 1)

    def evaluate(self, model: nn.Module, split: str = "valid") -> float:
        pairs = self.eval_pairs(split)
        hyps = self.translate(model, [p.src for p in pairs])
        return corpus_bleu(hyps, [p.tgt for p in pairs])

    def describe(self) -> dict[str, Any]:
        sizes = [len(s) for s in self.shards]
        return {
            "task": self.name,
            "source": self.corpus.source,
            "domains": self.corpus.domains,
            "model": self.model_name,
            "model_config": vars(self.model_cfg),
            "vocab_size": len(self.vocab),
            "train_pairs": len(self.corpus.splits["train"]),
            "valid_pairs": len(self.corpus.splits["valid"]),
            "test_pairs": len(self.corpus.splits["test"]),
            "eval_max_sentences": self.eval_max_sentences,
            "beam": self.beam,
            "clients": len(self.shards),
            "client_names": self.shard_names,
            "partition": str(self.partition),
            "shard_pairs_min": min(sizes),
            "shard_pairs_max": max(sizes),
            "shard_seed": self.seed,  # the seed that drew the shards; "seed" in config.json is the job's
        }


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu corpus BLEU (13a tokenisation) of detokenised hypotheses against one reference each."""
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)
