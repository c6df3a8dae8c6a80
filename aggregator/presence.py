"""Who is online: agents' and hosts' presence as the aggregator's engine notes it (aggregator.engine).

A one-client agent is online while its own beats are recent (within the job's presence window, three
heartbeats). A host (one agent process serving many clients, client_agent.host) beats once for all of them
with its roster (the client numbers it serves): a hosted client is online while its host is and it has not
said it went offline. A roster is taken whole or refused whole, with its reason counted in the inbox's
``dropped``: past the job's population, clients a live host already serves, or a client online as its own
agent. A host's presence for one of its clients counts only for a client of its roster
(``client-outside-roster``). Each sender's budget of presence messages: aggregator.presence_budget."""

from __future__ import annotations

import math
import time

import structlog

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.inbox import Inbox, Received
from fedmq.aggregator.presence_budget import PER_WINDOW
from fedmq.broker.transport import topology
from fedmq.broker.wire import messages

log = structlog.get_logger(__name__)


class Presence:
    """The presence of a job's agents and hosts (one engine thread reads and writes it)."""

    def __init__(self, cfg: JobConfig, inbox: Inbox) -> None:
        self.cfg = cfg
        self.inbox = inbox
        self.seen: dict[str, tuple[float, int]] = {}  # client -> (last seen, version it holds)
        # hosts (agent processes serving many clients): host -> last seen; a hosted client is online while
        # its host is (one beat per host, not per client) and it has not said it went offline
        self.hosts: dict[str, float] = {}
        self.hosted: dict[str, str] = {}  # client -> the host serving it (from the hosts' rosters)
        self.rosters: dict[str, tuple[tuple[int, int], ...]] = {}  # host -> the client numbers it serves
        self._epoch = 0  # counts the presence changes that may change who is online (online())
        # (epoch, valid until, names, the hosts and one-client agents they came from): see online()
        self._online: tuple[int, float, list[str], set[str], list[str]] = (-1, 0.0, [], set(), [])

    def clear(self) -> None:
        """Forget every agent and host (the job ended)."""
        self.seen.clear()
        self.hosts.clear()
        self.rosters.clear()
        self._epoch += 1

    def holds(self, client: str) -> int:
        """The version ``client``'s presence says it holds."""
        return self.seen.get(client, (0.0, messages.NO_VERSION))[1]

    def online(self) -> list[str]:
        """The clients seen within three heartbeats (a hosted one: its host), sorted. O(population) to list,
        so the list is kept while no presence changed who may be online (``_epoch``); once the first of its
        hosts or agents could have expired, a check of those alone (O(hosts + one-client agents)) extends it
        or finds it stale: the status and the round's phases ask for it several times a round."""
        now = time.time()
        window = self.cfg.presence_window_s
        horizon = now - window
        epoch, until, names, hosts, agents = self._online
        if epoch == self._epoch:
            if now < until:
                return names
            alive = {h for h, seen in self.hosts.items() if seen >= horizon}
            seen = [self.seen.get(c, (0.0, 0))[0] for c in agents]
            if alive == hosts and all(s >= horizon for s in seen):
                first = min([self.hosts[h] for h in hosts] + seen, default=math.inf)
                self._online = (epoch, first + window, names, hosts, agents)
                return names
        alive = {h for h, seen in self.hosts.items() if seen >= horizon}
        hosted = self.hosted
        names, agents = [], []
        for c, (seen, _) in self.seen.items():
            h = hosted.get(c)
            if h is None and seen >= horizon:
                agents.append(c)
            elif h in alive:
                names.append(c)
        names += agents
        names.sort()
        first = min([self.hosts[h] for h in alive] + [self.seen[c][0] for c in agents], default=math.inf)
        self._online = (self._epoch, first + window, names, alive, agents)
        return names

    def note(self, msg: Received) -> list[str]:
        """Note an agent's or a host's presence and ack it; the clients it says went offline."""
        env = msg.env
        if "clients" in env.payload:  # (_note_host counts the changes that may change who is online)
            left = self._note_host(env.client, env.payload["state"] == "online", env.payload["clients"])
        else:
            horizon = time.time() - self.cfg.presence_window_s
            if self.seen.get(env.client, (0.0, 0))[0] < horizon or env.payload["state"] != "online":
                self._epoch += 1
            left = [] if env.payload["state"] == "online" else [env.client]
            own = msg.delivery.user_id in (env.client, f"{self.cfg.job}.{env.client}")
            if not own and not self._in_roster(env.client, msg.delivery.user_id):
                self.inbox.drop(msg, "client-outside-roster")
                return []
            if self.hosted.get(env.client) is not None and own:
                # the client speaks for itself again (a one-client agent): its host no longer does
                del self.hosted[env.client]
                self._epoch += 1
            if left:
                self.seen.pop(env.client, None)
            else:
                self.seen[env.client] = (time.time(), env.payload["holds"])
        self.inbox.ack(msg)
        return left

    def _in_roster(self, client: str, user: str | None) -> bool:
        """A presence of ``client`` its own agent did not send: the inbox let it through from the user of the
        host ``client`` is named for (aggregator.inbox), whose word counts only for a client of its roster --
        within the population, so a host cannot make up clients (a shared identity proves nobody's)."""
        if self.cfg.identity.startswith("shared:") or self.hosted.get(client) == topology.host_of(client):
            return True
        log.warning("presence for a client outside its host's roster: refused", client=client, user=user)
        return False

    def allowance(self, sender: str) -> int:
        """Presence messages ``sender`` may send in a window (aggregator.presence_budget): a host's grows with
        its roster, as each of its clients may go offline and come back."""
        roster = self.rosters.get(sender.removeprefix(f"{self.cfg.job}.host."))
        return PER_WINDOW + 2 * sum(hi - lo for lo, hi in roster) if roster else PER_WINDOW

    def _note_host(self, host: str, online: bool, ranges: list[list[int]]) -> list[str]:
        """A host's presence: a beat (its roster unchanged), a new roster, or the host leaving with all its
        clients. A roster that names clients past the job's population is refused whole."""
        now = time.time()
        horizon = now - self.cfg.presence_window_s
        roster = tuple((lo, hi) for lo, hi in ranges)
        revived = self.hosts.get(host, 0.0) < horizon  # new, or back after its clients expired: check again
        if not online or revived or self.rosters.get(host, roster) != roster:
            self._epoch += 1
            left = [c for c, h in self.hosted.items() if h == host]  # O(K), only when a host's roster changes
            for c in left:
                del self.hosted[c]
                self.seen.pop(c, None)
            self.rosters.pop(host, None)
            if not online:
                self.hosts.pop(host, None)
                return left
        self.hosts[host] = now
        if host in self.rosters:
            return []
        if any(hi > self.cfg.clients for _, hi in roster):
            self.inbox.dropped["roster-past-population"] += 1
            log.warning("host roster past the job's population: refused", host=host, clients=self.cfg.clients)
            return []
        twice = next(
            (
                other
                for other, ranges in self.rosters.items()
                if self.hosts.get(other, 0.0) >= horizon
                and any(lo < b and a < hi for lo, hi in roster for a, b in ranges)
            ),
            None,
        )
        if twice is not None:  # one shard, two clients: e.g. the pods of an old and a new split at once
            self.inbox.dropped["clients-served-twice"] += 1
            log.warning("host serves client numbers a live host serves: refused", host=host, other=twice)
            return []
        self.rosters[host] = roster
        self._epoch += 1
        for lo, hi in roster:
            for n in range(lo, hi):
                client = topology.host_client(host, n)
                # its id names its host, so only an agent of its own (user <job>.<client>) can hold it too
                if client not in self.hosted and self.seen.get(client, (0.0, 0))[0] >= horizon:
                    self.inbox.dropped["client-claimed-elsewhere"] += 1
                    log.warning("client online as its own agent: its host's claim refused", client=client)
                    continue
                self.hosted[client] = host
                self.seen[client] = (now, messages.NO_VERSION)
        return []
