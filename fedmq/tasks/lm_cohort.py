"""Local training of several LM clients at once: one batched copy of the RNN per client (a "cohort").

A GRU client's step (batch 10, 300 units) is far too small to keep a GPU busy, so at the paper scale a round
of 10-50 clients trained one after the other costs 10-50 latency-bound passes. Here the clients' parameters are
stacked along a leading client axis and every matrix product is a batched one (``bmm``): one pass trains them
all. Each client still trains exactly as ``LanguageModelTask.train`` would train it alone — its own shard and
windows, its own dropout masks drawn from its own generator in the same order, its own SGD-momentum buffer,
clipping norm and step count (a client whose shard has fewer windows simply stops stepping) — so the result
equals the sequential one up to float summation order (tests/unit/test_lm_cohort.py checks it).

The recurrences are written out (PyTorch's GRU and LSTM equations, weight layouts and gate order), since
``nn.GRU`` has no batched-weights form; time steps run in a Python loop, one batched cell step each.
Supported: SGD with or without momentum, per-epoch lr decay, clipping, a step cap with a seeded start window,
FedSGD's full-batch step and FedMed's tail loss. Anything else (Adam, warm-up, AMP) is trained one client after
the other by the caller.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedmq.tasks.base import Progress, TrainConfig, TrainResult
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm_data import StreamBatches
from fedmq.tasks.training import check_config, resolve_device

if TYPE_CHECKING:
    from fedmq.tasks.lm import LanguageModelTask


def can_train_together(cfgs: list[TrainConfig]) -> bool:
    """Whether these clients' runs can be one batched run: the same settings (seeds aside) and a regime the
    batched loop implements."""
    first = dataclasses.replace(cfgs[0], seed=0)
    return (all(dataclasses.replace(c, seed=0) == first for c in cfgs) and first.optimizer == "sgd"
            and not first.amp and not first.warmup_steps and not first.linear_decay)


@dataclass
class _Client:
    """One client's data and counters within the cohort."""

    batches: StreamBatches  # on the training device
    counts: list[int]  # real targets in each window
    cfg: TrainConfig
    client: int
    progress: Progress | None
    total: int = 0  # optimizer steps this run takes
    steps: int = 0
    tokens: int = 0

    @property
    def n_windows(self) -> int:
        return len(self.counts)


class _Stacked:
    """The cohort's parameters, ``[clients, *shape]`` leaves named as in the model, and its forward pass."""

    def __init__(self, models: list[nn.Module], device: torch.device) -> None:
        self.cfg = models[0].cfg
        self.names = [name for name, _ in models[0].named_parameters()]
        per_model = [dict(m.named_parameters()) for m in models]
        self.params = {name: torch.stack([p[name].detach() for p in per_model]).to(device).requires_grad_()
                       for name in self.names}

    def write_back(self, models: list[nn.Module]) -> None:
        with torch.no_grad():
            for i, model in enumerate(models):
                for name, p in model.named_parameters():
                    p.copy_(self.params[name][i])

    def init_hidden(self, clients: int, batch: int, device: torch.device) -> list:
        z = lambda: torch.zeros(clients, batch, self.cfg.hidden, device=device)  # noqa: E731
        return [(z(), z()) if self.cfg.cell == "lstm" else z() for _ in range(self.cfg.layers)]

    def forward(self, x: torch.Tensor, hidden: list, drop: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, list]:
        """x: [C, T, B] token ids -> logits [C, T, B, V] and the new hidden state; ``drop`` is the dropout,
        applied where RNNLanguageModel applies it (after the embedding and after every layer)."""
        p = self.params
        clients = torch.arange(x.size(0), device=x.device)[:, None, None]
        out = drop(p["encoder.weight"][clients, x])  # each client's own embedding
        new_hidden = []
        for i, h in enumerate(hidden):
            w = lambda kind: p[f"rnn.{i}.{kind}_l0"]  # noqa: E731
            step = _gru_step if self.cfg.cell == "gru" else _lstm_step
            out, h = _layer(out, h, w("weight_ih"), w("weight_hh"), w("bias_ih"), w("bias_hh"), step)
            out = drop(out)
            new_hidden.append(h)
        c, t, b, d = out.shape
        decoder = p["encoder.weight"] if self.cfg.tied else p["decoder.weight"]
        logits = torch.baddbmm(p["decoder.bias"][:, None, :], out.reshape(c, t * b, d), decoder.transpose(1, 2))
        return logits.view(c, t, b, -1), new_hidden


