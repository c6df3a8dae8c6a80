"""Bounds on one client's influence over a round (synchronous) or a buffer (asynchronous), and the
never-non-finite rule.

An authenticated agent can send finite but huge weights (3e38) with a huge ``n_samples`` (2**52): the NaN/Inf
checks pass, the weighted sum overflows and the global model becomes Inf/NaN. Or it sends all zeros with the
same ``n_samples`` and wipes the model. The engine therefore

* notes, for every folded update, its ``n_samples`` and the L2 norm of its delta ‖Δ_k‖
  (:meth:`RoundGuard.note`, one read of the update; float64 where float32 would overflow);
* at the close asks :meth:`RoundGuard.verdict` for the updates out of bounds, judged against references one
  hostile client cannot move: a round's own lower median (the ⌈K/2⌉-th smallest of K updates), or the
  *history*, the median of the lower medians of the last HISTORY rounds that had K ≥ 3 updates (kept in the
  checkpoint):

  - ‖Δ_k‖ > ``norm_factor`` × the reference ‖Δ‖ -- with K ≥ 3 the round's own, with K ≤ 2 the history's (with
    two updates the lower median is the smaller one, and an attacker sending a near-zero update would make the
    honest one look huge): the update is **dropped** (not clipped: with its weight still up to
    ``samples_factor`` × the median, a clipped −θ would still shrink the model by several honest steps);
  - n_k > ``samples_factor`` × the reference n: its weight is **capped** to that bound. Its reference is the
    history's whenever there is one, whatever the round's size, but with K ≥ 3 never more than HISTORY_SLACK ×
    the round's own lower median (a round whose honest clients hold less than usual: one client then weighs
    at most ``samples_factor`` × HISTORY_SLACK × their median); with no history, the round's own (of two
    updates, the smaller n; one update alone is not capped). So from a job's first round of three updates on
    the cap is known before a round starts, and the round caps as it folds (below);
  - a reference of 0 (a plateau: after lr_anneal the honest deltas are exactly zero) leaves no room: every
    update that changes anything is dropped (half the round sent nothing: at worst the model stays);
  - no reference at all (no history yet): ‖Δ_k‖ > NO_REFERENCE_SHARE × ‖θ‖ is dropped, so one update nothing
    can judge may halve the model, never wipe it; a norm beyond float32 is dropped whatever the reference;

* and when something is out of bounds, aggregates the round again from its spool without / with the capped
  weights (a second pass only then: an honest round is folded once and its maths is unchanged).

A synchronous round caps weights as it folds (:meth:`RoundGuard.expect`, :meth:`RoundGuard.capped_ahead`)
when it knows the cap before its updates come: with a history always; before one, in a round with a grant
phase (top-K, FedMed), from the n_k each granted client reported, the cap the close sets if each delivers
the n it reported. When the verdict caps exactly those, the round is not folded again: each update was
folded once, in the same order and with the same weight as a second pass would fold it, so the aggregate is
the same bit for bit. Otherwise (an update dropped, a client that did not deliver, an n unlike its report,
updates folded out of the fold order) the round is folded again as above. With skewed shards an honest
round often holds a client whose n_k exceeds the cap (at 1,000 clients a round nearly every round does),
which is why the history comes first: the round's own lower median is known only at its close. The cost:
the cap follows a population whose n_k drift (devices gathering data) over about HISTORY / 2 rounds, not
at once.

Asynchronous mode folds each update as it arrives, so :meth:`RoundGuard.screen` judges it *before* folding,
against the newest accepted (n, ‖Δ‖) of every *other* client (one vote per client, so an agent sending many
updates cannot fill the reference, and never its own), by their upper median (with two others, the larger:
a near-zero update cannot pull it down): ‖Δ_k‖ > ``norm_factor`` × that reference rejects the update, and
n_k > ``samples_factor`` × that reference (needs one other client) caps its weight. An update whose ‖Δ‖ is
not a float32 number is rejected whatever the history.

With fewer than two other clients there is no reference (the first updates of a job; every update of a job
with two clients), and one update cannot be judged alone: it is *held* -- folded for now, its (n, ‖Δ‖)
noted -- and at the buffer's close :meth:`RoundGuard.judge_held` judges the held updates together by the
synchronous rules above (three or more: their own lower median; fewer: the history, else dropped beyond
NO_REFERENCE_SHARE × ‖θ‖, θ the model the buffer folds into), then the accepted ones become their clients'
votes. When it drops or caps one, the engine folds the buffer again from its spool (aggregator.async_rounds).
So the first version obeys the bound of a synchronous round of as many updates: with one hostile update
among three or more, their lower median lies within the honest norms (and claims), so it is kept only
within ``norm_factor`` × that median and weighs at most ``samples_factor`` × the median n. Held updates
are spooled and acked as any other and judged from the spool's replay after a restart, and the verdict
depends on the set of held updates, not on their order. (Before, each was shortened to
NO_REFERENCE_SHARE × ‖θ‖ and folded with its n uncapped: −θ with n = 2**52 as a job's first update took the
whole weight of version 1 and halved the model.)

Whatever the bounds, an aggregate with a NaN/Inf is never published or checkpointed (:func:`first_nonfinite`):
the round closes without an update. Needing the whole round (a median) is why the verdict waits for the close:
the engine folds updates as they stream in and keeps no copy, only their spooled bytes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.state_checks import all_finite

HISTORY = 10  # rounds whose reference (n, ‖Δ‖) the synchronous guard remembers
# the history's reference n is never more than this × a round's own lower median (K ≥ 3): a round whose honest
# clients hold less than usual does not let one client weigh more than samples_factor × this × its median
HISTORY_SLACK = 2.0
# with no reference norm, an update may move the model by at most this share of its norm: halve, not wipe it
NO_REFERENCE_SHARE = 0.5
FLOAT32_MAX = float(np.finfo(np.float32).max)


def delta_norm(update: ClientUpdate, global_state: Mapping[str, torch.Tensor]) -> float:
    """‖Δ_k‖ over all the update's tensors; float32 dots, redone in float64 if one overflows (3e38² does)."""
    return norm_of(
        t.detach().float() if update.delta else t.detach().float() - global_state[name].float()
        for name, t in update.tensors.items()
    )


