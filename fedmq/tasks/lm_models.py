"""Word-level RNN language models: FedAtt's GRU (small/medium/large) and FedMed's 2-layer LSTM.

Layers are stacked single-layer RNNs with ``SeededDropout`` between them (dropout after the embedding, between
layers and before the decoder, as in pytorch/examples), so dropout is reproducible per seed. Tied weights make
``decoder.weight`` the same Parameter as ``encoder.weight``:
the federated state holds it once (``encoder.weight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.tasks.dropout import SeededDropout, uniform_
from fedmq.tasks.errors import TaskError


@dataclass(frozen=True)
class RNNConfig:
    cell: str  # "gru" | "lstm"
    emb: int
    hidden: int
    layers: int
    tied: bool
    dropout: float


# name -> (cell, embedding, hidden, layers, tied by default)
PRESETS: dict[str, tuple[str, int, int, int, bool]] = {
    "gru-tiny": ("gru", 128, 128, 1, True),  # CPU scale (simulate on the builtin corpus), not from the papers
    "gru-small": ("gru", 300, 300, 1, True),
    "gru-medium": ("gru", 650, 650, 1, True),
    "gru-large": ("gru", 1500, 1500, 1, True),
    "lstm": ("lstm", 300, 400, 2, False),
}


def rnn_config(
    model: str,
    tied: bool | None = None,
    dropout: float = 0.2,
    emb: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
) -> RNNConfig:
    if model not in PRESETS:
        raise TaskError(f"unknown LM model {model!r}: use one of {', '.join(PRESETS)}")
    cell, e, h, n, tied_default = PRESETS[model]
    cfg = RNNConfig(cell, emb or e, hidden or h, layers or n, tied_default if tied is None else tied, dropout)
    if min(cfg.emb, cfg.hidden, cfg.layers) < 1:
        raise TaskError(
            f"model sizes must be positive, got embedding {cfg.emb}, hidden {cfg.hidden}, layers {cfg.layers}"
        )
    if not 0.0 <= dropout < 1.0:
        raise TaskError(f"dropout (--dropout) must be in [0, 1), got {dropout}")
    if cfg.tied and cfg.emb != cfg.hidden:
        raise TaskError(
            f"tied (--tied) needs embedding size == hidden size; {model} has {cfg.emb} and {cfg.hidden}: "
            "use --untied"
        )
    return cfg


class RNNLanguageModel(nn.Module):
    def __init__(self, vocab_size: int, cfg: RNNConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        rnn = nn.GRU if cfg.cell == "gru" else nn.LSTM
        self.encoder = nn.Embedding(vocab_size, cfg.emb)
        sizes = [cfg.emb] + [cfg.hidden] * cfg.layers
        self.rnn = nn.ModuleList(rnn(sizes[i], sizes[i + 1]) for i in range(cfg.layers))
        self.drop = SeededDropout(cfg.dropout)
        self.decoder = nn.Linear(cfg.hidden, vocab_size)
        if cfg.tied:
            self.decoder.weight = self.encoder.weight
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        uniform_(self.encoder.weight, 0.1, g)
        if not self.cfg.tied:
            uniform_(self.decoder.weight, 0.1, g)
        nn.init.zeros_(self.decoder.bias)
        bound = 1.0 / math.sqrt(self.cfg.hidden)
        for layer in self.rnn:
            for p in layer.parameters():
                uniform_(p, bound, g)

    def init_hidden(self, batch: int, device: torch.device | str = "cpu") -> list:
        z = lambda: torch.zeros(1, batch, self.cfg.hidden, device=device)  # noqa: E731
        return [(z(), z()) if self.cfg.cell == "lstm" else z() for _ in self.rnn]

    def forward(self, x: torch.Tensor, hidden: list) -> tuple[torch.Tensor, list]:
        """x: [T, B] token ids -> logits [T, B, V] and the new hidden state."""
        out = self.drop(self.encoder(x))
        new_hidden = []
        for layer, h in zip(self.rnn, hidden):
            out, h = layer(out, h)
            out = self.drop(out)
            new_hidden.append(h)
        return self.decoder(out), new_hidden


def detach_hidden(hidden: list) -> list:
    return [tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach() for h in hidden]