def _layer(x: torch.Tensor, h, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor, b_hh: torch.Tensor,
           step: Callable) -> tuple[torch.Tensor, object]:
    """One recurrent layer over [C, T, B, I]: the input projection of every time step at once, then the cell."""
    c, t, b, i = x.shape
    gates_x = torch.baddbmm(b_ih[:, None, :], x.reshape(c, t * b, i), w_ih.transpose(1, 2)).view(c, t, b, -1)
    w_hh_t, b_hh = w_hh.transpose(1, 2), b_hh[:, None, :]
    outs = []
    for s in range(t):
        h_prev = h[0] if isinstance(h, tuple) else h
        h = step(gates_x[:, s], torch.baddbmm(b_hh, h_prev, w_hh_t), h)
        outs.append(h[0] if isinstance(h, tuple) else h)
    return torch.stack(outs, 1), h


def _gru_step(gx: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """PyTorch's GRU: r, z, n gates in that order; h' = (h - n) * z + n."""
    x_r, x_z, x_n = gx.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r = torch.sigmoid(h_r + x_r)
    z = torch.sigmoid(h_z + x_z)
    n = torch.tanh(x_n + h_n * r)
    return (h - n) * z + n


def _lstm_step(gx: torch.Tensor, gh: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's LSTM: i, f, g, o gates in that order."""
    i, f, g, o = (gh + gx).chunk(4, -1)
    c = torch.sigmoid(f) * hc[1] + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class _Dropout:
    """Each client's masks from its own generator, drawn in the order and shape its lone run would draw them
    (SeededDropout: ``x * keep / (1 - p)``); clients outside the window (``lengths`` 0) draw nothing."""

    def __init__(self, p: float, generators: list[torch.Generator | None], lengths: list[int]) -> None:
        self.p, self.generators, self.lengths = p, generators, lengths

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0:
            return x
        keep = torch.ones_like(x)
        for c, (gen, length) in enumerate(zip(self.generators, self.lengths)):
            if length:
                keep[c, :length].bernoulli_(1.0 - self.p, generator=gen)
        return x * keep / (1.0 - self.p)


def _no_dropout(x: torch.Tensor) -> torch.Tensor:
    return x


def train_cohort(task: "LanguageModelTask", models: list[nn.Module], clients: list[int], cfgs: list[TrainConfig],
                 progress: list[Progress | None]) -> list[TrainResult]:
    """Train ``models[i]`` in place on client ``clients[i]``'s shard, all at once (``can_train_together``)."""
    cfg = cfgs[0]
    check_config(cfg)
    if cfg.lr <= 0:
        raise TaskError(f"--lr must be positive, got {cfg.lr}")
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    cohort = []
    for model, client, c, prog in zip(models, clients, cfgs, progress):
        batches = StreamBatches.build(task.client_ids(client), c.batch_size, task.vocab.eos)
        member = _Client(batches.to(device), batches.window_targets(task.bptt), c, client, prog)
        member.total = (1 if c.full_batch else member.n_windows) * c.epochs
        if c.max_steps:
            member.total = min(member.total, c.max_steps)
        cohort.append(member)
    net = _Stacked(models, device)
    buffers = {name: torch.zeros_like(p) for name, p in net.params.items()} if cfg.momentum else {}
    loss_sum = torch.zeros(len(cohort), dtype=torch.float64, device=device)  # summed on the device: no sync a step
    for epoch in range(cfg.epochs):
        if all(m.steps >= m.total for m in cohort):
            break
        seeds = [(m.cfg.seed * 1_000_003 + m.client * 7_919 + epoch) % (2**63) for m in cohort]
        _epoch(net, cohort, seeds, cfg.lr * cfg.lr_decay**epoch, buffers, loss_sum, device, task.bptt,
               task.model_cfg.dropout)
    tails = _tail_losses(net, cohort, device, task.bptt) if cfg.tail_loss else [None] * len(cohort)
    net.write_back(models)
    seconds = time.perf_counter() - t0
    return [TrainResult(loss=total / m.tokens if m.tokens else float("nan"), n_samples=m.batches.n_targets,
                        steps=m.steps, tokens=m.tokens, seconds=seconds, tail_loss=tail)
            for m, total, tail in zip(cohort, loss_sum.tolist(), tails)]


def _order(members: list[_Client], gens: list[torch.Generator], capped: bool) -> list[list[int]]:
    """Each client's window order for an epoch: from a seeded start window when the step cap is on (as
    LanguageModelTask.train: the draw comes first from the epoch's generator), else from the first."""
    orders = []
    for m, gen in zip(members, gens):
        n = m.n_windows
        start = int(torch.randint(n, (1,), generator=gen)) if capped and n else 0
        orders.append(list(range(start, n)) + list(range(start)))
    return orders


def _window(members: list[_Client], orders: list[list[int]], w: int, live: list[bool], bptt: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Window ``w`` of every client's order, padded to a common length: inputs, targets, mask [C, T, B] and each
    client's real length (0: not in this step)."""
    lengths, slices = [], []
    for m, order, on in zip(members, orders, live):
        if on and w < len(order):
            start = order[w] * bptt
            piece = (m.batches.inputs[start:start + bptt], m.batches.targets[start:start + bptt],
                     m.batches.mask[start:start + bptt])
            lengths.append(piece[0].size(0))
            slices.append(piece)
        else:
            lengths.append(0)
            slices.append(None)
    t = max(lengths)
    cols = members[0].batches.inputs.size(1)
    x = torch.zeros(len(members), t, cols, dtype=torch.long, device=device)
    y = torch.zeros_like(x)
    mask = torch.zeros(len(members), t, cols, dtype=torch.bool, device=device)
    for c, piece in enumerate(slices):
        if piece is not None:
            n = lengths[c]
            x[c, :n], y[c, :n], mask[c, :n] = piece
    return x, y, mask, lengths


def _nll(net: _Stacked, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, hidden: list, drop
         ) -> tuple[torch.Tensor, list]:
    """Summed NLL of each client's real targets [C] and the new hidden state."""
    logits, hidden = net.forward(x, hidden, drop)
    c = x.size(0)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="none")
    return (nll.view(c, -1) * mask.view(c, -1)).sum(1), hidden


def _detach(hidden: list) -> list:
    return [tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach() for h in hidden]


def _reset(hidden: list, keep: torch.Tensor) -> list:
    """Zero the hidden state of the clients where ``keep`` [C] is 0."""
    k = keep[:, None, None]
    return [tuple(t * k for t in h) if isinstance(h, tuple) else h * k for h in hidden]


def _epoch(net: _Stacked, members: list[_Client], seeds: list[int], lr: float, buffers: dict, loss_sum: torch.Tensor,
           device: torch.device, bptt: int, p_drop: float) -> None:
    cfg = members[0].cfg
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    drop_gens = [torch.Generator(device=device).manual_seed(s) for s in seeds] if device.type == "cuda" else gens
    live = [m.steps < m.total for m in members]
    orders = _order(members, gens, bool(cfg.max_steps))
    cols = members[0].batches.inputs.size(1)
    hidden = net.init_hidden(len(members), cols, device)
    c_all = len(members)
    if cfg.full_batch:
        for name, p in net.params.items():
            p.grad = None
        seen = [0] * c_all
    for w in range(max(len(o) for o in orders)):
        if not cfg.full_batch:
            live = [on and m.steps < m.total for on, m in zip(live, members)]
        if not any(live):
            break
        x, y, mask, lengths = _window(members, orders, w, live, bptt, device)
        # a capped run that wrapped to its shard's start begins it with a fresh hidden state, as alone
        wrapped = [bool(n) and w > 0 and orders[c][w] == 0 for c, n in enumerate(lengths)]
        hidden = _detach(hidden)
        if any(wrapped):
            hidden = _reset(hidden, torch.tensor([0.0 if f else 1.0 for f in wrapped], device=device))
        drop = _Dropout(p_drop, drop_gens, lengths)
        sums, hidden = _nll(net, x, y, mask, hidden, drop)
        counts = [members[c].counts[orders[c][w]] if n else 0 for c, n in enumerate(lengths)]
        n_t = torch.tensor([max(n, 1) for n in counts], dtype=sums.dtype, device=device)
        active = torch.tensor([1.0 if n else 0.0 for n in lengths], dtype=sums.dtype, device=device)
        if cfg.full_batch:
            sums.sum().backward()  # each client's summed NLL: its gradient is divided by its token count below
        else:
            ((sums / n_t) * active).sum().backward()
        loss_sum += (sums.detach() / n_t).double() * torch.tensor(counts, dtype=torch.float64, device=device)
        for c, n in enumerate(counts):
            members[c].tokens += n
            if cfg.full_batch:
                seen[c] += n
        if not cfg.full_batch:
            _sgd_step(net, buffers, lr, cfg, active)
            for c, m in enumerate(members):
                if lengths[c]:
                    m.steps += 1
                    if m.progress is not None:
                        m.progress(m.steps, m.total)
    if cfg.full_batch:
        took = torch.tensor([1.0 if s else 0.0 for s in seen], device=device)
        scale = torch.tensor([1.0 / s if s else 0.0 for s in seen], device=device)
        for p in net.params.values():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *[1] * (p.dim() - 1)).to(p.grad.dtype))
        _sgd_step(net, buffers, lr, cfg, took)
        for c, m in enumerate(members):
            if seen[c]:
                m.steps += 1
                if m.progress is not None:
                    m.progress(m.steps, m.total)


