"""`deprovision` against an admin double that records what it is asked: a vhost that goes takes the job's
queues with it (no command per queue), a vhost another job lives in keeps that job's users and queues and
loses only this job's, one by one; the job's users go in one request. Only what provisioning marked goes: a
vhost it did not create, or one holding another application's queue, exchange or user, stays; a user marked
for another vhost (the same job id provisioned there) stays. Against real RabbitMQ:
tests/integration/test_quickstart_services.py."""

from __future__ import annotations

import pytest

from fedmq.broker.transport.admin import PROVISIONED_TAG, Permissions, User, check_owners, owner_tag
from fedmq.broker.transport.deprovision import deprovision
from fedmq.broker.transport.errors import BrokerError

MARKED = [PROVISIONED_TAG]


class Vhost:
    def __init__(self, perms: list[str], queues: list[str], tags=MARKED, exchanges=("amq.topic",)) -> None:
        self.perms, self.queues, self.tags, self.exchanges = (
            list(perms),
            list(queues),
            list(tags),
            list(exchanges),
        )


class Broker:
    """Users with their tags, vhosts, and the list of changes made."""

    def __init__(self, users: dict[str, list[str]], vhosts: dict[str, Vhost]) -> None:
        self.all_users = dict(users)
        self.vhosts = vhosts
        self.changes: list[tuple[str, ...]] = []

    def user_tags(self) -> dict[str, list[str]]:
        return dict(self.all_users)

    def vhost_tags(self, vhost: str) -> list[str] | None:
        return list(self.vhosts[vhost].tags) if vhost in self.vhosts else None

    def vhost_users(self, vhost: str) -> list[str] | None:
        return list(self.vhosts[vhost].perms) if vhost in self.vhosts else None

    def vhost_queues(self, vhost: str) -> list[str]:
        return list(self.vhosts[vhost].queues)

    def vhost_exchanges(self, vhost: str) -> list[str]:
        return list(self.vhosts[vhost].exchanges)

    def delete_queue(self, vhost: str, name: str) -> None:
        self.changes.append(("delete_queue", name))
        self.vhosts[vhost].queues.remove(name)

    def delete_users(self, users) -> None:
        self.changes.append(("delete_users", *users))
        for user in users:
            del self.all_users[user]
            for v in self.vhosts.values():
                if user in v.perms:
                    v.perms.remove(user)

    def delete_vhost(self, vhost: str) -> None:
        self.changes.append(("delete_vhost", vhost))
        del self.vhosts[vhost]

    def define(self, vhost, users) -> None:  # provision's half of the Admin protocol, unused here
        raise AssertionError("deprovision defines nothing")


def job_queues(job: str) -> list[str]:
    return [f"fedmq.{job}.inbox", f"fedmq.{job}.latest.agent-0", f"fedmq.{job}.control.agent-0"]


def marked(vhost: str, *users: str) -> dict[str, list[str]]:
    return {u: [owner_tag(vhost)] for u in users}


def test_a_vhost_that_goes_takes_the_jobs_queues_in_one_command():
    mine = ["fedmq-aggregator.ja", "ja.agent-0", "ja.agent-1"]
    broker = Broker({"guest": ["administrator"], **marked("v", *mine)}, {"v": Vhost(mine, job_queues("ja"))})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert done.vhost_deleted and done.queues == sorted(job_queues("ja"))
    assert [c for c in broker.changes if c[0] == "delete_queue"] == []
    assert broker.changes[-1] == ("delete_vhost", "v")
    # the job's users in one request
    assert [c for c in broker.changes if c[0] == "delete_users"] == [
        ("delete_users", "fedmq-aggregator.ja", "ja.agent-0", "ja.agent-1")
    ]
    assert list(broker.all_users) == ["guest"] and "v" not in broker.vhosts
    assert done.line() == "deprovisioned job ja: deleted 3 user(s), 3 queue(s), vhost 'v'"


