"""The translation task read domain by domain: the pre-training pairs, a warm-started task, and each
domain's BLEU and cross-entropy."""

from __future__ import annotations

from typing import Any

import torch

from fedmq.tasks.base import Task, load_state
from fedmq.tasks.corpora import corpus_dir


def pretrain_pairs(task: Any, domains: list[str], max_lines: int) -> list[Any]:
    """The pre-training pairs: every pair of ``domains`` (the first ``max_lines`` lines of each, 0 = all)
    whose source sentence is not in any valid or test split of ``task``
    (so no evaluated sentence is trained on)."""
    from fedmq.tasks.nmt_data import load_parallel

    held = {p.src for split in ("valid", "test") for p in task.corpus.splits[split]}
    corpus = load_parallel(str(corpus_dir("de-en")), domains, max_lines or None)
    return [p for split in ("train", "valid", "test") for p in corpus.splits[split] if p.src not in held]


class WarmStartTask:
    """A task whose ``build_model`` starts from a given state (the pre-trained model); all else delegated."""

    def __init__(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        self._task = task
        self._state = state

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        model = self._task.build_model(seed)
        load_state(model, self._state)
        return model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def domain_pairs(task: Any, domain: str, split: str = "test", per_domain: int = 0) -> list[Any]:
    """The pairs of ``domain`` a model is scored on: the first ``per_domain`` of its ``split`` (0 = all)."""
    pairs = [p for p in task.corpus.splits[split] if p.domain == domain]
    return pairs[:per_domain] if per_domain else pairs


def domain_bleu(
    task: Any, model: torch.nn.Module, split: str = "test", per_domain: int = 0
) -> dict[str, float]:
    """BLEU of ``model`` on each domain's ``split`` pairs (the first ``per_domain`` of each; 0 = all)."""
    from fedmq.tasks.nmt import corpus_bleu

    scores = {}
    for domain in task.corpus.domains:
        pairs = domain_pairs(task, domain, split, per_domain)
        hyps = task.translate(model, [p.src for p in pairs])
        scores[domain] = corpus_bleu(hyps, [p.tgt for p in pairs])
    return scores


def domain_ce(
    task: Any, model: torch.nn.Module, split: str = "test", per_domain: int = 0
) -> dict[str, float]:
    """Cross-entropy (nats per reference token, teacher forcing) of ``model`` on each domain's ``split``
    pairs."""
    return {
        domain: task.cross_entropy(model, domain_pairs(task, domain, split, per_domain))
        for domain in task.corpus.domains
    }
