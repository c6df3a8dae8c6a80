"""Asynchronous mode folds one update per client and version.

An agent whose confirm is lost with its connection trains again from the same version and sends a new update
under a new message id; a hostile agent can do the same on purpose, to weigh several times in one buffer. The
message-id check cannot see either: the aggregator refuses a second update of a client from a version one of
its updates was already folded from (``duplicate``), and keeps that knowledge across a restart (checkpoint).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
from quick_jobs import quick_job

from fedmq.aggregator.checkpoint import load_checkpoint
from fedmq.aggregator.config import JobConfig
from fedmq.broker.transport import topology
from fedmq.broker.wire import messages
from fedmq.client_agent.agent import Agent


def _cfg(job: str, **kw: object) -> JobConfig:
    """An asynchronous job of three tiny clients; ``kw`` sets what a test is about."""
    args = {"buffer_size": kw.pop("buffer_size"), "max_staleness": 3}
    return quick_job(job, strategy_args=args, **{"strategy": "async", "clients": 3, **kw})


class Twice(Agent):
    """Sends each update it trained twice, the second time under a new message id."""

    resent: tuple[str, ...] = ()

    def _upload(self, rnd, version, prepared):  # type: ignore[no-untyped-def]
        super()._upload(rnd, version, prepared)
        again = dataclasses.replace(messages.decode(prepared.body), msg_id=uuid.uuid4().hex)
        self._send(again, topology.rk_update(self.job, self.client))
        self.resent = (*self.resent, again.msg_id)


def test_a_second_update_from_the_same_version_is_dropped_as_a_duplicate(federation, tiny_lm, tmp_path):
    cfg = _cfg("async-twice", buffer_size=2, rounds=6)
    run = tmp_path / "run"
    engine, agents, summary = federation(
        tiny_lm(3), cfg, "memory://async-twice", run, agent_class=lambda i: Twice if i == 2 else Agent
    )
    assert summary["version"] == 6, summary
    resent = set(agents[2].resent)
    assert resent, "the hostile agent sent nothing twice"
    folded = {u for ids in engine.folded.values() for u in ids}
    assert folded.isdisjoint(resent), "a second update from one version was folded"
    assert engine.inbox.dropped.get("duplicate", 0) >= 1, dict(engine.inbox.dropped)
    # its first updates are folded as any honest agent's
    rows = engine.runlog.rows()
    assert any("agent-2" in r.received for r in rows), [r.received for r in rows]
    # checkpointed for a restart, and only the versions an update may still train from
    kept = load_checkpoint(run / "checkpoints").extra["folded_from"]
    assert kept and all(v >= engine.version - engine.max_staleness for v in kept.values()), kept


class Late(Agent):
    """Joins six seconds after the others: after the first version's wait for agents (join_timeout_s 3)."""

    def run(self):  # type: ignore[no-untyped-def]
        time.sleep(6.0)
        return super().run()


@pytest.mark.timeout(90)  # a version that refused the same clients again would be skipped round after round
def test_a_skipped_version_takes_the_same_clients_from_the_same_version_again(federation, tiny_lm, tmp_path):
    """min_clients = 3 and two agents late, past the first version's wait for a buffer's worth of agents:
    the first buffer folds agent-0's update alone (nobody else owed one) and is skipped, unpublished. agent-0
    trains again from the same version, and that update is folded with the others': only a published
    version's (client, version) pairs refuse a second update."""
    cfg = _cfg("async-skip", buffer_size=3, min_clients=3, rounds=2, join_timeout_s=3.0)
    engine, _, summary = federation(
        tiny_lm(3),
        cfg,
        "memory://async-skip",
        tmp_path / "run",
        agent_class=lambda i: Agent if i == 0 else Late,
    )
    rows = engine.runlog.rows()
    assert rows[0].skip_reason and rows[0].received == ("agent-0",), (rows[0].received, rows[0].skip_reason)
    assert summary["version"] == 2, (summary, [(r.received, r.skip_reason) for r in rows])
    published = [r for r in rows if not r.skip_reason]
    assert "agent-0" in published[0].received, [r.received for r in rows]
    # (a duplicate may be dropped all the same, and rightly: an update trained from a skipped buffer's
    # announcement that arrives after the buffer closed lands in the next one beside a fresh update of the
    # same client from the same version, and one of the two goes)
