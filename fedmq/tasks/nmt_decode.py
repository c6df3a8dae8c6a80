"""Greedy and beam-search decoding for ``TransformerNMT``
(the decoder is re-run over the prefix each step)."""

from __future__ import annotations

import torch

from fedmq.tasks.nmt_data import BOS, EOS, PAD
from fedmq.tasks.nmt_model import TransformerNMT


def _next_logits(
    model: TransformerNMT, seqs: torch.Tensor, mem: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Last-position logits with PAD and BOS forbidden (never valid outputs)."""
    logits = model.decode(seqs, mem, mask)[:, -1].float()
    logits[:, PAD] = float("-inf")
    logits[:, BOS] = float("-inf")
    return logits


def max_output_len(src: torch.Tensor, model: TransformerNMT) -> int:
    src_len = int((src != PAD).sum(1).max())
    return min(model.cfg.max_len - 1, int(src_len * 1.5) + 10)


@torch.no_grad()
def greedy(model: TransformerNMT, src: torch.Tensor) -> list[list[int]]:
    """src [B, S] -> one id list per sentence (no bos/eos)."""
    mem, mask = model.encode(src)
    b = src.size(0)
    out = torch.full((b, 1), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    for _ in range(max_output_len(src, model)):
        nxt = _next_logits(model, out, mem, mask).argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        out = torch.cat([out, nxt[:, None]], 1)
        done |= nxt == EOS
        if bool(done.all()):
            break
    return [_strip(row) for row in out[:, 1:].tolist()]


@torch.no_grad()
def beam_search(
    model: TransformerNMT, src: torch.Tensor, beam: int = 4, length_penalty: float = 1.0
) -> list[list[int]]:
    """Batched beam search; hypotheses ranked by log-prob / length**length_penalty."""
    if beam <= 1:
        return greedy(model, src)
    mem, mask = model.encode(src)
    b, dev = src.size(0), src.device
    mem = mem.repeat_interleave(beam, 0)
    mask = mask.repeat_interleave(beam, 0)
    seqs = torch.full((b * beam, 1), BOS, dtype=torch.long, device=dev)
    scores = torch.zeros(b, beam, device=dev)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    for step in range(max_output_len(src, model)):
        logp = _next_logits(model, seqs, mem, mask).log_softmax(-1)  # [b*beam, V]
        v = logp.size(-1)
        total = (scores.view(-1, 1) + logp).view(b, beam * v)
        top, idx = total.topk(2 * beam, dim=1)
        origin, token = idx // v, idx % v
        new_scores = torch.full((b, beam), float("-inf"), device=dev)
        rows = torch.zeros(b, beam, dtype=torch.long, device=dev)
        toks = torch.full((b, beam), PAD, dtype=torch.long, device=dev)
        for i in range(b):
            if not alive[i]:
                continue
            k = 0
            for j in range(2 * beam):
                s, o, t = float(top[i, j]), int(origin[i, j]), int(token[i, j])
                if s == float("-inf"):
                    break
                if t == EOS:
                    hyp = seqs[i * beam + o, 1:].tolist()
                    finished[i].append((s / (len(hyp) + 1) ** length_penalty, hyp))
                    continue
                rows[i, k], toks[i, k], new_scores[i, k] = i * beam + o, t, s
                k += 1
                if k == beam:
                    break
            best_alive = float(new_scores[i].max()) / (step + 2) ** length_penalty
            if len(finished[i]) >= beam and max(f[0] for f in finished[i]) >= best_alive:
                alive[i] = False
        seqs = torch.cat([seqs[rows.view(-1)], toks.view(-1, 1)], 1)
        scores = new_scores
        if not bool(alive.any()):
            break
    results = []
    for i in range(b):
        if finished[i]:
            results.append(max(finished[i], key=lambda f: f[0])[1])
        else:
            j = int(scores[i].argmax())
            results.append(_strip(seqs[i * beam + j, 1:].tolist()))
    return results


def _strip(ids: list[int]) -> list[int]:
    out = []
    for t in ids:
        if t in (EOS, PAD):
            break
        out.append(t)
    return out
