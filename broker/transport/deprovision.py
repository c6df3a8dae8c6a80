"""`fedmq broker deprovision`: undo `fedmq broker provision` for one job, touching nothing not the job's.

It deletes the job's users (``fedmq-aggregator.<job>``, every ``<job>.<client>`` and ``<job>.host.<host>``:
topology.aggregator_user, agent_user, host_user) that provisioning marked as made for this vhost (the tag
``fedmq-vhost:<vhost>``: broker.transport.admin.owner_tag; a user of an older version, unmarked, goes when
it holds permissions in the vhost), the job's queues (``fedmq.<job>.*``) in the vhost, and the vhost itself
only when provisioning created it (tagged ``fedmq-provisioned``) and it holds nothing else: no queue, exchange
or user with permissions there that is not the job's (another job's, or another application's). A vhost
that goes takes the job's queues with it; only in a vhost that stays are they deleted one by one. Running it
again finds nothing and says so: it is idempotent. Like provisioning it talks to RabbitMQ with
``rabbitmqctl`` on the broker's machine, else the management HTTP API (broker.transport.admin), and reads
what is there with broker.transport.inventory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import PROVISIONED_TAG, Admin, admin_for, owner_vhosts
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.inventory import inventory_for

_QUEUE_PREFIX = "fedmq."


def job_users(users: list[str], job: str) -> list[str]:
    """The users `fedmq broker provision --job job` makes (ids hold no '.', so the prefix is the job's)."""
    aggregator = t.aggregator_user(job)
    return sorted(u for u in users if u == aggregator or u.startswith(f"{job}."))


def _other_job(name: str, job: str) -> str | None:
    """The job a provisioned user, a queue or an exchange belongs to, if not ``job``; else None."""
    m = re.match(rf"^(?:{re.escape(t.AGGREGATOR_USER)}\.|{re.escape(_QUEUE_PREFIX)})([A-Za-z0-9_-]+)", name)
    if m and m.group(1) != job:
        return m.group(1)
    return None


def _foreign_exchange(name: str, job: str) -> bool:
    """Not RabbitMQ's own (``amq.*``), nor the job's, nor the one the jobs of older versions shared."""
    mine = name == t.exchange(job) or name.startswith(t.exchange(job) + ".")  # what its aggregator may make
    return not (mine or name.startswith("amq.") or name == t.LEGACY_EXCHANGE)


@dataclass
class Deprovisioned:
    job: str
    vhost: str
    users: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    vhost_deleted: bool = False
    vhost_kept_for: list[str] = field(default_factory=list)  # other jobs still in the vhost
    vhost_holds: list[str] = field(default_factory=list)  # what else keeps it: "queue 'q'", "user 'u'", …
    vhost_unmarked: bool = False  # not created by provisioning: never deleted
    users_kept: list[str] = field(default_factory=list)  # the job id's users another vhost's job owns
    vhost_missing: bool = False

    def _kept(self) -> str:
        """Why a vhost that exists stays, after '; ' or ' ', or ''."""
        if self.vhost_kept_for:
            return f"kept vhost {self.vhost!r}: job(s) {', '.join(self.vhost_kept_for)} still live there"
        if self.vhost_holds:
            more = " …" if len(self.vhost_holds) > 3 else ""
            return f"kept vhost {self.vhost!r}: it holds {', '.join(self.vhost_holds[:3])}{more}"
        if self.vhost_unmarked:
            return (
                f"kept vhost {self.vhost!r}: fedmq broker provision did not create it "
                "(or a version that did not mark its vhosts did)"
            )
        return ""

    def line(self) -> str:
        """What was done, in one line."""
        others = (
            f"; kept user(s) {', '.join(self.users_kept)}: another vhost's job" if self.users_kept else ""
        )
        if not (self.users or self.queues or self.vhost_deleted):
            where = "no vhost " + repr(self.vhost) if self.vhost_missing else f"vhost {self.vhost!r}"
            kept = (
                f" (kept: job(s) {', '.join(self.vhost_kept_for)} live there)" if self.vhost_kept_for else ""
            )
            return (
                f"job {self.job}: nothing to deprovision ({where}: no users or queues of the job){kept}"
                + others
            )
        done = [f"{len(self.users)} user(s)", f"{len(self.queues)} queue(s)"]
        if self.vhost_deleted:
            done.append(f"vhost {self.vhost!r}")
        text = f"deprovisioned job {self.job}: deleted {', '.join(done)}"
        if kept := self._kept():
            text += "; " + kept
        return text + others


def deprovision(url: str, *, vhost: str, job: str, admin: Admin | None = None) -> Deprovisioned:
    """Delete ``job``'s users and queues in ``vhost`` and the vhost when it is fedmq's and holds nothing else
    (module docstring)."""
    try:
        t.check_name("vhost", vhost)
        t.check_name("job id", job)
    except ValueError as exc:
        raise BrokerError(str(exc)) from None
    admin = admin or admin_for(url)
    inv = inventory_for(admin)
    result = Deprovisioned(job, vhost)
    in_vhost = inv.vhost_users(vhost)
    result.vhost_missing = in_vhost is None
    for user, tags in sorted(inv.user_tags().items()):
        if user not in job_users([user], job):
            continue
        owners = owner_vhosts(tags)
        if vhost in owners or (not owners and user in (in_vhost or ())):
            result.users.append(user)
        elif owners:
            result.users_kept.append(user)
    if in_vhost is not None:
        queues, exchanges = inv.vhost_queues(vhost), inv.vhost_exchanges(vhost)
        result.queues = sorted(q for q in queues if q.startswith(f"{_QUEUE_PREFIX}{job}."))
        names = [*queues, *exchanges, *in_vhost]
        result.vhost_kept_for = sorted({o for o in (_other_job(n, job) for n in names) if o})
        result.vhost_holds = [
            *(f"queue {q!r}" for q in queues if q not in result.queues and not _other_job(q, job)),
            *(f"exchange {e!r}" for e in exchanges if _foreign_exchange(e, job) and not _other_job(e, job)),
            *(f"user {u!r}" for u in in_vhost if u not in result.users and not _other_job(u, job)),
        ]
        result.vhost_unmarked = PROVISIONED_TAG not in (inv.vhost_tags(vhost) or [])
    delete_vhost = not (result.vhost_missing or result.vhost_kept_for or result.vhost_holds)
    delete_vhost = delete_vhost and not result.vhost_unmarked
    if not delete_vhost:  # the vhost stays: the job's queues go one by one
        for name in result.queues:
            inv.delete_queue(vhost, name)
    admin.delete_users(result.users)  # one request for all of them
    if delete_vhost:
        admin.delete_vhost(vhost)  # and the job's queues with it: one command, not one per queue
        result.vhost_deleted = True
    return result
