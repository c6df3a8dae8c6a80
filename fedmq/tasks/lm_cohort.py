"""Local training of several LM clients at once: one batched copy of the RNN per client (a "cohort").

A GRU client's step (batch 10, 300 units) is far too small to keep a GPU busy, so at the paper scale a round
of 10-50 clients trained one after the other costs 10-50 latency-bound passes. Here the clients' parameters
are stacked along a leading client axis and every matrix product is a batched one (``bmm``): one pass trains
them all. Each client still trains exactly as ``LanguageModelTask.train`` would train it alone — its own shard
and windows, its own dropout masks drawn from its own generator in the same order, its own SGD-momentum
buffer, clipping norm and step count (a client whose shard has fewer windows simply stops stepping) — so the
result equals the sequential one up to float summation order (tests/unit/test_lm_cohort.py checks it).

The recurrences are written out (PyTorch's GRU and LSTM equations, weight layouts and gate order), since
``nn.GRU`` has no batched-weights form; time steps run in a Python loop, one batched cell step each.
Supported: SGD with or without momentum, per-epoch lr decay, clipping, a step cap with a seeded start window,
FedSGD's full-batch step and FedMed's tail loss. Anything else (Adam, warm-up, AMP) is trained one client
after the other by the caller.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedmq.tasks.base import Progress, TrainConfig, TrainResult
from fedmq.tasks.lm_data import StreamBatches
from fedmq.tasks.lm_models import detach_hidden
from fedmq.tasks.training import TAIL_EPOCH, check_config, epoch_seed, resolve_device

# the activations a cohort may hold at once: the logits of a window, their log-softmax, its gradient and the
# loss's (4 x bptt x B x vocabulary floats a client) -- WikiText-2 at B = 10: 186 MB a client, so all of a
# C = 0.5 round's 50 in 16 GiB; FedSGD's B = 100: 8 at a time
ACTIVATION_BUDGET = 16 * 2**30
# the parameters of layer i, a one-layer nn.GRU/nn.LSTM of its own: rnn.{i}.{name}_l0
_RNN_WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def cohort_size(vocab: int, bptt: int, cols: int) -> int:
    """How many clients one batched run takes (a larger cohort trains in parts of this size)."""
    return max(1, ACTIVATION_BUDGET // (4 * bptt * cols * vocab * 4))


def can_train_together(cfgs: list[TrainConfig]) -> bool:
    """Whether these clients' runs can be one batched run: the same settings (seeds aside) and a regime the
    batched loop implements."""
    first = dataclasses.replace(cfgs[0], seed=0)
    return (
        all(dataclasses.replace(c, seed=0) == first for c in cfgs)
        and first.optimizer == "sgd"
        and not first.amp
        and not first.warmup_steps
        and not first.linear_decay
    )


class _Stacked:
    """The cohort's parameters, ``[clients, *shape]`` leaves named as in the model, and its forward pass."""

    def __init__(self, models: list[nn.Module], device: torch.device) -> None:
        self.cfg = models[0].cfg
        self.names = [name for name, _ in models[0].named_parameters()]
        per_model = [dict(m.named_parameters()) for m in models]
        self.params = {
            name: torch.stack([p[name].detach() for p in per_model]).to(device).requires_grad_()
            for name in self.names
        }

    def write_back(self, models: list[nn.Module]) -> None:
        with torch.no_grad():
            for i, model in enumerate(models):
                for name, p in model.named_parameters():
                    p.copy_(self.params[name][i])

    def init_hidden(self, clients: int, batch: int, device: torch.device) -> list:
        z = lambda: torch.zeros(clients, batch, self.cfg.hidden, device=device)  # noqa: E731
        return [(z(), z()) if self.cfg.cell == "lstm" else z() for _ in range(self.cfg.layers)]

    def forward(
        self, x: torch.Tensor, hidden: list, drop: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, list]:
        """x: [C, T, B] token ids -> logits [C, T, B, V] and the new hidden state; ``drop`` is the dropout,
        applied where RNNLanguageModel applies it (after the embedding and after every layer)."""
        p = self.params
        clients = torch.arange(x.size(0), device=x.device)[:, None, None]
        out = drop(p["encoder.weight"][clients, x])  # each client's own embedding
        new_hidden = []
        for i, h in enumerate(hidden):
            w_ih, w_hh, b_ih, b_hh = (p[f"rnn.{i}.{kind}_l0"] for kind in _RNN_WEIGHTS)
            step = _gru_step if self.cfg.cell == "gru" else _lstm_step
            out, h = _layer(out, h, w_ih, w_hh, b_ih, b_hh, step)
            out = drop(out)
            new_hidden.append(h)
        c, t, b, d = out.shape
        decoder = p["encoder.weight"] if self.cfg.tied else p["decoder.weight"]
        logits = torch.baddbmm(
            p["decoder.bias"][:, None, :], out.reshape(c, t * b, d), decoder.transpose(1, 2)
        )
        return logits.view(c, t, b, -1), new_hidden


