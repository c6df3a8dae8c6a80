"""On a private RabbitMQ node: what one job, or one operator command, can do to another job.

* ``fedmq broker check`` and ``fedmq broker purge`` with a local URL talk to the node listening on the URL's
  port (``FEDMQ_RABBITMQ_NODE``), or say in one line that rabbitmqctl's node is another. Before: both asked
  rabbitmqctl's default node; ``purge`` printed "purged job …", exited 0 and left every agent queue.
* A job id whose users would be another job's (``fedmq-aggregator``, ``agent-N``) is refused at provisioning
  in one line. Before: job ``fedmq-aggregator``'s agent ``agent-0`` was job ``agent-0``'s aggregator, and
  provisioning one rotated the other's password.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fedmq_procs
import pytest

from fedmq.broker.transport.connect import connect

pytestmark = [pytest.mark.isolated_node]

ROOT = Path(__file__).resolve().parents[2]
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


fedmq = fedmq_procs.fedmq


def node_env(node) -> dict[str, str]:
    return {**node.env(), "FEDMQ_RABBITMQ_NODE": node.name, "FEDMQ_RABBITMQCTL": CTL}


def job_queues_on(node, job: str) -> list[str]:
    out = node.ctl("list_queues", "name", "--quiet", "--no-table-headers")
    return sorted(q.strip() for q in out.splitlines() if q.strip().startswith(f"fedmq.{job}."))


def test_check_and_purge_talk_to_the_urls_node(rabbit_node):
    job = "jx" + uuid.uuid4().hex[:6]
    with connect(rabbit_node.url) as b:
        b.declare_job(job, ["agent-0", "agent-1"], model_bytes=1 << 20)
    before = job_queues_on(rabbit_node, job)
    assert len(before) == 7  # dead, inbox, models, 2 x (latest, control)
    wrong = f"error: rabbitmqctl's default node listens on port(s) 5672, not {rabbit_node.port}:"
    for cmd in (("broker", "check", "--job", job), ("broker", "purge", "--job", job)):
        out = fedmq(*cmd, "--broker", rabbit_node.url)
        assert out.returncode == 2 and out.stderr.strip().startswith(wrong), (out.returncode, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and "purged" not in out.stdout
    assert job_queues_on(rabbit_node, job) == before  # nothing deleted by the refused purge
    checked = fedmq(
        "broker", "check", "--job", job, "--json", "--broker", rabbit_node.url, env=node_env(rabbit_node)
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
    info = json.loads(checked.stdout)
    assert info["max_message_size"] == 16 * 1024 * 1024  # this node's setting, not the default node's
    purged = fedmq("broker", "purge", "--job", job, "--broker", rabbit_node.url, env=node_env(rabbit_node))
    assert purged.returncode == 0 and purged.stdout.strip() == f"purged job {job}", purged.stderr[-2000:]
    assert job_queues_on(rabbit_node, job) == []  # the agents' queues too


@pytest.mark.parametrize("job", ["fedmq-aggregator", "agent-0"])
def test_a_job_id_whose_users_collide_is_refused(rabbit_node, tmp_path, job):
    vhost = "fedmq-names-" + uuid.uuid4().hex[:6]
    out = fedmq(
        "broker",
        "provision",
        "--broker",
        rabbit_node.url,
        "--vhost",
        vhost,
        "--job",
        job,
        "--agents",
        "2",
        "--credentials-out",
        str(tmp_path / "creds.json"),
        env=node_env(rabbit_node),
    )
    try:
        assert out.returncode == 2, out.stderr[-2000:]
        line = out.stderr.strip()
        assert line.count("\n") == 0 and line.startswith(f"error: job id {job!r} is refused"), line
        assert not (tmp_path / "creds.json").exists()
        assert vhost not in rabbit_node.ctl("list_vhosts", "--quiet")
    finally:
        rabbit_node.ctl("delete_vhost", vhost, check=False)
