"""`fedmq broker deprovision`: undo `fedmq broker provision` for one job.

It deletes the job's users (``fedmq-aggregator.<job>``, every ``<job>.<client>`` and ``<job>.host.<host>``:
topology.aggregator_user, agent_user, host_user), the job's queues (``fedmq.<job>.*``) in the vhost, and the
vhost itself unless another job lives there (its queues, or its provisioned users' permissions: several jobs
may share one vhost, and deprovisioning one never touches another). A vhost that goes takes the job's queues
with it; only in a vhost that stays are they deleted one by one. Running it again finds
nothing and says so: it is idempotent. Like provisioning it talks to RabbitMQ with ``rabbitmqctl`` on the
broker's machine, else the management HTTP API (broker.transport.admin).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import Admin, CtlAdmin, HttpAdmin, admin_for
from fedmq.broker.transport.errors import BrokerError

_QUEUE_PREFIX = "fedmq."


class Inventory(Protocol):
    """What deprovisioning needs to see and delete beyond admin.Admin."""

    def users(self) -> list[str]: ...
    def vhost_users(self, vhost: str) -> list[str] | None:
        """The users with permissions in ``vhost``; None when there is no such vhost."""

    def vhost_queues(self, vhost: str) -> list[str]: ...
    def delete_queue(self, vhost: str, name: str) -> None: ...


class CtlInventory:
    def __init__(self, admin: CtlAdmin) -> None:
        self.admin = admin

    def _rows(self, *args: str, ok_text: str = "") -> list[list[str]]:
        out = self.admin.run(*args, "--quiet", "--no-table-headers", ok_text=ok_text)
        return [line.split("\t") for line in out.splitlines() if line.strip()]

    def users(self) -> list[str]:
        return [row[0] for row in self._rows("list_users")]

    def vhost_users(self, vhost: str) -> list[str] | None:
        # one command for both: list_permissions fails on a vhost that does not exist (each rabbitmqctl
        # command starts an Erlang VM)
        gone = f"Virtual host '{vhost}' does not exist"
        rows = self._rows("list_permissions", "-p", vhost, ok_text=gone)
        return None if any(gone in "\t".join(row) for row in rows) else [row[0] for row in rows]

    def vhost_queues(self, vhost: str) -> list[str]:
        return [row[0] for row in self._rows("list_queues", "-p", vhost, "name")]

    def delete_queue(self, vhost: str, name: str) -> None:
        self.admin.run("delete_queue", "-p", vhost, name, ok_text="not found")


class HttpInventory:
    def __init__(self, admin: HttpAdmin) -> None:
        self.admin = admin

    def _names(self, path: str, key: str) -> list[str]:
        rows = self.admin.call("GET", path, ok=(404,)) or []
        return [str(row[key]) for row in rows if isinstance(row, dict) and key in row]

    def users(self) -> list[str]:
        return self._names("/api/users", "name")

    def vhost_users(self, vhost: str) -> list[str] | None:
        rows = self.admin.call("GET", f"/api/vhosts/{quote(vhost, safe='')}/permissions", ok=(404,))
        return None if rows is None else [str(r["user"]) for r in rows if isinstance(r, dict) and "user" in r]

    def vhost_queues(self, vhost: str) -> list[str]:
        return self._names(f"/api/queues/{quote(vhost, safe='')}", "name")

    def delete_queue(self, vhost: str, name: str) -> None:
        self.admin.call("DELETE", f"/api/queues/{quote(vhost, safe='')}/{quote(name, safe='')}", ok=(404,))


def inventory_for(admin: Admin) -> Inventory:
    if isinstance(admin, CtlAdmin):
        return CtlInventory(admin)
    if isinstance(admin, HttpAdmin):
        return HttpInventory(admin)
    if all(hasattr(admin, m) for m in ("users", "vhost_users", "vhost_queues", "delete_queue")):
        return admin  # type: ignore[return-value]  # an admin that lists for itself (tests' doubles)
    raise BrokerError(f"cannot list users and queues with {type(admin).__name__}")


def job_users(users: list[str], job: str) -> list[str]:
    """The users `fedmq broker provision --job job` makes (ids hold no '.', so the prefix is the job's)."""
    aggregator = t.aggregator_user(job)
    return sorted(u for u in users if u == aggregator or u.startswith(f"{job}."))


def _other_job(name: str, job: str) -> str | None:
    """The job a provisioned user or a queue belongs to, if not ``job``; None for anything else."""
    m = re.match(rf"^(?:{re.escape(t.AGGREGATOR_USER)}\.|{re.escape(_QUEUE_PREFIX)})([A-Za-z0-9_-]+)", name)
    if m and m.group(1) != job:
        return m.group(1)
    return None


@dataclass
class Deprovisioned:
    job: str
    vhost: str
    users: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    vhost_deleted: bool = False
    vhost_kept_for: list[str] = field(default_factory=list)  # other jobs still in the vhost
    vhost_missing: bool = False

    def line(self) -> str:
        """What was done, in one line."""
        if not (self.users or self.queues or self.vhost_deleted):
            where = "no vhost " + repr(self.vhost) if self.vhost_missing else f"vhost {self.vhost!r}"
            kept = (
                f" (kept: job(s) {', '.join(self.vhost_kept_for)} live there)" if self.vhost_kept_for else ""
            )
            return f"job {self.job}: nothing to deprovision ({where}: no users or queues of the job){kept}"
        done = [f"{len(self.users)} user(s)", f"{len(self.queues)} queue(s)"]
        if self.vhost_deleted:
            done.append(f"vhost {self.vhost!r}")
        text = f"deprovisioned job {self.job}: deleted {', '.join(done)}"
        if self.vhost_kept_for:
            text += f"; kept vhost {self.vhost!r}: job(s) {', '.join(self.vhost_kept_for)} still live there"
        return text


def deprovision(url: str, *, vhost: str, job: str, admin: Admin | None = None) -> Deprovisioned:
    """Delete ``job``'s users and queues and, unless another job lives there, ``vhost`` (module docstring)."""
    try:
        t.check_name("vhost", vhost)
        t.check_name("job id", job)
    except ValueError as exc:
        raise BrokerError(str(exc)) from None
    admin = admin or admin_for(url)
    inv = inventory_for(admin)
    result = Deprovisioned(job, vhost)
    vhost_users = inv.vhost_users(vhost)
    exists = vhost_users is not None
    result.vhost_missing = not exists
    if vhost_users is not None:
        queues = inv.vhost_queues(vhost)
        result.queues = sorted(q for q in queues if q.startswith(f"{_QUEUE_PREFIX}{job}."))
        others = {_other_job(n, job) for n in [*queues, *vhost_users]}
        result.vhost_kept_for = sorted(o for o in others if o)
        if result.vhost_kept_for:  # the vhost stays: the job's queues go one by one
            for name in result.queues:
                inv.delete_queue(vhost, name)
    result.users = job_users(inv.users(), job)
    admin.delete_users(result.users)  # one request for all of them
    if exists and not result.vhost_kept_for:
        admin.delete_vhost(vhost)  # and the job's queues with it: one command, not one per queue
        result.vhost_deleted = True
    return result