def _sgd_step(net: _Stacked, buffers: dict, lr: float, cfg: TrainConfig, active: torch.Tensor) -> None:
    """torch.optim.SGD (momentum, no dampening) for the clients where ``active`` [C] is 1; the others keep their
    parameters and momentum. Clipping, when on, scales each client's gradient by its own total norm."""
    grads = {name: p.grad for name, p in net.params.items() if p.grad is not None}
    with torch.no_grad():
        if cfg.clip > 0:
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
            coef = torch.clamp(cfg.clip / (norms + 1e-6), max=1.0)
        for name, g in grads.items():
            shape = (-1,) + (1,) * (g.dim() - 1)
            a = active.view(shape).to(g.dtype)
            if cfg.clip > 0:
                g.mul_(coef.view(shape).to(g.dtype))
            if cfg.momentum:
                buf = buffers[name]
                buf.copy_(torch.where(a > 0, buf * cfg.momentum + g, buf))
                g = buf
            net.params[name].sub_(g * (lr * a))
            net.params[name].grad = None


def _tail_losses(net: _Stacked, members: list[_Client], device: torch.device, bptt: int) -> list[float]:
    """FedMed's tail loss of each trained client (training.py ``_tail_loss``): no dropout, no gradients, as many
    windows as one epoch (full batch) or as the run took."""
    gens = [torch.Generator().manual_seed((m.cfg.seed * 1_000_003 + m.client * 7_919 + 999_983) % (2**63))
            for m in members]
    orders = _order(members, gens, bool(members[0].cfg.max_steps))
    budget = [max(m.n_windows if m.cfg.full_batch else m.steps, 1) for m in members]
    cols = members[0].batches.inputs.size(1)
    hidden = net.init_hidden(len(members), cols, device)
    total = torch.zeros(len(members), dtype=torch.float64, device=device)
    count = [0] * len(members)
    with torch.no_grad():
        for w in range(max(budget)):
            live = [w < b for b in budget]
            if not any(live):
                break
            x, y, mask, lengths = _window(members, orders, w, live, bptt, device)
            if not any(lengths):
                break
            wrapped = [bool(n) and w > 0 and orders[c][w] == 0 for c, n in enumerate(lengths)]
            if any(wrapped):
                hidden = _reset(hidden, torch.tensor([0.0 if f else 1.0 for f in wrapped], device=device))
            sums, hidden = _nll(net, x, y, mask, hidden, _no_dropout)
            counts = [members[c].counts[orders[c][w]] if n else 0 for c, n in enumerate(lengths)]
            n_t = torch.tensor([max(k, 1) for k in counts], dtype=sums.dtype, device=device)
            total += (sums / n_t).double() * torch.tensor(counts, dtype=torch.float64, device=device)
            count = [a + b for a, b in zip(count, counts)]
    return [t / n if n else float("nan") for t, n in zip(total.tolist(), count)]
