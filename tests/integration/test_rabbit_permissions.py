"""Identity and permissions on the shared RabbitMQ: provisioned users can do only what they should."""

from __future__ import annotations

import json
import threading
import time
import uuid

import fedmq_procs
import pika
import pika.exceptions as pe
import pytest
from load_factor import budget

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import CtlAdmin, HttpAdmin, admin_for
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def fed(rabbit_url, job_id):
    """A fresh vhost with the job's aggregator and two agents (per-job user names), removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    vhost, agents = f"fedmqt-{tag}", [f"a1-{tag}", f"a2-{tag}"]
    admin = CtlAdmin()
    creds = prov.provision(rabbit_url, vhost=vhost, job=job_id, agents=agents, admin=admin)
    yield creds
    admin.delete_users([creds["aggregator"]["username"], *(e["username"] for e in creds["agents"].values())])
    admin.delete_vhost(vhost)


def _channel(url: str):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    return conn, conn.channel()


def test_provisioned_users_are_confined(fed, job_id):
    a1, a2 = list(fed["agents"])
    agg_url, a1_url = fed["aggregator"]["url"], fed["agents"][a1]["url"]
    with connect(agg_url) as agg, connect(a1_url) as agent:
        with pytest.raises(BrokerError, match="may not create it.*start the aggregator first"):
            agent.declare_job(job_id, [a1], inbox=False)  # fresh vhost: no exchange yet
        agg.declare_job(job_id, [a1, a2], model_bytes=1000)
        agent.declare_job(job_id, [a1], inbox=False)  # an agent may (re)declare its own queues
        # every agent may read the job's model stream, none may write it or another agent's announcements
        agg.publish(t.rk_model(job_id), b"model v0", message_id="m0")
        assert agent.fetch(t.q_models(job_id), "m0", offset="first", timeout=10).body == b"model v0"
        for key in (t.rk_model(job_id), t.rk_announce(job_id, a2), t.rk_grant(job_id, a2), t.rk_dead(job_id)):
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                agent.publish(key, b"forged")
        got: list = []
        done = threading.Event()
        agg.consume(t.q_inbox(job_id), lambda d: (got.append(d), agg.ack(d), done.set()))
        agent.publish(t.rk_update(job_id, a1), b"mine", message_id="u1")
        assert done.wait(budget(10))
        assert (got[0].body, got[0].user_id) == (
            b"mine",
            t.agent_user(job_id, a1),
        )  # RabbitMQ-validated identity

        # publishing another agent's routing key is refused
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.publish(t.rk_update(job_id, a2), b"forged")
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.publish(t.rk_global(job_id), b"fake model")
        # reading the aggregator's inbox or another agent's queue is refused
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.consume(t.q_inbox(job_id), lambda d: None)
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.consume(t.q_latest(job_id, a2), lambda d: None)
        with pytest.raises(
            BrokerError, match="403|ACCESS_REFUSED"
        ):  # nor the dead letters (only the operator's)
            agent.consume(t.q_dead(job_id), lambda d: None)
        assert agg.queue_depth(t.q_dead(job_id)) == 0  # the aggregator declared it, and may read it
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.declare_job(job_id, [a2], inbox=False)
        # its own queues work, and the connection survived the refusals
        mine: list = []
        agent.consume(t.q_latest(job_id, a1), lambda d: (mine.append(d.body), agent.ack(d)))
        agg.publish(t.rk_global(job_id), b"theta")
        agent.publish(t.rk_report(job_id, a1), b"loss", message_id="r1")
        assert agent.status()["reconnects"] == 0

    # setting another user's user_id is refused by RabbitMQ itself
    conn, ch = _channel(a1_url)
    ch.confirm_delivery()
    with pytest.raises(pe.ChannelClosedByBroker) as exc:
        ch.basic_publish(
            t.exchange(job_id),
            t.rk_update(job_id, a1),
            b"x",
            pika.BasicProperties(user_id=t.agent_user(job_id, a2)),
        )
    assert exc.value.reply_code == 406
    # binding its own queue to another agent's updates (to eavesdrop) is refused by topic permissions
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as exc:
        ch.queue_bind(t.q_control(job_id, a1), t.exchange(job_id), routing_key=t.rk_update(job_id, a2))
    assert exc.value.reply_code == 403
    ch = conn.channel()  # nor to another agent's announcements
    with pytest.raises(pe.ChannelClosedByBroker) as exc:
        ch.queue_bind(t.q_latest(job_id, a1), t.exchange(job_id), routing_key=t.rk_announce(job_id, a2))
    assert exc.value.reply_code == 403
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as exc:
        ch.queue_delete(t.q_inbox(job_id))
    assert exc.value.reply_code == 403
    conn.close()
    prov.purge(fed["aggregator"]["url"], job_id, [a1, a2])


def test_provisioned_users_route_updates_to_edges_and_only_the_aggregator_speaks_for_the_tiers(fed, job_id):
    """Two-tier aggregation: an agent's update to its edge reaches that edge's queue; it may not send another
    agent's, read an edge's queue, or speak as an aggregator (edge-round, partial); the aggregator's user,
    which edges run as, sends both and they arrive where they belong."""
    a1, a2 = list(fed["agents"])
    with connect(fed["aggregator"]["url"]) as agg, connect(fed["agents"][a1]["url"]) as agent:
        agg.declare_job(job_id, [a1, a2], model_bytes=1000, edges=(0, 1))
        at_edge: list = []
        at_root: list = []
        agg.consume(t.q_edge(job_id, 1), lambda d: (at_edge.append(d.body), agg.ack(d)))
        agg.consume(t.q_inbox(job_id), lambda d: (at_root.append(d.body), agg.ack(d)))
        agent.publish(t.rk_edge_update(job_id, a1, 1), b"mine", message_id="u1")
        agg.publish(t.rk_edge(job_id, 1), b"edge-round", message_id="e1")
        agg.publish(t.rk_partial(job_id, 1), b"partial", message_id="p1")
        wait = time.monotonic() + budget(10)
        while (len(at_edge) < 2 or not at_root) and time.monotonic() < wait:
            time.sleep(0.05)
        assert sorted(at_edge) == [b"edge-round", b"mine"] and at_root == [b"partial"]
        for key in (t.rk_edge_update(job_id, a2, 1), t.rk_partial(job_id, 0), t.rk_edge(job_id, 0)):
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                agent.publish(key, b"forged")
        with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
            agent.consume(t.q_edge(job_id, 0), lambda d: None)
    prov.purge(fed["aggregator"]["url"], job_id, [a1, a2])


def test_provision_is_idempotent_and_writes_secrets(rabbit_url, tmp_path, job_id):
    tag = uuid.uuid4().hex[:8]
    vhost, agg, agents = f"fedmqt-{tag}", f"agg-{tag}", [f"x-{tag}"]
    admin = CtlAdmin()
    try:
        first = prov.provision(
            rabbit_url, vhost=vhost, job=job_id, agents=agents, admin=admin, aggregator_user=agg
        )
        keep = {e["username"]: e["password"] for e in [first["aggregator"], *first["agents"].values()]}
        # a user of an older version, with topic permissions on the exchange every job shared then
        old = t.agent_user(job_id, agents[0])
        admin.run("set_topic_permissions", "-p", vhost, old, t.LEGACY_EXCHANGE, ".*", ".*")
        again = prov.provision(
            rabbit_url,
            vhost=vhost,
            job=job_id,
            agents=agents,
            admin=admin,
            aggregator_user=agg,
            passwords=keep,
        )
        assert again == first
        held = admin.run("list_topic_permissions", "-p", vhost, "--quiet", "--no-table-headers")
        assert sorted(line.split("\t")[:2] for line in held.splitlines()) == sorted(
            [[agg, t.exchange(job_id)], [old, t.exchange(job_id)]]
        ), held  # narrowed to its job's exchange
        with connect(again["agents"][agents[0]]["url"]) as b:
            assert b.user == t.agent_user(job_id, agents[0])
        rotated = prov.provision(
            rabbit_url, vhost=vhost, job=job_id, agents=agents, admin=admin, aggregator_user=agg
        )
        assert rotated["agents"][agents[0]]["password"] != first["agents"][agents[0]]["password"]
        with pytest.raises(BrokerError, match="cannot connect.*authentication refused"):
            connect(first["agents"][agents[0]]["url"])
        yaml = prov.secret_manifests(rotated, namespace="ns1")
        assert yaml.count("kind: Secret") == 2 and f"name: fedmq-agent-{agents[0]}" in yaml
        assert "namespace: ns1" in yaml and json.dumps(rotated["agents"][agents[0]]["password"]) in yaml
    finally:
        admin.delete_users([agg, *(t.agent_user(job_id, a) for a in agents)])
        admin.delete_vhost(vhost)
    with pytest.raises(BrokerError, match="bad client id"):
        prov.provision(rabbit_url, vhost=vhost, job=job_id, agents=["no good"], admin=admin)
    with pytest.raises(BrokerError, match="bad job id"):
        prov.provision(rabbit_url, vhost=vhost, job="no.good", agents=agents, admin=admin)


def test_check_and_purge(rabbit_url, job_id):
    with connect(rabbit_url) as b:
        b.declare_job(job_id, ["c1"])
        b.publish(t.rk_update(job_id, "c1"), b"x")
        b.publish(t.rk_update(job_id, "c1"), b"y")
    info = prov.check(rabbit_url, job_id)
    assert info["reachable"] is True and info["version"].startswith("3.")
    assert info["max_message_size"] == 134217728  # the shared 3.10 node's default
    assert info["queues"][t.q_inbox(job_id)]["messages"] == 2
    deleted = prov.purge(rabbit_url, job_id)
    assert set(deleted) >= {t.q_inbox(job_id), t.q_latest(job_id, "c1"), t.q_control(job_id, "c1")}
    assert prov.check(rabbit_url, job_id)["queues"][t.q_inbox(job_id)].get("missing") is True
    with pytest.raises(BrokerError, match="cannot connect"):
        prov.check("amqp://guest:guest@127.0.0.1:1/%2F", job_id)


@pytest.mark.isolated_node
def test_provision_through_the_management_api(rabbit_node, job_id):
    admin = HttpAdmin(rabbit_node.management_url, "guest", "guest")
    agents = ["h1", "h2"]
    creds = prov.provision(rabbit_node.url, vhost="fedmq-http", job=job_id, agents=agents, admin=admin)
    try:
        keep = {e["username"]: e["password"] for e in [creds["aggregator"], *creds["agents"].values()]}
        old = t.agent_user(job_id, "h1")
        legacy = {"exchange": t.LEGACY_EXCHANGE, "write": ".*", "read": ".*"}
        admin.call("PUT", f"/api/topic-permissions/fedmq-http/{old}", legacy)
        assert (
            prov.provision(
                rabbit_node.url, vhost="fedmq-http", job=job_id, agents=agents, admin=admin, passwords=keep
            )
            == creds
        )
        held = admin.call("GET", "/api/vhosts/fedmq-http/topic-permissions")
        users = [t.aggregator_user(job_id), *(t.agent_user(job_id, a) for a in agents)]
        assert sorted((h["user"], h["exchange"]) for h in held) == sorted(
            (u, t.exchange(job_id)) for u in users
        ), held  # narrowed to its job's exchange
        with connect(creds["aggregator"]["url"]) as agg, connect(creds["agents"]["h1"]["url"]) as a1:
            assert agg.user == t.aggregator_user(job_id)
            agg.declare_job(job_id, agents)
            a1.publish(t.rk_update(job_id, "h1"), b"mine")
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                a1.publish(t.rk_update(job_id, "h2"), b"forged")
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                a1.consume(t.q_inbox(job_id), lambda d: None)
            assert agg.queue_depth(t.q_inbox(job_id)) == 1
    finally:
        admin.delete_users([t.aggregator_user(job_id), *(t.agent_user(job_id, a) for a in agents)])
        admin.delete_vhost("fedmq-http")
    with pytest.raises(BrokerError, match="HTTP 401"):
        HttpAdmin(rabbit_node.management_url, "guest", "wrong").define("nope", [])


@pytest.mark.isolated_node
def test_users_go_in_one_request_and_those_already_gone_are_skipped(rabbit_node, rabbit_url, job_id):
    """rabbitmqctl (one eval for all) and the management API (bulk-delete) alike; through rabbitmqctl a name
    an Erlang literal cannot hold as it is goes by its own delete_user."""
    from fedmq.broker.transport.inventory import inventory_for

    http = HttpAdmin(rabbit_node.management_url, "guest", "guest")
    for admin, url in ((CtlAdmin(), rabbit_url), (http, rabbit_node.url)):
        vhost = "fedmq-del-" + uuid.uuid4().hex[:6]
        creds = prov.provision(url, vhost=vhost, job=job_id, agents=["a0", "a1"], admin=admin)
        users = [creds["aggregator"]["username"], *(e["username"] for e in creds["agents"].values())]
        odd = f"{job_id} odd"
        if isinstance(admin, CtlAdmin):
            admin.run("add_user", odd, "pw")
            users.append(odd)
        try:
            assert set(users) <= set(inventory_for(admin).user_tags())
            admin.delete_users([*users, f"{job_id}.never-was"])
            assert not set(users) & set(inventory_for(admin).user_tags()), type(admin).__name__
            admin.delete_users(users)  # all gone already: nothing to do, no error
        finally:
            admin.delete_vhost(vhost)


def test_admin_choice_by_broker_location(monkeypatch):
    monkeypatch.delenv("FEDMQ_BROKER_USER", raising=False)
    monkeypatch.delenv("FEDMQ_BROKER_PASSWORD", raising=False)
    remote = admin_for("amqps://boss:s3cret@rabbit.example:5671/")
    assert isinstance(remote, HttpAdmin) and remote.base == "https://rabbit.example:15671"
    assert isinstance(admin_for("amqp://u:p@10.1.2.3/"), HttpAdmin)
    assert isinstance(admin_for("amqp://guest:guest@127.0.0.1:5672/"), CtlAdmin)
    with pytest.raises(BrokerError, match="amqp"):
        admin_for("memory://x")


def test_provision_configures_the_node_the_url_names(rabbit_node, tmp_path):
    """A local URL's port decides the broker: rabbitmqctl's default node listening elsewhere is one line and
    nothing is configured anywhere; FEDMQ_RABBITMQ_NODE names the node of that port,
    which then gets the users."""
    from pathlib import Path

    vhost = "fedmq-port-" + uuid.uuid4().hex[:6]
    cmd = fedmq_procs.command(
        "broker",
        "provision",
        "--broker",
        rabbit_node.url,
        "--vhost",
        vhost,
        "--job",
        "portjob",
        "--agents",
        "1",
        "--credentials-out",
        str(tmp_path / "creds.json"),
        "--secrets-out",
        str(tmp_path / "secrets"),
    )
    root = Path(__file__).resolve().parents[2]
    wrong = fedmq_procs.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    assert wrong.returncode == 2, wrong.stderr
    assert wrong.stderr.strip() == (
        f"error: rabbitmqctl's default node listens on port(s) 5672, not {rabbit_node.port}:"
        f" name the node of port {rabbit_node.port} with FEDMQ_RABBITMQ_NODE"
    )
    assert not (tmp_path / "creds.json").exists()
    assert vhost not in CtlAdmin().run("list_vhosts", "--quiet")  # the shared broker was not touched
    env = {
        **rabbit_node.env(),
        "FEDMQ_RABBITMQ_NODE": rabbit_node.name,
        "FEDMQ_RABBITMQCTL": str(Path("/usr/lib/rabbitmq/bin/rabbitmqctl")),
    }
    right = fedmq_procs.run(cmd, capture_output=True, text=True, timeout=120, cwd=root, env=env)
    try:
        assert right.returncode == 0, right.stderr[-2000:]
        assert vhost in rabbit_node.ctl("list_vhosts", "--quiet")
        creds = json.loads((tmp_path / "creds.json").read_text())
        secrets = sorted((tmp_path / "secrets").iterdir())
        assert [p.name for p in secrets] == ["fedmq-agent-agent-0.yaml", "fedmq-aggregator.yaml"]
        for path in [tmp_path / "creds.json", *secrets]:  # passwords: the owner's alone
            assert path.stat().st_mode & 0o077 == 0, path
        with connect(creds["agents"]["agent-0"]["url"]) as agent:
            assert agent.user == "portjob.agent-0"  # per-job user names
    finally:
        rabbit_node.ctl("delete_vhost", vhost, check=False)


def test_two_jobs_in_one_vhost_are_isolated(rabbit_url):
    """Provisioning job B (same client ids, same vhost) leaves job A's users as they were, and no user of B
    can read, write, bind to or delete anything of A."""
    tag = uuid.uuid4().hex[:8]
    vhost, job_a, job_b, agents = f"fedmqt-{tag}", f"ja{tag}", f"jb{tag}", ["agent-0"]
    admin = CtlAdmin()
    a = prov.provision(rabbit_url, vhost=vhost, job=job_a, agents=agents, admin=admin)
    b = prov.provision(rabbit_url, vhost=vhost, job=job_b, agents=agents, admin=admin)
    try:
        assert a["agents"]["agent-0"]["username"] != b["agents"]["agent-0"]["username"]
        with (
            connect(a["aggregator"]["url"]) as agg_a,
            connect(a["agents"]["agent-0"]["url"]) as a0,
            connect(b["aggregator"]["url"]) as agg_b,
            connect(b["agents"]["agent-0"]["url"]) as b0,
        ):
            agg_a.declare_job(job_a, agents, model_bytes=1000)  # A's credentials still work: nothing rotated
            agg_b.declare_job(job_b, agents, model_bytes=1000)
            a0.declare_job(job_a, agents, inbox=False)
            agg_a.publish(t.rk_model(job_a), b"model of A", message_id="ma")
            for forged in (t.rk_presence(job_a, "agent-0"), t.rk_update(job_a, "agent-0")):
                with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                    b0.publish(forged, b"into A's inbox")
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                b0.declare_job(job_a, agents, inbox=False)  # A's queues: neither declared nor bound
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                b0.fetch(t.q_models(job_a), "ma", offset="first", timeout=10)  # A's model stream
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                agg_b.consume(t.q_inbox(job_a), lambda d: None)
            for key in (t.rk_model(job_a), t.rk_control(job_a)):
                with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                    agg_b.publish(key, b"forged")
            assert agg_a.queue_depth(t.q_inbox(job_a)) == 0
        conn, ch = _channel(b["agents"]["agent-0"]["url"])
        with pytest.raises(pe.ChannelClosedByBroker) as exc:  # eavesdropping on A's models via its own queue
            ch.queue_bind(t.q_latest(job_b, "agent-0"), t.exchange(job_a), routing_key=t.rk_global(job_a))
        assert exc.value.reply_code == 403
        ch = conn.channel()
        with pytest.raises(pe.ChannelClosedByBroker) as exc:
            ch.queue_delete(t.q_latest(job_a, "agent-0"))
        assert exc.value.reply_code == 403
        conn.close()
    finally:
        for creds in (a, b):
            admin.delete_users(
                [creds["aggregator"]["username"], *(e["username"] for e in creds["agents"].values())]
            )
        admin.delete_vhost(vhost)
