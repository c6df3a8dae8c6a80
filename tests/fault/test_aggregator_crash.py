"""Kill -9 of the aggregator process mid-round, then a restart, and a hot-standby takeover (real RabbitMQ)."""

from __future__ import annotations

import pytest
from fault_harness import Federation, delete_job_queues, wait_for
from load_factor import budget

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def _assert_clean(fed: Federation, rounds: int) -> None:
    audit = fed.audit()
    assert audit.rounds_completed == rounds and audit.rounds_skipped == 0, audit
    assert audit.lost == [] and audit.duplicated == [], audit
    # nobody was killed but the aggregator and the deadlines are generous:
    # every confirmed upload was folded once
    assert audit.confirmed == audit.folded > 0 and audit.unconfirmed_folded == [] and audit.dropped == [], (
        audit
    )
    assert audit.finite and audit.shapes_ok
    assert audit.max_round_s < fed.round_limit_s(), audit


@pytest.fixture
def federation(tmp_path, rabbit_url, job_id):
    fed = Federation(
        tmp_path / "fed", rabbit_url, job_id, clients=3, rounds=4, agent_faults={2: "slow:1.0:2"}
    )
    yield fed
    fed.stop_all()
    delete_job_queues(rabbit_url, job_id, fed.clients)


def test_aggregator_kill9_mid_round_then_restart_loses_and_doubles_nothing(federation):
    fed = federation.start()
    # mid-round: round 2 is open and at least one update is spooled (and acked), the slow agent still training
    wait_for(lambda: fed.round_open(2) and fed.spooled_updates(2) >= 1, 90, "an update spooled in round 2")
    fed.kill9("agg")
    assert len(fed.rows()) == 1
    fed.start_aggregator("agg2")
    summary = fed.wait_aggregator("agg2", timeout=120)
    assert summary["rounds_completed"] == 4 and summary["version"] == 4
    assert fed.agg_events("resuming open round"), "the restart did not resume the open round"
    _assert_clean(fed, 4)


def test_aggregator_kill9_mid_round_with_hosts_loses_and_doubles_nothing(tmp_path, rabbit_url, job_id):
    """Six clients served by two host processes: the restarted aggregator knows who serves the open round's
    clients from its spool (their hosts' next beats come later) and every confirmed upload is folded once."""
    fed = Federation(
        tmp_path / "fed",
        rabbit_url,
        job_id,
        clients=6,
        rounds=4,
        hosts=2,
        job_options={"fraction": 0.5},
        agent_faults={1: "slow:1.0:2"},
    )
    try:
        fed.start()
        wait_for(lambda: fed.round_open(2) and fed.spooled_updates(2) >= 1, 90, "round 2 part spooled")
        fed.kill9("agg")
        fed.start_aggregator("agg2")
        summary = fed.wait_aggregator("agg2", timeout=120)
        assert summary["rounds_completed"] == 4 and summary["version"] == 4
        assert fed.agg_events("resuming open round"), "the restart did not resume the open round"
        # the same two host processes served the whole job, and left when it ended
        assert [fed.procs[f"host-h{h}"].wait(timeout=budget(30)) for h in range(2)] == [0, 0]
        _assert_clean(fed, 4)
    finally:
        fed.stop_all()
        delete_job_queues(rabbit_url, job_id, fed.clients, hosts=2)


def test_hot_standby_takes_over_from_the_checkpoint_and_spool(federation):
    fed = federation
    fed.start_aggregator("agg")
    for i in range(fed.clients):
        fed.start_agent(i)
    wait_for(lambda: (fed.state / "config.json").is_file(), 60, "the first aggregator to become active")
    fed.start_aggregator("standby")
    wait_for(
        lambda: "waiting for the first delivery" in (fed.logs / "standby.err").read_text(),
        60,
        "the standby to wait on the inbox",
    )
    wait_for(lambda: fed.round_open(3) and fed.spooled_updates(3) >= 1, 90, "an update spooled in round 3")
    # round 1's spool was cleared before round 2 closed (its checkpoint first): its update files were kept
    # for the next updates to write over, and the kill leaves them to the standby
    assert (fed.state / "spool" / "free").is_dir()
    fed.kill9("agg")
    summary = fed.wait_aggregator("standby", timeout=120)
    assert summary["rounds_completed"] == 4 and summary["version"] == 4
    assert not (fed.state / "spool" / "free").exists()  # the active standby's run ended: they went
    # the standby started from the dead one's checkpoint (round 3) and replayed its spool
    resumed = fed.agg_events("resumed from checkpoint")
    assert resumed and resumed[-1]["round"] == 3, resumed
    _assert_clean(fed, 4)