def _layer(
    x: torch.Tensor,
    h,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor,
    b_hh: torch.Tensor,
    step: Callable,
) -> tuple[torch.Tensor, object]:
    """One recurrent layer over [C, T, B, I]: the input projection of every time step at once,
    then the cell."""
    c, t, b, i = x.shape
    gates_x = torch.baddbmm(b_ih[:, None, :], x.reshape(c, t * b, i), w_ih.transpose(1, 2)).view(c, t, b, -1)
    w_hh_t, b_hh = w_hh.transpose(1, 2), b_hh[:, None, :]
    outs = []
    for gx in gates_x.unbind(
        1
    ):  # not gates_x[:, s]: each such slice's backward would fill a whole-window tensor
        h_prev = h[0] if isinstance(h, tuple) else h
        h = step(gx, torch.baddbmm(b_hh, h_prev, w_hh_t), h)
        outs.append(h[0] if isinstance(h, tuple) else h)
    return torch.stack(outs, 1), h


def _gru_step(gx: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """PyTorch's GRU (r, z, n gates in that order): r, z = σ(x_rz + h_rz), n = tanh(x_n + r * h_n),
    h' = (h - n) * z + n — in as few kernels as it takes (a GPU step is launch-bound). Gates are cut with
    ``split``, whose backward is one concatenation (a slice's backward fills a zero tensor of the whole)."""
    hidden = h.size(-1)
    x_rz, x_n = gx.split([2 * hidden, hidden], -1)
    h_rz, h_n = gh.split([2 * hidden, hidden], -1)
    r, z = torch.sigmoid(x_rz + h_rz).chunk(2, -1)
    n = torch.tanh(torch.addcmul(x_n, h_n, r))
    return torch.addcmul(n, h - n, z)


def _lstm_step(
    gx: torch.Tensor, gh: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's LSTM (i, f, g, o gates in that order): c' = σ(f) * c + σ(i) * tanh(g),
    h' = σ(o) * tanh(c')."""
    hidden = hc[0].size(-1)
    i_f, g, o = (gh + gx).split([2 * hidden, hidden, hidden], -1)
    i, f = torch.sigmoid(i_f).chunk(2, -1)
    c = torch.addcmul(f * hc[1], i, torch.tanh(g))
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


class _Shards:
    """Every client's training stream cut into windows, padded into one ``[C, W, bptt, B]`` layout on the
    device once per cohort (a window is then a slice, not a copy);
    lengths and target counts stay on the host."""

    def __init__(self, task: Any, clients: list[int], cols: int, device: torch.device) -> None:
        bptt = task.bptt
        streams = [StreamBatches.build(task.client_ids(c), cols, task.vocab.eos) for c in clients]
        self.n_samples = [b.n_targets for b in streams]
        self.counts = [b.window_targets(bptt) for b in streams]  # real targets of each window
        # its time steps
        self.lengths = [
            [min(bptt, b.inputs.size(0) - w * bptt) for w in range(len(n))]
            for b, n in zip(streams, self.counts)
        ]
        rows = max(len(n) for n in self.counts) * bptt

        def layout(part: str) -> torch.Tensor:
            padded = [F.pad(getattr(b, part), (0, 0, 0, rows - b.inputs.size(0))) for b in streams]
            return torch.stack(padded).view(len(streams), -1, bptt, cols).to(device)

        self.inputs, self.targets, self.mask = layout("inputs"), layout("targets"), layout("mask")

    def windows(self, c: int) -> int:
        return len(self.counts[c])


@dataclass
class _Plan:
    """One pass over the clients' shards: each client's window order and, per slot w, who takes part."""

    order: list[list[int]]  # client -> its windows in the order it visits them
    on: list[list[bool]]  # slot -> client -> whether it trains on (or scores) its window of this slot
    inputs: torch.Tensor  # [C, W, bptt, B], each client's windows in its order
    targets: torch.Tensor
    mask: torch.Tensor  # real targets of the clients taking part
    counts: torch.Tensor  # [C, W] real targets (0 where a client does not take part)
    taking: torch.Tensor  # [C, W] 1.0 where a client takes part (``on`` on the device)

    @classmethod
    def build(
        cls,
        shards: _Shards,
        gens: list[torch.Generator],
        capped: bool,
        budget: list[int],
        device: torch.device,
    ) -> _Plan:
        """``budget``: how many windows each client takes this pass. With the step cap on, a client starts at
        a seeded window (LanguageModelTask.train: the epoch generator's first draw) and wraps to its shard's
        start."""
        order = []
        for c, gen in enumerate(gens):
            n = shards.windows(c)
            start = int(torch.randint(n, (1,), generator=gen)) if capped and n else 0
            order.append(list(range(start, n)) + list(range(start)))
        slots = max(len(o) for o in order)
        on = [[w < min(len(o), b) for o, b in zip(order, budget)] for w in range(slots)]
        idx = torch.tensor([o + [0] * (slots - len(o)) for o in order], device=device)
        taking = torch.tensor(on, device=device).t().contiguous()  # [C, W]
        counts = [
            [shards.counts[c][o[w]] if on[w][c] else 0 for w in range(slots)] for c, o in enumerate(order)
        ]
        rows = torch.arange(len(order), device=device)[:, None]
        return cls(
            order,
            on,
            shards.inputs[rows, idx],
            shards.targets[rows, idx],
            shards.mask[rows, idx] & taking[:, :, None, None],
            torch.tensor(counts, dtype=torch.float32, device=device),
            taking.float(),
        )

    def lengths(self, shards: _Shards, w: int) -> list[int]:
        """Each client's time steps in slot ``w`` (0: not taking part)."""
        return [shards.lengths[c][o[w]] if self.on[w][c] else 0 for c, o in enumerate(self.order)]

    def wrapped(self, w: int) -> list[bool]:
        """Clients whose slot ``w`` wrapped to their shard's first window:
        they start it with a fresh hidden state."""
        return [w > 0 and self.on[w][c] and o[w] == 0 for c, o in enumerate(self.order)]


def train_cohort(
    task: Any,
    models: list[nn.Module],
    clients: list[int],
    cfgs: list[TrainConfig],
    progress: list[Progress | None],
) -> list[TrainResult]:
    """Train ``models[i]`` in place on client ``clients[i]``'s shard of ``task`` (a LanguageModelTask), all at
    once (``can_train_together``)."""
    cfg = cfgs[0]
    check_config(cfg)
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    shards = _Shards(task, clients, cfg.batch_size, device)
    per_epoch = [1 if cfg.full_batch else shards.windows(c) for c in range(len(clients))]
    total = [e * cfg.epochs for e in per_epoch]
    if cfg.max_steps:
        total = [min(t, cfg.max_steps) for t in total]
    run = _Run(
        _Stacked(models, device),
        shards,
        cfg,
        clients,
        [c.seed for c in cfgs],
        total,
        progress,
        task.model_cfg.dropout,
        device,
    )
    for epoch in range(cfg.epochs):
        if all(s >= t for s, t in zip(run.steps, total)):
            break
        run.epoch(epoch, cfg.lr * cfg.lr_decay**epoch)
    tails = run.tail_losses() if cfg.tail_loss else [None] * len(clients)
    run.net.write_back(models)
    seconds = time.perf_counter() - t0
    return [
        TrainResult(
            loss=loss / tokens if tokens else float("nan"),
            n_samples=n,
            steps=steps,
            tokens=tokens,
            seconds=seconds,
            tail_loss=tail,
        )
        for loss, n, steps, tokens, tail in zip(
            run.loss_sum.tolist(), shards.n_samples, run.steps, run.tokens, tails
        )
    ]


class _Run:
    """The cohort's training state: parameters, momentum, step and token counts, summed losses."""

    def __init__(
        self,
        net: _Stacked,
        shards: _Shards,
        cfg: TrainConfig,
        clients: list[int],
        seeds: list[int],
        total: list[int],
        progress: list[Progress | None],
        p_drop: float,
        device: torch.device,
    ) -> None:
        self.net, self.shards, self.cfg, self.clients, self.seeds, self.total = (
            net,
            shards,
            cfg,
            clients,
            seeds,
            total,
        )
        self.progress, self.p_drop, self.device = progress, p_drop, device
        self.steps = [0] * len(clients)
        self.tokens = [0] * len(clients)
        self.loss_sum = torch.zeros(len(clients), dtype=torch.float64, device=device)  # no host sync a step
        self.buffers = {n: torch.zeros_like(p) for n, p in net.params.items()} if cfg.momentum else {}

    def epoch(self, epoch: int, lr: float) -> None:
        cfg, shards = self.cfg, self.shards
        seeds = [epoch_seed(seed, client, epoch) for seed, client in zip(self.seeds, self.clients)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        drop_gens = (
            [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
            if self.device.type == "cuda"
            else gens
        )
        left = [max(t - s, 0) for s, t in zip(self.steps, self.total)]  # steps each client has still to take
        budget = [shards.windows(c) if n else 0 for c, n in enumerate(left)] if cfg.full_batch else left
        plan = _Plan.build(shards, gens, bool(cfg.max_steps), budget, self.device)
        for w, sums in self._slots(plan, lambda lengths: _Dropout(self.p_drop, drop_gens, lengths)):
            n = plan.counts[:, w]
            mean = sums / n.clamp(min=1)
            self.loss_sum += mean.detach().double() * n.double()
            # FedSGD: divided by the shard's targets below
            (sums if cfg.full_batch else mean).sum().backward()
            for c, on in enumerate(plan.on[w]):
                if on:
                    self.tokens[c] += shards.counts[c][plan.order[c][w]]
            if not cfg.full_batch:
                self._step(lr, plan.on[w], plan.taking[:, w])
        if cfg.full_batch:
            took = [b > 0 for b in budget]
            seen = plan.counts.sum(1).clamp(min=1)
            for p in self.net.params.values():
                p.grad.div_(seen.view(-1, *[1] * (p.dim() - 1)))
            self._step(lr, took, plan.taking.amax(1))

    def _slots(
        self, plan: _Plan, drop: Callable[[list[int]], Callable[[torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Each slot ``w`` of ``plan`` in turn with every client's summed NLL of its window [C]; the hidden
        state is carried from slot to slot (detached: truncated BPTT) and zeroed for a client that wrapped to
        its shard's start. ``drop(lengths)``: the slot's dropout, given each client's time steps."""
        hidden = self.net.init_hidden(len(self.clients), self.cfg.batch_size, self.device)
        for w in range(len(plan.on)):
            if not any(plan.on[w]):
                break
            lengths = plan.lengths(self.shards, w)
            hidden = _reset(detach_hidden(hidden), plan.wrapped(w), self.device)
            t = max(lengths)
            sums, hidden = _nll(
                self.net,
                plan.inputs[:, w, :t],
                plan.targets[:, w, :t],
                plan.mask[:, w, :t],
                hidden,
                drop(lengths),
            )
            yield w, sums

    def _step(self, lr: float, on: list[bool], active: torch.Tensor) -> None:
        _sgd_step(self.net, self.buffers, lr, self.cfg, active if not all(on) else None)
        for c, took in enumerate(on):
            if took:
                self.steps[c] += 1
                if self.progress[c] is not None:
                    self.progress[c](self.steps[c], self.total[c])

    def tail_losses(self) -> list[float]:
        """FedMed's tail loss of each trained client (training.py ``_tail_loss``): no dropout, no gradients,
        as many windows as one epoch (full batch) or as the run took."""
        cfg, shards = self.cfg, self.shards
        gens = [
            torch.Generator().manual_seed(epoch_seed(s, c, TAIL_EPOCH))
            for s, c in zip(self.seeds, self.clients)
        ]
        budget = [
            max(shards.windows(c) if cfg.full_batch else self.steps[c], 1) for c in range(len(self.clients))
        ]
        plan = _Plan.build(shards, gens, bool(cfg.max_steps), budget, self.device)
        total = torch.zeros(len(self.clients), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for w, sums in self._slots(plan, lambda lengths: _no_dropout):
                n = plan.counts[:, w]
                total += (sums / n.clamp(min=1)).double() * n.double()
        count = plan.counts.sum(1).tolist()
        return [t / n if n else float("nan") for t, n in zip(total.tolist(), count)]


def _nll(
    net: _Stacked, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, hidden: list, drop
) -> tuple[torch.Tensor, list]:
    """Summed NLL of each client's real targets [C] and the new hidden state."""
    logits, hidden = net.forward(x, hidden, drop)
    c = x.size(0)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="none")
    return (nll.view(c, -1) * mask.reshape(c, -1)).sum(1), hidden


def _reset(hidden: list, fresh: list[bool], device: torch.device) -> list:
    """Zero the hidden state of the clients marked ``fresh``."""
    if not any(fresh):
        return hidden
    k = torch.tensor([0.0 if f else 1.0 for f in fresh], device=device)[:, None, None]
    return [tuple(t * k for t in h) if isinstance(h, tuple) else h * k for h in hidden]


def _sgd_step(net: _Stacked, buffers: dict, lr: float, cfg: TrainConfig, active: torch.Tensor | None) -> None:
    """torch.optim.SGD (momentum, no dampening) for the clients where ``active`` [C] is 1 (None: all of them);
    the others keep their parameters and momentum. Clipping, when on,
    scales each client's gradient by its own norm."""
    everyone = active is None
    with torch.no_grad():
        grads = {name: p.grad for name, p in net.params.items()}
        if cfg.clip > 0:
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
            coef = torch.clamp(cfg.clip / (norms + 1e-6), max=1.0)
        for name, g in grads.items():
            shape = (-1,) + (1,) * (g.dim() - 1)
            if cfg.clip > 0:
                g.mul_(coef.view(shape))
            p = net.params[name]
            if cfg.momentum:
                buf = buffers[name]
                if everyone:
                    buf.mul_(cfg.momentum).add_(g)
                else:
                    buf.copy_(torch.where(active.view(shape) > 0, buf * cfg.momentum + g, buf))
                g = buf
            if everyone:
                p.add_(g, alpha=-lr)
            else:
                p.sub_(g * (lr * active.view(shape)))
            p.grad = None
