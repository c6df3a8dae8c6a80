"""`deprovision` against an admin double that records what it is asked: a vhost that goes takes the job's
queues with it (no command per queue), a vhost another job lives in keeps that job's users and queues and
loses only this job's, one by one; the job's users go in one request. Against real RabbitMQ:
tests/integration/test_quickstart_services.py."""

from __future__ import annotations

from fedmq.broker.transport.deprovision import deprovision


class Broker:
    """Users, per-vhost permissions and queues, and the list of changes made."""

    def __init__(self, users: list[str], vhosts: dict[str, tuple[list[str], list[str]]]) -> None:
        self.all_users = list(users)
        self.vhosts = {v: (list(perms), list(queues)) for v, (perms, queues) in vhosts.items()}
        self.changes: list[tuple[str, ...]] = []

    def users(self) -> list[str]:
        return list(self.all_users)

    def vhost_users(self, vhost: str) -> list[str] | None:
        return list(self.vhosts[vhost][0]) if vhost in self.vhosts else None

    def vhost_queues(self, vhost: str) -> list[str]:
        return list(self.vhosts[vhost][1])

    def delete_queue(self, vhost: str, name: str) -> None:
        self.changes.append(("delete_queue", name))
        self.vhosts[vhost][1].remove(name)

    def delete_users(self, users) -> None:
        self.changes.append(("delete_users", *users))
        for user in users:
            self.all_users.remove(user)
            for perms, _queues in self.vhosts.values():
                if user in perms:
                    perms.remove(user)

    def delete_vhost(self, vhost: str) -> None:
        self.changes.append(("delete_vhost", vhost))
        del self.vhosts[vhost]

    def define(self, vhost, users) -> None:  # provision's half of the Admin protocol, unused here
        raise AssertionError("deprovision defines nothing")


def job_queues(job: str) -> list[str]:
    return [f"fedmq.{job}.inbox", f"fedmq.{job}.latest.agent-0", f"fedmq.{job}.control.agent-0"]


def test_a_vhost_that_goes_takes_the_jobs_queues_in_one_command():
    users = ["guest", "fedmq-aggregator.ja", "ja.agent-0", "ja.agent-1"]
    broker = Broker(users, {"v": (users, job_queues("ja"))})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert done.vhost_deleted and done.queues == sorted(job_queues("ja"))
    assert [c for c in broker.changes if c[0] == "delete_queue"] == []
    assert broker.changes[-1] == ("delete_vhost", "v")
    # the job's users in one request
    assert [c for c in broker.changes if c[0] == "delete_users"] == [
        ("delete_users", "fedmq-aggregator.ja", "ja.agent-0", "ja.agent-1")
    ]
    assert broker.all_users == ["guest"] and "v" not in broker.vhosts
    assert done.line() == "deprovisioned job ja: deleted 3 user(s), 3 queue(s), vhost 'v'"


def test_a_vhost_another_job_lives_in_stays_with_that_jobs_users_and_queues():
    users = ["guest", "fedmq-aggregator.ja", "ja.agent-0", "fedmq-aggregator.jb", "jb.agent-0"]
    broker = Broker(users, {"v": (users, job_queues("ja") + job_queues("jb"))})
    done = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert not done.vhost_deleted and done.vhost_kept_for == ["jb"]
    assert sorted(c[1] for c in broker.changes if c[0] == "delete_queue") == sorted(job_queues("ja"))
    assert broker.vhosts["v"] == (["guest", "fedmq-aggregator.jb", "jb.agent-0"], job_queues("jb"))
    again = deprovision("amqp://127.0.0.1:5672/v", vhost="v", job="ja", admin=broker)
    assert again.line() == (
        "job ja: nothing to deprovision (vhost 'v': no users or queues of the job)"
        " (kept: job(s) jb live there)"
    )