def test_a_vhost_another_job_lives_in_stays_with_that_jobs_users_and_queues():
    users = ["fedmq-aggregator.ja", "ja.agent-0", "fedmq-aggregator.jb", "jb.agent-0"]
    broker = Broker(marked("v", *users), {"v": Vhost(users, job_queues("ja") + job_queues("jb"))})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert not done.vhost_deleted and done.vhost_kept_for == ["jb"]
    assert sorted(c[1] for c in broker.changes if c[0] == "delete_queue") == sorted(job_queues("ja"))
    assert broker.vhosts["v"].perms == ["fedmq-aggregator.jb", "jb.agent-0"]
    assert broker.vhosts["v"].queues == job_queues("jb")
    again = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert again.line() == (
        "job ja: nothing to deprovision (vhost 'v': no users or queues of the job)"
        " (kept: job(s) jb live there)"
    )


@pytest.mark.parametrize(
    "extra, holds",
    [
        (dict(queues=["orders"]), "queue 'orders'"),
        (dict(exchanges=["amq.topic", "billing"]), "exchange 'billing'"),
        (dict(perms=["ops"]), "user 'ops'"),
    ],
)
def test_a_vhost_holding_another_applications_things_stays_with_them(extra, holds):
    mine = ["fedmq-aggregator.ja", "ja.agent-0"]
    v = Vhost(mine + extra.get("perms", []), job_queues("ja") + extra.get("queues", []))
    v.exchanges += extra.get("exchanges", [])
    broker = Broker(marked("v", *mine), {"v": v})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert not done.vhost_deleted and "v" in broker.vhosts
    assert broker.vhosts["v"].queues == extra.get("queues", [])  # the job's went one by one, the other stays
    assert done.line() == (
        f"deprovisioned job ja: deleted 2 user(s), 3 queue(s); kept vhost 'v': it holds {holds}"
    )


def test_a_job_of_an_older_version_deprovisions_and_its_unmarked_vhost_stays():
    """Unmarked users with permissions in the vhost are the job's (older versions marked nothing); the vhost,
    not marked as created by provisioning, is never deleted."""
    mine = ["fedmq-aggregator.ja", "ja.agent-0"]
    broker = Broker({u: [] for u in [*mine, "ja.stranger"]}, {"v": Vhost(mine, job_queues("ja"), tags=[])})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert done.users == mine and list(broker.all_users) == ["ja.stranger"]  # no permissions in v: not ours
    assert not done.vhost_deleted and broker.vhosts["v"].queues == []
    assert done.line().endswith(
        "kept vhost 'v': fedmq broker provision did not create it "
        "(or a version that did not mark its vhosts did)"
    )


def test_the_same_job_id_in_another_vhost_keeps_its_users():
    theirs = ["fedmq-aggregator.ja", "ja.agent-0"]
    broker = Broker(marked("w", *theirs), {"v": Vhost([], []), "w": Vhost(theirs, job_queues("ja"))})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert set(broker.all_users) == set(theirs) and done.users == [] and done.vhost_deleted
    assert done.users_kept == theirs and "kept user(s) fedmq-aggregator.ja, ja.agent-0" in done.line()


def test_defining_a_user_another_vhost_or_application_owns_is_refused_in_one_line():
    perms = Permissions("fedmq.ja", "", "", "", "", "")
    users = [User("fedmq-aggregator.ja", "pw", perms), User("ja.agent-0", "pw", perms)]
    check_owners("v", users, marked("v", "ja.agent-0"), set())  # its own vhost's: redefined
    check_owners("v", users, {"ja.agent-0": []}, {"ja.agent-0"})  # an older version's, in v: redefined
    for held, in_vhost in (({"ja.agent-0": [owner_tag("w")]}, set()), ({"ja.agent-0": []}, set())):
        with pytest.raises(BrokerError) as caught:
            check_owners("v", users, held, in_vhost)
        assert "\n" not in str(caught.value) and "ja.agent-0" in str(caught.value)
        assert "already exist and are not fedmq's for vhost 'v'" in str(caught.value)
