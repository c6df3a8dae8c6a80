"""Seeded fault plans: which fault hits which round, at which phase, and whom.

A plan is a pure function of its seed (``make_plan``), so a failing run is reproduced with the seed printed in
its failure message (``FEDMQ_FAULT_SEED=N``). The *moments* are phases of a round, observed from outside the
processes: the aggregator's spool (``round.json``: reported, granted; spooled updates), its metrics rows
(round closed), the agents' JSON logs ("round training", "uploading update") and the bytes a TCP proxy
forwarded.

Phases
  agent-kill9      training    after the agent logged "round training" for the round, before its report
                                (the victim runs with ``slow:1.0:S`` so this window is S seconds wide)
                   after-grant as soon as the grant of the round is in the aggregator's spool (the victim's
                                throttled upload has at most begun)
                   mid-upload  after the agent logged "uploading update" and its proxy forwarded
                                ``frac`` of the update's bytes (updates span ~35 chunks at
                                FEDMQ_CHUNK_LIMIT=1024): a partial chunked message is in the broker
  aggregator-kill9 before-agg  a report is in, no update yet;  during-agg  an update is spooled (folded);
                   after-agg   the round's metrics row is written (the checkpoint may or may not be)
  broker-*, stall, cut, memory-alarm:  announced | reports | granted | updates
"""

from __future__ import annotations

import random
from dataclasses import dataclass

AGENT_PHASES = ("training", "after-grant", "mid-upload")
AGG_PHASES = ("before-agg", "during-agg", "after-agg")
ROUND_PHASES = ("announced", "reports", "granted", "updates")

# every fault kind the runner knows; CI runs all of them once for one seed (see test_fault_scenarios.py)
KINDS = (
    "broker-restart",
    "agent-kill9",
    "agent-kill9",
    "broker-kill9",
    "stall",
    "aggregator-kill9",
    "cut",
    "memory-alarm",
)


@dataclass(frozen=True)
class Fault:
    kind: str
    round: int
    phase: str
    target: int | None = None  # agent index (agent-kill9, stall, cut)
    seconds: float = 0.0  # stall / alarm length, restart delay of a killed agent
    frac: float = 0.0  # mid-upload: share of the update's bytes through the proxy before the kill

    def describe(self) -> str:
        who = f" agent-{self.target}" if self.target is not None else ""
        extra = f" frac={self.frac:.2f}" if self.phase == "mid-upload" else ""
        extra += f" {self.seconds:.1f}s" if self.seconds else ""
        return f"r{self.round} {self.kind}{who} @{self.phase}{extra}"


def make_plan(
    seed: int, clients: int = 3, kinds: tuple[str, ...] = KINDS, first_mid_upload: bool = False
) -> list[Fault]:
    """One fault per round from round 2 on, in a seeded order;
    the broker's graceful restart always comes first.

    The graceful restart (stop_app/start_app) must precede a kill -9 of the node: RabbitMQ 3.10 persists a new
    quorum queue's registration only every few minutes or on a graceful stop, and a kill -9 before that loses
    the aggregator's inbox itself. ``first_mid_upload`` makes the first agent kill a mid-upload one
    (the CI subset).
    """
    rng = random.Random(seed)
    rest = [k for k in kinds if k != "broker-restart"]
    rng.shuffle(rest)
    order = (["broker-restart"] if "broker-restart" in kinds else []) + rest
    plan, agent_kills = [], 0
    for i, kind in enumerate(order):
        rnd = 2 + i
        if kind == "agent-kill9":
            phase = "mid-upload" if first_mid_upload and agent_kills == 0 else rng.choice(AGENT_PHASES)
            agent_kills += 1
            plan.append(
                Fault(
                    kind,
                    rnd,
                    phase,
                    target=rng.randrange(clients),
                    seconds=round(rng.uniform(0, 2), 1),
                    frac=round(rng.uniform(0.2, 0.6), 2),
                )
            )
        elif kind == "aggregator-kill9":
            plan.append(Fault(kind, rnd, rng.choice(AGG_PHASES)))
        elif kind in ("stall", "cut"):
            plan.append(
                Fault(
                    kind,
                    rnd,
                    rng.choice(ROUND_PHASES[:3]),
                    target=rng.randrange(clients),
                    seconds=round(rng.uniform(9, 12), 1) if kind == "stall" else 0.0,
                )
            )
        elif kind == "memory-alarm":
            plan.append(Fault(kind, rnd, rng.choice(ROUND_PHASES), seconds=round(rng.uniform(2, 4), 1)))
        else:
            plan.append(Fault(kind, rnd, rng.choice(ROUND_PHASES)))
    return plan


def training_victims(plan: list[Fault]) -> set[int]:
    """Agents killed in their training phase: they run with a slow fault so the phase lasts long enough to
    hit."""
    return {
        f.target for f in plan if f.kind == "agent-kill9" and f.phase == "training" and f.target is not None
    }