def norm_of(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of ``tensors`` taken together (float64 where float32 overflows)."""
    total = 0.0
    for d in tensors:
        x = d.detach().float().reshape(-1).cpu().contiguous().numpy()
        with np.errstate(over="ignore"):
            sq = float(np.dot(x, x))
        if not math.isfinite(sq):
            x64 = x.astype(np.float64)
            sq = float(np.dot(x64, x64))
        total += sq
    return math.sqrt(total)


def lower_median(values: list[float]) -> float:
    """The ⌈K/2⌉-th smallest value: one outlier among K ≥ 3 cannot move it, and it is the smaller of two."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def upper_median(values: list[float]) -> float:
    """The ⌊K/2⌋+1-th smallest value: one outlier among K ≥ 3 cannot move it, and it is the larger of two."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def beyond_float32(norm: float) -> str | None:
    """Why a norm no float32 weighted sum survives (3e38 × any n overflows it) is out of bounds, or None."""
    return None if norm <= FLOAT32_MAX else f"update norm {norm:.3g} is beyond float32"


def first_nonfinite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN/Inf, or None when the whole state is finite."""
    for name, t in state.items():
        if not all_finite(t):
            return name
    return None


@dataclass
class Verdict:
    """What the bounds say of one round: clients to leave out (-> why) and weights to cap (client -> n)."""

    dropped: dict[str, str] = field(default_factory=dict)
    capped: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.dropped or self.capped)

    def record(self) -> dict:
        return {"dropped": dict(self.dropped), "capped": dict(self.capped)}


