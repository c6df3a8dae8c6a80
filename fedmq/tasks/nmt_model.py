"""Transformer encoder-decoder for translation (pre-norm; sinusoidal positions as a non-persistent buffer).

The encoder and decoder have their own embeddings (so the encoder/decoder groups used by dynamic pulling do
not share a tensor); the decoder's output projection is tied to the decoder embedding (one tensor).
Dropout on residual branches and embeddings uses ``SeededDropout``; attention weights are not dropped.
Pre-norm (LayerNorm before each sub-layer plus a final one) is a choice for stable training on small data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedmq.tasks.dropout import SeededDropout, uniform_
from fedmq.tasks.errors import TaskError
from fedmq.tasks.nmt_data import PAD


@dataclass(frozen=True)
class TransformerConfig:
    layers_enc: int
    layers_dec: int
    d_model: int
    heads: int
    ffn: int
    dropout: float = 0.1
    max_len: int = 256


CONFIGS = {
    "tiny": TransformerConfig(1, 1, 64, 4, 128, 0.1),  # tests
    "mini": TransformerConfig(3, 3, 128, 4, 512, 0.1),  # the nmt-domains experiment's cpu scale (1 CPU core)
    "small": TransformerConfig(3, 3, 256, 4, 1024, 0.1),  # CPU default
    "base": TransformerConfig(6, 6, 512, 8, 2048, 0.1),  # Vaswani et al. / Passban et al.
}


def transformer_config(name: str, dropout: float | None = None, max_len: int = 256) -> TransformerConfig:
    if name not in CONFIGS:
        raise TaskError(f"unknown NMT model {name!r}: use one of {', '.join(CONFIGS)}")
    c = CONFIGS[name]
    d = c.dropout if dropout is None else dropout
    if not 0.0 <= d < 1.0:
        raise TaskError(f"dropout (--dropout) must be in [0, 1), got {d}")
    if max_len < 4:
        raise TaskError(f"max_len must be at least 4, got {max_len}")
    return TransformerConfig(c.layers_enc, c.layers_dec, c.d_model, c.heads, c.ffn, d, max_len)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, d] attends to mem [B, S, d]; mask broadcastable to [B, h, T, S], True = may attend."""
        b, t, d = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k, v = self.kv(mem).view(b, mem.size(1), 2, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.heads)
        self.norm2, self.ff = nn.LayerNorm(c.d_model), FeedForward(c.d_model, c.ffn)
        self.drop = SeededDropout(c.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.drop(self.attn(y, y, mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.norm1, self.self_attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.heads)
        self.norm2, self.cross_attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.heads)
        self.norm3, self.ff = nn.LayerNorm(c.d_model), FeedForward(c.d_model, c.ffn)
        self.drop = SeededDropout(c.dropout)

    def forward(
        self, x: torch.Tensor, mem: torch.Tensor, self_mask: torch.Tensor, mem_mask: torch.Tensor
    ) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.drop(self.self_attn(y, y, self_mask))
        x = x + self.drop(self.cross_attn(self.norm2(x), mem, mem_mask))
        return x + self.drop(self.ff(self.norm3(x)))


class Stack(nn.Module):
    """Embedding + positions + layers + final norm, for one side (encoder or decoder)."""

    def __init__(self, vocab: int, c: TransformerConfig, layer: type[nn.Module], n: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, c.d_model, padding_idx=PAD)
        self.layers = nn.ModuleList(layer(c) for _ in range(n))
        self.norm = nn.LayerNorm(c.d_model)
        self.drop = SeededDropout(c.dropout)
        self.scale = math.sqrt(c.d_model)
        self.register_buffer("positions", sinusoids(c.max_len, c.d_model), persistent=False)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.size(1) > self.positions.size(0):
            raise TaskError(f"sequence of {ids.size(1)} tokens exceeds max_len {self.positions.size(0)}")
        return self.drop(self.embed(ids) * self.scale + self.positions[: ids.size(1)])


def sinusoids(length: int, d: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class TransformerNMT(nn.Module):
    def __init__(self, vocab_size: int, c: TransformerConfig, seed: int = 0) -> None:
        super().__init__()
        if c.d_model % c.heads:
            raise TaskError(f"d_model {c.d_model} is not divisible by {c.heads} heads")
        self.cfg = c
        self.encoder = Stack(vocab_size, c, EncoderLayer, c.layers_enc)
        self.decoder = Stack(vocab_size, c, DecoderLayer, c.layers_dec)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("embed.weight"):
                uniform_(p, math.sqrt(3.0 / self.cfg.d_model), g)  # std d^-1/2, as fairseq's normal init
                with torch.no_grad():
                    p[PAD].zero_()
            elif p.dim() == 2:  # xavier uniform
                uniform_(p, math.sqrt(6.0 / (p.size(0) + p.size(1))), g)
            elif "norm" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src [B, S] -> memory [B, S, d] and its key mask [B, 1, 1, S] (True = real token)."""
        mask = (src != PAD)[:, None, None, :]
        x = self.encoder.embed_tokens(src)
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.encoder.norm(x), mask

    def decode(self, tgt_in: torch.Tensor, mem: torch.Tensor, mem_mask: torch.Tensor) -> torch.Tensor:
        """tgt_in [B, T] -> logits [B, T, V] (causal; output projection tied to the decoder embedding)."""
        t = tgt_in.size(1)
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).tril()[None, None]
        x = self.decoder.embed_tokens(tgt_in)
        for layer in self.decoder.layers:
            x = layer(x, mem, causal, mem_mask)
        return F.linear(self.decoder.norm(x), self.decoder.embed.weight)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        mem, mask = self.encode(src)
        return self.decode(tgt_in, mem, mask)