def test_async_kill9_mid_round_replays_the_spool(tmp_path, rabbit_url, job_id):
    """Async (FedBuff) mode: updates acked into the spool before a kill -9 are folded after the restart,
    once, and every update the broker confirmed to an agent is accounted for: folded, or dropped with a reason
    that is not a loss (confirmed = folded + dropped, none dropped as unexpected, none left in the inbox)."""
    from fedmq.broker.transport.connect import connect
    from fedmq.broker.wire import messages

    fed = Federation(
        tmp_path / "fed",
        rabbit_url,
        job_id,
        clients=3,
        rounds=5,
        # staggered uploads (every ~1, ~2.5 and ~4 s): a round's first update is spooled a second or more
        # before its third closes it, so the kill below lands in an open round even on a busy machine
        agent_faults={0: "slow:1.0:1", 1: "slow:1.0:2.5", 2: "slow:1.0:4"},
        job_options={"strategy": {"name": "async", "buffer_size": 3, "max_staleness": 5}},
    )
    try:
        fed.start()
        wait_for(lambda: fed.spooled_updates(2) >= 1, 90, "an update spooled in async round 2")
        fed.kill9("agg")
        spool = fed.state / "spool" / "r000002"
        spooled_ids = {messages.decode(p.read_bytes()).msg_id for p in spool.glob("update-*.msg")}
        assert spooled_ids and not fed.round_closed(2)
        fed.start_aggregator("agg2")
        summary = fed.wait_aggregator("agg2", timeout=budget(120))
        assert summary["version"] == 5 and summary["rounds_completed"] == 5
        assert fed.agg_events("resuming open round"), "the restart did not replay the async spool"
        # the job ended: each agent reads the end after its last upload and leaves on its own
        agents = [fed.procs[f"agent-{i}"] for i in range(fed.clients)]
        wait_for(lambda: all(p.poll() is not None for p in agents), 60, "the agents to leave the ended job")
        assert [p.returncode for p in agents] == [0] * fed.clients
        # the audit's (round, id) matching is for synchronous rounds; async is matched by id below
        audit = fed.audit()
        assert audit.duplicated == [] and audit.finite and audit.shapes_ok, audit
        from fedmq.aggregator.checkpoint import load_checkpoint

        folded = {u for ids in load_checkpoint(fed.state / "checkpoints").folded.values() for u in ids}
        confirmed = {u for _, u in fed.confirmed()}
        assert folded <= confirmed, "folded an update no agent had confirmed"
        assert spooled_ids <= folded, "a spooled (acked) update was not folded after the restart"
        # async folds an update into whichever version is open when it arrives: match confirmed uploads by id
        drops = [e for e in fed.agg_events("message dropped") if e.get("kind") == "update"]
        dropped = {e["msg_id"] for e in drops}
        # a copy the broker redelivers after the kill (spooled, not yet acked) is dropped as a duplicate of
        # the folded one: that is the guarantee working; any other drop of a folded update is not
        both = [e for e in drops if e["msg_id"] in folded and e["reason"] != "duplicate"]
        assert both == [], f"an update both folded and dropped: {both}"
        lost = [e for e in drops if e["reason"] not in ("duplicate", "too-stale", "job-finished")]
        assert lost == [], f"confirmed updates dropped without a reason that is not a loss: {lost}"
        unaccounted = confirmed - folded - dropped
        # what is left in the inbox: the agents' goodbyes, and the updates of an agent still training when the
        # job ended (it uploads before it reads the end): those are there, not lost
        conn = connect(rabbit_url)
        try:
            events = conn.subscribe(f"fedmq.{job_id}.inbox", prefetch=64)
            left = []
            left_updates = []
            while (delivery := events.next(2.0)) is not None:
                env = messages.decode(delivery.body)
                left.append(env.kind.value)
                if env.kind.value == "update":
                    left_updates.append(env.msg_id)
                conn.ack(delivery)
        finally:
            conn.close()
        assert unaccounted <= set(left_updates), (unaccounted, left)
    finally:
        fed.stop_all()
        delete_job_queues(rabbit_url, job_id, fed.clients)
