"""`fedmq agent run --host` and provisioning for hosts, without a broker: each wrong combination of the host
options is one line and exit code 2, the StatefulSet split covers the population once, and a host user's
permissions name its own queues and its own clients' routing keys only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fedmq_procs
import pytest

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import Permissions, User
from fedmq.broker.transport.deprovision import job_users
from fedmq.broker.transport.errors import BrokerError
from fedmq.cli.commands.agent import _host_share, _hosted_clients
from fedmq.cli.commands.broker import _provisioned
from fedmq.cli.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
RUN = ["agent", "run", "--broker", "amqp://127.0.0.1:1/", "--job", "j"]


fedmq = fedmq_procs.fedmq


@pytest.mark.parametrize(
    "args, says",
    [
        ([*RUN, "--host", "h0"], "--host h0 needs --clients"),
        ([*RUN, "--host", "h-0", "--clients", "0-3"], "bad host id 'h-0'"),
        ([*RUN, "--host", "h0", "--clients", "0-3", "--client-id", "agent-0"], "--host serves many clients"),
        ([*RUN, "--host", "h0", "--host-from-hostname", "--hosts", "2"], "not both"),
        (
            [*RUN, "--host-from-hostname", "--client-id-from-hostname", "--hosts", "2"],
            "give one or the other",
        ),
        ([*RUN, "--clients", "0-3"], "give --host too"),
        ([*RUN, "--hosts", "2"], "--hosts N goes with --host-from-hostname"),
        ([*RUN, "--host-from-hostname"], "needs --hosts N"),
        ([*RUN, "--host-from-hostname", "--hosts", "11"], "between 1 and the job's population (10)"),
        ([*RUN, "--host", "h0", "--clients", "5-12"], "client 12 is past the job's population of 10"),
        ([*RUN, "--host", "h0", "--clients", "0-3,3-4"], "overlap"),
        ([*RUN, "--client-id", "agent-0", "--trainers", "2"], "a host's options"),
        ([*RUN, "--host", "h0", "--clients", "0-3", "--index", "1"], "--index"),
        (["broker", "provision", "--job", "j", "--hosts", "agent"], "host id 'agent' is refused"),
        (["broker", "provision", "--job", "j", "--hosts", "a,a"], "names a host twice"),
        (["broker", "provision", "--job", "j"], "--agents must be at least 1 (or give --hosts)"),
        (["broker", "purge", "--job", "j", "--hosts", "h-1"], "bad host id 'h-1'"),
    ],
)
def test_host_usage_errors_are_one_line(args, says, tmp_path):
    proc = fedmq(*args, cwd=tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and says in err, err


def test_a_host_takes_its_population_from_the_job_file(tmp_path):
    (tmp_path / "job.toml").write_text("clients = 2500\n")
    proc = fedmq(*RUN, "--config", str(tmp_path / "job.toml"), "--host", "h1", "--clients", "2000-2500")
    assert proc.returncode == 2 and "client 2500 is past the job's population of 2500" in proc.stderr


@pytest.mark.parametrize("population, hosts", [(8, 2), (10, 3), (2500, 7), (5, 5), (1, 1)])
def test_the_statefulset_split_covers_the_population_once(population, hosts):
    parts = [_host_share(i, hosts, population) for i in range(hosts)]
    assert [name for name, _ in parts] == [f"h{i}" for i in range(hosts)]
    ranges = [r for _, (r,) in parts]
    assert ranges[0][0] == 0 and ranges[-1][1] == population
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    sizes = {hi - lo for lo, hi in ranges}
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(UsageError, match="pod ordinal 7 is past --hosts"):
        _host_share(7, min(hosts, 7), population)


def test_host_from_hostname_reads_the_pod_ordinal(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "fedmq-agent-2")
    assert _hosted_clients(10, None, None, True, 3, None, False, None) == ("h2", [(6, 10)])
    monkeypatch.setattr("socket.gethostname", lambda: "laptop")
    with pytest.raises(UsageError, match="does not end in a pod ordinal"):
        _hosted_clients(10, None, None, True, 3, None, False, None)
    assert _hosted_clients(10, None, None, False, None, "agent-3", False, None) is None
    assert _hosted_clients(10, "h0", "0-2,7", False, None, None, False, None) == ("h0", [(0, 3), (7, 8)])


def _matches(pattern: str, *names: str) -> list[bool]:
    return [re.search(pattern, n) is not None for n in names]


def test_host_permissions_name_its_own_queues_and_clients_only():
    p = prov.host_permissions("j1", "h1")
    assert p.exchange == "fedmq.j1"
    assert (
        _matches(
            p.topic_write,
            "job.j1.report.h1-0",
            "job.j1.update.h1-2499",
            "job.j1.presence.h1-7",
            "job.j1.presence.h1",
        )
        == [True] * 4
    )
    assert not any(
        _matches(
            p.topic_write,
            "job.j1.report.h1",  # the host itself reports nothing
            "job.j1.report.h2-0",  # another host's client
            "job.j1.report.h10-0",  # a host whose id starts with ours
            "job.j1.report.h1-01",
            "job.j1.report.h1-",
            "job.j1.update.agent-0",
            "job.j1.report.h1-0.x",
            "job.j2.report.h1-0",  # another job
            "job.j1.model",
            "job.j1.announce.h1",
        )
    )
    assert (
        _matches(p.topic_read, "job.j1.global", "job.j1.control", "job.j1.announce.h1", "job.j1.grant.h1")
        == [True] * 4
    )
    assert not any(_matches(p.topic_read, "job.j1.announce.h2", "job.j1.grant.h1-0", "job.j1.report.h1-0"))
    own = [t.q_latest("j1", "h1"), t.q_control("j1", "h1")]
    assert _matches(p.configure, *own) == [True, True]
    assert not any(
        _matches(p.configure, t.q_latest("j1", "h2"), t.q_inbox("j1"), t.q_models("j1"), "fedmq.j1")
    )
    assert _matches(p.read, t.q_models("j1"), *own) == [True] * 3
    assert not any(_matches(p.read, t.q_inbox("j1"), t.q_dead("j1"), t.q_latest("j1", "h10")))
    with pytest.raises(ValueError, match="no '-'"):
        prov.host_permissions("j1", "h-1")


class FakeAdmin:
    def __init__(self) -> None:
        self.users: dict[str, str] = {}
        self.perms: dict[str, Permissions] = {}

    def define(self, vhost: str, users: list[User]) -> None:
        for u in users:
            self.users[u.name], self.perms[u.name] = u.password, u.permissions

    def delete_users(self, users) -> None:
        for user in users:
            self.users.pop(user, None)

    def delete_vhost(self, vhost: str) -> None:
        pass


def test_provisioning_makes_a_user_per_host_and_keeps_its_password(tmp_path, monkeypatch):
    admin = FakeAdmin()
    monkeypatch.setattr(prov, "admin_for", lambda url: admin)
    out = tmp_path / "creds.json"
    args = dict(broker="amqp://guest:guest@rabbit:5672/", vhost="v", job="j1", agents=1, namespace="ns")
    prov.provision_cli(
        **args, secrets_out=None, credentials_out=out, remove_guest=False, hosts=prov.host_ids("2")
    )
    creds = json.loads(out.read_text())
    assert sorted(creds["hosts"]) == ["h0", "h1"] and list(creds["agents"]) == ["agent-0"]
    assert creds["hosts"]["h1"]["username"] == "j1.host.h1" and "j1.host.h1" in creds["hosts"]["h1"]["url"]
    assert admin.perms["j1.host.h1"] == prov.host_permissions("j1", "h1")
    assert admin.perms["j1.agent-0"] == prov.agent_permissions("j1", "agent-0")
    manifests = prov.secret_manifests(creds, "ns")
    assert manifests.count("kind: Secret") == 4 and "name: fedmq-host-h1" in manifests
    # provisioning again with the credentials file keeps every password, the hosts' included
    prov.provision_cli(**args, secrets_out=None, credentials_out=out, remove_guest=False, hosts=["h0", "h1"])
    assert json.loads(out.read_text()) == creds
    # deprovisioning finds the hosts' users among the job's
    assert job_users([*admin.users, "j10.host.h1", "j2.agent-0"], "j1") == sorted(admin.users)
    lines = _provisioned("v", "j1", 0, ["h0", "h1"], out, None, False)
    assert "users j1.host.h0 … j1.host.h1: 2 host(s) of job j1" in lines[2] and len(lines) == 4


@pytest.mark.parametrize(
    "agents, hosts, says",
    [
        ([], ["agent"], "host id 'agent' is refused"),
        (["a-3"], ["a"], "its clients a-<n> would be one-client agents' ids (a-3)"),
        (["h0"], ["h0"], "must be unique"),
        ([], ["h-0"], "bad host id"),
    ],
)
def test_provisioning_refuses_a_host_that_could_speak_for_an_agent(agents, hosts, says):
    admin = FakeAdmin()
    with pytest.raises(BrokerError, match=re.escape(says)):
        prov.provision("amqp://rabbit/", vhost="v", job="j1", agents=agents, hosts=hosts, admin=admin)
    assert admin.users == {}  # refused before any user was made


def test_host_ids():
    assert prov.host_ids("3") == ["h0", "h1", "h2"]
    assert prov.host_ids("east, west_2") == ["east", "west_2"]
    for bad in ("0", "a,,b", "a-b", "x,x"):
        with pytest.raises(ValueError):
            prov.host_ids(bad)
