"""docs/quickstart-services.md, run as written: the commands of its `sh` code blocks, in order, in one
shell (`bash -e`: a command that fails fails the test), with a job id and vhost of this test's own. Then what
they should have done: the job ran its rounds with three agents under their own users, `fedmq status` showed
it, and `fedmq broker deprovision` left no user, queue or vhost of the job (and says so when run again).

Also the messages the walkthrough mentions: `fedmq broker purge` as guest on the job's vhost and `fedmq
status` with its default URL are sentences that point the way, not exception class names."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import fedmq_procs
import pytest

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport.admin import admin_for
from fedmq.broker.transport.deprovision import deprovision

pytestmark = pytest.mark.rabbitmq
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "quickstart-services.md"
BIN = str(Path(sys.executable).parent)  # the venv's fedmq and python, as an activated venv has them


def doc_commands() -> str:
    """The walkthrough's shell commands: every ```sh block, in order."""
    blocks = re.findall(r"^```sh\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) >= 8, "the walkthrough lost its commands"
    return "\n".join(blocks)


def ctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", *args, "-q"], capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def admin(rabbit_url):
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not on this machine")
    try:
        return admin_for(rabbit_url)
    except Exception as exc:  # not allowed to run it (not root), or another node
        pytest.skip(f"rabbitmqctl cannot administer the test broker: {exc}")


@pytest.fixture
def names(admin, rabbit_url):
    tag = uuid.uuid4().hex[:8]
    job, vhost = f"qs{tag}", f"fedmq-qs{tag}"
    yield job, vhost
    deprovision(rabbit_url, vhost=vhost, job=job, admin=admin)  # whatever the test left


fedmq = fedmq_procs.fedmq


def test_the_quickstart_runs_as_written(tmp_path, names):
    job, vhost = names
    (tmp_path / "quickstart.sh").write_text(doc_commands())
    env = {**os.environ, "JOB": job, "VHOST": vhost, "PATH": BIN + os.pathsep + os.environ["PATH"]}
    env.update(COLUMNS="100", OMP_NUM_THREADS="1")
    proc = fedmq_procs.popen(
        ["bash", "-e", "quickstart.sh"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the aggregator and agents it starts in the background: one group to stop
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
    assert proc.returncode == 0, (err[-3000:], logs)
    # provision said what it made
    assert f"vhost {vhost}: ready" in out and f"users {job}.agent-0 … {job}.agent-2: 3 agent(s)" in out
    # status, during the run and after it
    assert "agents online" in out and re.search(r"phase\s+│\s+finished", out), out[-3000:]
    # the job ran its rounds with its three agents, each under its own user
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and not summary["rejected"], summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r["received"]) for r in rows] == [["agent-0", "agent-1", "agent-2"]] * 2
    for i in range(3):
        assert f"job {job} finished: agent agent-{i} left" in logs[f"agent-{i}.log"]
    # deprovisioned: nothing of the job is left, and a second run says so
    assert f"deprovisioned job {job}: deleted 4 user(s), 9 queue(s), vhost '{vhost}'" in out
    again = fedmq("broker", "deprovision", "--job", job, "--vhost", vhost, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == (  # no user of the job and no vhost are left
        f"job {job}: nothing to deprovision (no vhost {vhost!r}: no users or queues of the job)"
    )


def test_deprovision_keeps_a_vhost_another_job_lives_in(tmp_path, names, admin, rabbit_url):
    job, vhost = names
    other = job + "b"
    try:
        for j in (job, other):
            prov.provision(rabbit_url, vhost=vhost, job=j, agents=["agent-0"], admin=admin)
        first = fedmq("broker", "deprovision", "--job", job, "--vhost", vhost, cwd=tmp_path)
        assert first.returncode == 0 and first.stdout.strip() == (
            f"deprovisioned job {job}: deleted 2 user(s), 0 queue(s); "
            f"kept vhost '{vhost}': job(s) {other} still live there"
        )
        assert vhost in ctl("list_vhosts").split()
        assert {f"fedmq-aggregator.{other}", f"{other}.agent-0"} <= set(ctl("list_users").split())
        last = fedmq("broker", "deprovision", "--job", other, "--vhost", vhost, cwd=tmp_path)
        assert (
            last.stdout.strip()
            == f"deprovisioned job {other}: deleted 2 user(s), 0 queue(s), vhost '{vhost}'"
        )
    finally:
        deprovision(rabbit_url, vhost=vhost, job=other, admin=admin)


def test_purge_as_guest_and_status_in_the_wrong_vhost_are_sentences(tmp_path, names, admin, rabbit_url):
    job, vhost = names
    prov.provision(rabbit_url, vhost=vhost, job=job, agents=["agent-0"], admin=admin)
    purge = fedmq(
        "broker",
        "purge",
        "--job",
        job,
        "--broker",
        f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
        cwd=tmp_path,
    )
    assert purge.returncode == 2 and "Error" not in purge.stderr
    assert purge.stderr.strip().splitlines() == [
        f"error: cannot connect to amqp://guest:***@127.0.0.1:5672/{vhost}: access to virtual host "
        f"'{vhost}' refused for user 'guest' (a provisioned vhost admits only its jobs' users: use a URL "
        "from the credentials file, e.g. the job's aggregator URL)"
    ]
    status = fedmq("status", "--job", job, cwd=tmp_path)
    assert status.returncode == 1 and len(status.stderr.strip().splitlines()) == 1
    assert f"no job '{job}' in vhost '/' on amqp://guest:***@127.0.0.1:5672/%2F" in status.stderr
    assert "--broker amqp://USER:PASS@HOST:PORT/VHOST" in status.stderr


def test_deprovision_touches_nothing_that_is_not_the_jobs(tmp_path, names, admin, rabbit_url):
    """Another application's queue (with its message) keeps the vhost; the job id provisioned in a second
    vhost is refused in one line, never rotating or deleting the first's users."""
    import pika

    job, vhost = names
    app = f"app-{vhost}"
    try:
        creds = prov.provision(rabbit_url, vhost=vhost, job=job, agents=["agent-0"], admin=admin)
        ctl("add_user", app, "app-pw")
        ctl("set_permissions", "-p", vhost, app, ".*", ".*", ".*")
        url = f"amqp://{app}:app-pw@127.0.0.1:5672/{vhost}"
        with pika.BlockingConnection(pika.URLParameters(url)) as conn:
            ch = conn.channel()
            ch.queue_declare("orders", durable=True)
            ch.basic_publish("", "orders", b"order 1", pika.BasicProperties(delivery_mode=2))
        ctl("delete_user", app)  # the queue stays without its user
        refused = f"already exist and are not fedmq's for vhost '{vhost}x'"
        with pytest.raises(prov.BrokerError, match=refused):
            prov.provision(rabbit_url, vhost=vhost + "x", job=job, agents=["agent-0"], admin=admin)
        assert vhost + "x" not in ctl("list_vhosts").split()
        with pika.BlockingConnection(pika.URLParameters(creds["aggregator"]["url"])):
            pass  # its password was not rotated
        done = fedmq("broker", "deprovision", "--job", job, "--vhost", vhost, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == (
            f"deprovisioned job {job}: deleted 2 user(s), 0 queue(s); "
            f"kept vhost '{vhost}': it holds queue 'orders'"
        )
        held = ctl("list_queues", "-p", vhost, "name", "messages", "--no-table-headers")
        assert held.split() == ["orders", "1"]
    finally:
        ctl("delete_user", app)
        for v in (vhost, vhost + "x"):  # (the second only if provisioning went ahead there)
            ctl("delete_vhost", v)
