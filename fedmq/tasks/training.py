"""The local training loop shared by every task: optimizer, per-epoch lr decay, clipping, step cap,
device, AMP.

A task supplies an ``epoch(model, generator)`` iterator that yields, for each batch, the mean loss over the
batch's target tokens (a tensor with grad) and the number of those tokens; the loop does the backward pass and
the optimizer step between two yields. Determinism on CPU: the batch order and dropout masks come from
generators seeded by (cfg.seed, client, epoch), never from torch's global RNG.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import structlog
import torch
from torch import nn

from fedmq import train_config
from fedmq.hooks import GradientTerms
from fedmq.tasks.base import Progress, TrainConfig, TrainResult
from fedmq.tasks.dropout import set_dropout_generator
from fedmq.tasks.errors import TaskError

log = structlog.get_logger(__name__)

EpochFn = Callable[[nn.Module, torch.Generator, torch.device], Iterator[tuple[torch.Tensor, int]]]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TaskError(
                f"device (--device) {device}: CUDA is not available on this machine; use cpu or auto"
            )
        return torch.device(device)
    raise TaskError(f"unknown device (--device) {device!r}: use auto, cpu or cuda")


TAIL_EPOCH = 999_983  # the tail-loss pass draws from its own generator, as if it were this epoch


def epoch_seed(seed: int, client: int, epoch: int) -> int:
    """The seed of a client's local epoch (its batch order and dropout masks), from the round's seed."""
    return (seed * 1_000_003 + client * 7_919 + epoch) % (2**63)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    check_config(cfg)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas)
    raise TaskError(f"unknown optimizer {cfg.optimizer!r}: use sgd or adam")


def check_config(cfg: TrainConfig) -> None:
    """TaskError naming the first TrainConfig setting out of its range (fedmq.train_config.RANGES)."""
    try:
        train_config.check(cfg)
    except ValueError as exc:
        raise TaskError(f"TrainConfig {exc}") from None


def run_training(
    model: nn.Module,
    epoch_fn: EpochFn,
    steps_per_epoch: int,
    cfg: TrainConfig,
    client: int,
    n_samples: int,
    progress: Progress | None = None,
) -> TrainResult:
    """Train ``model`` in place; it is moved to the training device and back to where it was."""
    check_config(cfg)
    device = resolve_device(cfg.device)
    home = next(model.parameters()).device
    model.to(device)
    model.train()
    opt = make_optimizer(model, cfg)
    use_amp = cfg.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_amp else None
    total = (1 if cfg.full_batch else steps_per_epoch) * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    steps = tokens = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # summed where the loss is: no sync a step
    t0 = time.perf_counter()
    terms = getattr(model, GradientTerms.ATTRIBUTE, None)
    if terms is not None:  # added once a step, in _step, not at each backward pass
        terms.deferred = True
    try:
        for epoch in range(cfg.epochs):
            if steps >= total:
                break
            seed = epoch_seed(cfg.seed, client, epoch)
            gen = torch.Generator().manual_seed(seed)
            set_dropout_generator(
                model, torch.Generator(device=device).manual_seed(seed) if device.type == "cuda" else gen
            )
            epoch_lr = cfg.lr * cfg.lr_decay**epoch
            for g in opt.param_groups:
                g["lr"] = epoch_lr
            if cfg.full_batch:
                steps, tokens, loss_sum = _full_batch_step(
                    model, opt, scaler, epoch_fn(model, gen, device), use_amp, cfg, steps, tokens, loss_sum
                )
                if progress is not None:
                    progress(steps, total)
                continue
            scheduled = cfg.warmup_steps or cfg.linear_decay
            for loss, n in _autocast(use_amp, epoch_fn(model, gen, device)):
                lr = epoch_lr * _schedule(cfg, steps, total) if scheduled else None
                _minibatch_step(model, opt, scaler, cfg, loss, lr)
                steps += 1
                tokens += n
                loss_sum += loss.detach().double() * n
                if progress is not None:
                    progress(steps, total)
                if steps >= total:
                    break
        tail = (
            _tail_loss(model, epoch_fn, device, cfg, client, steps_per_epoch if cfg.full_batch else steps)
            if cfg.tail_loss
            else None
        )
    finally:
        if terms is not None:
            terms.deferred = False
        set_dropout_generator(model, None)
        model.to(home)
    seconds = time.perf_counter() - t0
    mean = float(loss_sum) / tokens if tokens else float("nan")
    log.debug(
        "local training done",
        client=client,
        steps=steps,
        tokens=tokens,
        loss=round(mean, 4),
        seconds=round(seconds, 2),
    )
    return TrainResult(
        loss=mean, n_samples=n_samples, steps=steps, tokens=tokens, seconds=seconds, tail_loss=tail
    )


def _tail_loss(
    model: nn.Module, epoch_fn: EpochFn, device: torch.device, cfg: TrainConfig, client: int, batches: int
) -> float:
    """FedMed §3.4: "the loss on the dataset of each worker is computed at the tail of local training". The
    trained model (eval mode: no dropout, no gradients) over its own shard, as many batches as one epoch — or
    as the run took, when --max-steps cut it shorter (the CPU scale),
    so the extra pass never costs more than the training."""
    gen = torch.Generator().manual_seed(epoch_seed(cfg.seed, client, TAIL_EPOCH))
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        with torch.no_grad():
            for i, (loss, n) in enumerate(epoch_fn(model, gen, device)):
                if i >= max(batches, 1):
                    break
                total += loss.double() * n
                count += n
    finally:
        model.train()
    return float(total) / count if count else float("nan")


def _step(model: nn.Module, opt: torch.optim.Optimizer, scaler, cfg: TrainConfig) -> None:
    """The optimizer step on the finished, unscaled gradient: a strategy's gradient terms are added to it
    here, once (fedmq.hooks.GradientTerms), then it is clipped."""
    terms = getattr(model, GradientTerms.ATTRIBUTE, None)
    if terms is not None:
        terms.add()
    if cfg.clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _minibatch_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler,
    cfg: TrainConfig,
    loss: torch.Tensor,
    lr: float | None,
) -> None:
    """One optimizer step on one batch's loss, at the schedule's learning rate ``lr`` (None: the epoch's)."""
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    _step(model, opt, scaler, cfg)


def _full_batch_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler,
    batches: Iterator[tuple[torch.Tensor, int]],
    use_amp: bool,
    cfg: TrainConfig,
    steps: int,
    tokens: int,
    loss_sum: torch.Tensor,
) -> tuple[int, int, torch.Tensor]:
    """One optimizer step on the mean loss over every target of the shard: the batches' gradients, each
    weighted by its token count, are summed in place (no more memory than one batch),
    then divided by the shard's tokens."""
    opt.zero_grad(set_to_none=True)
    seen = 0
    for loss, n in _autocast(use_amp, batches):
        weighted = loss * n
        (scaler.scale(weighted) if scaler is not None else weighted).backward()
        seen += n
        loss_sum += loss.detach().double() * n
    if not seen:
        return steps, tokens, loss_sum
    if scaler is not None:
        scaler.unscale_(opt)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(seen)
    _step(model, opt, scaler, cfg)
    return steps + 1, tokens + seen, loss_sum


def _schedule(cfg: TrainConfig, step: int, total: int) -> float:
    """lr multiplier of 0-based ``step`` of ``total``: linear warm-up, then
    (with linear_decay) linear fall to 0."""
    rise = (step + 1) / cfg.warmup_steps if cfg.warmup_steps else 1.0
    fall = (total - step) / max(1, total - cfg.warmup_steps) if cfg.linear_decay else 1.0
    return min(rise, fall, 1.0)


def _autocast(enabled: bool, it: Iterator[tuple[torch.Tensor, int]]) -> Iterator[tuple[torch.Tensor, int]]:
    """Run each forward pass (the iterator's work between yields) under CUDA autocast when enabled."""
    ctx = torch.autocast("cuda", dtype=torch.float16) if enabled else contextlib.nullcontext()
    while True:
        with ctx:
            try:
                item = next(it)
            except StopIteration:
                return
        yield item