class RoundGuard:
    """Collects (n_k, ‖Δ_k‖) of a round's folded updates and judges them at the close (module docstring); in
    asynchronous mode judges each update before it is folded (:meth:`screen`).

    A factor of 0 turns its bound off. A round's own norm reference needs three updates; with fewer, the
    history of earlier rounds is the reference, and without history the model's norm bounds an update
    (NO_REFERENCE_SHARE). The n reference is the history's when there is one (:meth:`_samples_cap`).
    Asynchronous updates with no reference are held and judged the same way at the buffer's close
    (:meth:`judge_held`).
    """

    def __init__(self, samples_factor: float, norm_factor: float) -> None:
        self.samples_factor = samples_factor
        self.norm_factor = norm_factor
        self.facts: dict[str, tuple[int, float]] = {}  # client -> (n_samples, ‖Δ‖)
        # references (round lower medians) of the last HISTORY rounds with three updates or more
        self.history_n: deque[float] = deque(maxlen=HISTORY)
        self.history_norm: deque[float] = deque(maxlen=HISTORY)
        self.latest: dict[str, tuple[int, float]] = {}  # async: client -> its newest accepted (n, ‖Δ‖)
        self.screened = Verdict()  # async: this buffer's updates rejected or capped
        # async: this buffer's updates with no reference yet, update id -> (client, n, ‖Δ‖) (judge_held)
        self.held: dict[str, tuple[str, int, float]] = {}
        self.cap_ahead: int | None = None  # sync: the cap the granted clients' reports foretell (expect)
        self.applied: dict[str, int] = {}  # sync: client -> the cap its update was folded with

    def begin(self) -> None:
        self.facts = {}
        self.screened = Verdict()
        self.held = {}
        self.cap_ahead, self.applied = None, {}
        self._global: Mapping[str, torch.Tensor] = {}

    def expect(self, claims: list[int]) -> None:
        """A synchronous round is about to fold: the weight cap its close will set, applied as updates are
        folded (``capped_ahead``; :meth:`_samples_cap` over ``claims``, the n_k a grant phase's clients
        reported, if any): the history's, else the one ``claims`` give if each granted client delivers what
        it reported."""
        self.cap_ahead = self._samples_cap([float(n) for n in claims])

    def capped_ahead(self, update: ClientUpdate) -> ClientUpdate:
        """``update`` as it is folded: its weight capped at ``cap_ahead`` (noted in ``applied``) if above."""
        cap = self.cap_ahead
        if cap is None or update.n_samples <= cap:
            return update
        self.applied[update.client] = cap
        return dataclasses.replace(update, n_samples=cap)

    def refold_needed(self, verdict: Verdict, in_order: bool = True) -> bool:
        """Whether the round must be folded again for ``verdict``: it drops an update, caps other weights than
        those capped ahead, or caps were applied ahead but the updates were not folded in the grant's order
        (``in_order`` False: a client retried after a rejection, or one counted gone delivered after all), the
        order a second pass folds in."""
        return (
            bool(verdict.dropped) or verdict.capped != self.applied or (bool(self.applied) and not in_order)
        )

    def note(self, update: ClientUpdate, global_state: Mapping[str, torch.Tensor]) -> None:
        norm = delta_norm(update, global_state) if self.norm_factor > 0 else 0.0
        self.facts[update.client] = (int(update.n_samples), norm)
        self._global = global_state

    def verdict(self) -> Verdict:
        """The round's verdict; a round of three updates or more also becomes part of the history."""
        return self._judge(self.facts, lambda: norm_of(self._global.values()))

    def _judge(self, facts: Mapping[str, tuple[int, float]], model_norm: Callable[[], float]) -> Verdict:
        """The synchronous rules over ``facts`` (key -> (n, ‖Δ‖)), keyed as they are; ``model_norm``: ‖θ‖,
        read only when there is no reference. Three facts or more also become part of the history."""
        out = Verdict()
        k = len(facts)
        if k == 0:
            return out
        norms = [norm for _, norm in facts.values()]
        ns = [float(n) for n, _ in facts.values()]
        if self.norm_factor > 0:
            ref, what = self._reference(norms, self.history_norm)
            model = model_norm() if ref is None else 0.0
            for key, (_, norm) in sorted(facts.items()):
                why = self._norm_rule(norm, ref, what, model)
                if why is not None:
                    out.dropped[key] = why
        cap = self._samples_cap(ns)
        if cap is not None:
            for key, (n, _) in sorted(facts.items()):
                if n > cap and key not in out.dropped:
                    out.capped[key] = cap
        if k >= 3:
            self.history_norm.append(lower_median(norms))
            self.history_n.append(lower_median(ns))
        return out

    def _samples_cap(self, ns: list[float]) -> int | None:
        """The weight cap over a round's claims ``ns``, or None: no cap. With a history, ``samples_factor`` ×
        the median of the earlier rounds' lower medians of n, but with three claims or more never above
        ``samples_factor`` × HISTORY_SLACK × their own lower median (so with no claims it is known before the
        round, and the close agrees unless the round's median is under 1 / HISTORY_SLACK of the history's);
        without a history, ``samples_factor`` × the round's own lower median of two claims or more."""
        if self.samples_factor <= 0:
            return None
        if self.history_n:
            ref = statistics.median(self.history_n)
            if len(ns) >= 3:
                ref = min(ref, HISTORY_SLACK * lower_median(ns))
            return max(1, int(self.samples_factor * ref))
        if len(ns) < 2:
            return None
        return max(1, int(self.samples_factor * lower_median(ns)))

    @staticmethod
    def _reference(values: list[float], history: deque[float]) -> tuple[float | None, str]:
        if len(values) >= 3:
            return lower_median(values), "median"
        if history:
            return statistics.median(history), "median of earlier rounds"
        return None, ""

    def _norm_rule(self, norm: float, ref: float | None, what: str, model: float) -> str | None:
        """Why an update of norm ``norm`` is out of bounds, or None: beyond float32 whatever the reference;
        more than ``norm_factor`` × ``ref`` (a reference of 0 -- the honest deltas are exactly zero, a
        plateau after lr_anneal -- leaves no room for any change); with no reference, more than
        NO_REFERENCE_SHARE × ``model`` (the model's norm; a zero model has no such bound)."""
        why = None
        if ref is not None and norm > self.norm_factor * ref:
            why = f"update norm {norm:.3g} > {self.norm_factor:g} x {what} {ref:.3g}"
        why = why or beyond_float32(norm)
        if why is None and ref is None and norm > NO_REFERENCE_SHARE * model > 0:
            share = f"{NO_REFERENCE_SHARE:g} x the model's norm {model:.3g}"
            why = f"update norm {norm:.3g} > {share} (no reference yet)"
        return why

    def screen(self, update: ClientUpdate, base: Mapping[str, torch.Tensor]) -> str | None:
        """Asynchronous mode: judge one update before it is folded (module docstring). Returns why it is
        rejected, or None; a claimed n over the bound is capped in ``update`` itself. An update with no
        reference yet (fewer than two other clients) is *held*: folded for now, judged with the buffer's
        other held updates at its close (:meth:`judge_held`)."""
        norm = delta_norm(update, base)
        others = [v for c, v in self.latest.items() if c != update.client]
        why = beyond_float32(norm)
        if why is None and self.norm_factor > 0 and len(others) >= 2:
            why = self._norm_rule(norm, upper_median([nm for _, nm in others]), "other clients' median", 0.0)
        if why is not None:
            self.screened.dropped[update.client] = why
            return why
        n = int(update.n_samples)
        if self.samples_factor > 0 and others:
            cap = max(1, int(self.samples_factor * upper_median([float(m) for m, _ in others])))
            if n > cap:
                update.n_samples = n = cap
                self.screened.capped[update.client] = cap
        if len(others) < 2 and (self.norm_factor > 0 or self.samples_factor > 0):
            self.held[update.update_id or update.client] = (update.client, n, norm)
        else:
            self.latest[update.client] = (n, norm)
        return None

    def withdraw(self, update: ClientUpdate) -> None:
        """``update`` passed :meth:`screen` but was not folded (its strategy refused it): judge it no more."""
        self.held.pop(update.update_id or update.client, None)
        self.applied.pop(update.client, None)

    def judge_held(self, global_state: Mapping[str, torch.Tensor]) -> Verdict:
        """Asynchronous mode, at a buffer's close: its held updates judged together by the synchronous rules
        (:meth:`verdict`; ``global_state``, the model the buffer folds into, is the no-reference scale). The
        verdict is keyed by update id (the caller folds the buffer again when it is not empty); ``screened``
        names the clients, and the accepted updates become their clients' votes."""
        facts = {key: (n, norm) for key, (_, n, norm) in self.held.items()}
        out = self._judge(facts, lambda: norm_of(global_state.values()))
        for key, (client, n, norm) in self.held.items():  # in arrival order: a client's newest vote wins
            if key in out.dropped:
                self.screened.dropped[client] = out.dropped[key]
                continue
            if key in out.capped:
                n = self.screened.capped[client] = out.capped[key]
            self.latest[client] = (n, norm)
        self.held = {}
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a restarted aggregator needs to judge as this one would (kept in the checkpoint)."""
        return {
            "history_n": list(self.history_n),
            "history_norm": list(self.history_norm),
            "latest": {c: list(v) for c, v in self.latest.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        state = state or {}
        try:
            self.history_n = deque((float(x) for x in state.get("history_n", [])), maxlen=HISTORY)
            self.history_norm = deque((float(x) for x in state.get("history_norm", [])), maxlen=HISTORY)
            self.latest = {str(c): (int(v[0]), float(v[1])) for c, v in state.get("latest", {}).items()}
        except (TypeError, ValueError, IndexError, AttributeError):  # an unreadable history: start afresh
            self.history_n.clear()
            self.history_norm.clear()
            self.latest = {}


def in_fold_order(folded: Sequence[str], order: Iterable[str]) -> bool:
    """Whether the clients ``folded`` (in the order folded) came in ``order``, the order a second pass folds
    in (a round's grant, an edge's clients): ``refold_needed``'s ``in_order``."""
    done = set(folded)
    return list(folded) == [c for c in order if c in done]
