"""The client agent: join a job, wait to be selected, fetch that round's global model, train, report, upload
when granted, repeat.

An agent that is not selected does nothing but stay present: round announcements are small, and only a
selected agent reads the announced version from the job's model stream (the form it can apply: a delta
against the version it holds, the pull-down subset, or the full model). It owns no model between rounds: it
borrows one from a TrainerPool for the round, and keeps only what the job's algorithm needs
(client_agent.state).

Threads: the broker's own I/O thread keeps the connection (and its heartbeats) alive; the broker's dispatcher
thread only queues deliveries here; the agent thread trains; a presence thread announces the agent while it
is online. Going offline (availability model or fault) closes the connection for real.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict

import structlog
import torch

from fedmq import client_map, defaults
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker, Subscription
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.broker.wire.messages import RoundConfig
from fedmq.client_agent.availability import Availability, Faults
from fedmq.client_agent.joining import decode_event, join, leave, publish_presence
from fedmq.client_agent.secure_upload import FREED, SecureUpload, flat_change
from fedmq.client_agent.state import MemoryStore
from fedmq.client_agent.trainers import TrainerPool
from fedmq.errors import CodecError, FedmqError
from fedmq.hooks import PROTOCOL, ClientContext, ClientHook, Kept, install_gradient_terms, stable_seed
from fedmq.manifest import Manifest
from fedmq.params import bind
from fedmq.plugins import is_import_path, load_class
from fedmq.privacy.client_dp import ClientDP
from fedmq.state_checks import state_problem
from fedmq.tasks.base import State, Task, TrainResult, load_state, model_state

log = structlog.get_logger(__name__)

Connect = Callable[[], Broker]
FETCH_TIMEOUT_S = 60.0  # the announced model is in the stream before the announce is sent: this is generous
FIRST_TRY_S = 15.0  # reading from the publish time; then from the stream's start (see _read_model)


@dataclass
class AgentLog:
    """What the agent did, for tests and the fault-suite audit: confirmed uploads per round."""

    # (round, update msg id), after the broker confirmed
    uploads: list[tuple[int, str]] = field(default_factory=list)
    rounds_trained: list[int] = field(default_factory=list)
    offline_rounds: list[int] = field(default_factory=list)
    faults: list[tuple[int, str]] = field(default_factory=list)
    fetched_bytes: int = 0  # model messages read from the stream
    # round -> (n_samples, tensors sent); kept only when asked (tests)
    sent: dict[int, tuple[int, dict]] | None = None


class ClientHookError(FedmqError):
    """The job's strategy needs a client side this agent cannot run: the agent leaves the job (one line)."""


class Offline(Exception):
    """Raised inside the agent loop to leave the broker (availability model or injected fault)."""

    def __init__(self, why: str, graceful: bool) -> None:
        super().__init__(why)
        self.graceful = graceful


@dataclass
class Prepared:
    """A trained round's update, encoded while the trainer was borrowed; sent when granted."""

    result: TrainResult
    body: bytes
    msg_id: str
    sent: dict[str, torch.Tensor] | None = None  # the tensors sent (only when AgentLog.sent is kept)
    edges: int = 0  # the round's edge aggregators (RoundConfig.edges): 0, the update goes to the inbox


class AgentArgs(TypedDict, total=False):
    """The keywords of Agent that a Host (client_agent.host) passes on to every client's round as given; the
    others (heartbeat, rejoin delay, seed, trainers, store) it uses itself too."""

    availability: Availability | None
    faults: Faults | None
    device: str
    progress: Callable[[str, int, int], None] | None
    strategy: str
    audit_log: str | Path | None  # a JSON line per confirmed upload (Agent._audit); a host's: every client's
    seeded_noise: bool  # privacy noise from the job's seed (`fedmq simulate` only), not the OS CSPRNG


class Agent:
    # one client's side of secure aggregation in a round (a subclass may send otherwise: the hostile tests)
    secure_upload: type[SecureUpload] = SecureUpload

    def __init__(
        self,
        connect: Connect,
        job: str,
        client: str,
        index: int,
        task: Task,
        *,
        availability: Availability | None = None,
        faults: Faults | None = None,
        device: str = "cpu",
        heartbeat_s: float = defaults.HEARTBEAT_S,
        rejoin_s: float = defaults.REJOIN_S,
        seed: int = 0,
        trainers: TrainerPool | None = None,
        store: Any = None,
        audit_log: str | Path | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        strategy: str = "",
        seeded_noise: bool = False,
    ) -> None:
        self.connect, self.job, self.client, self.index, self.task = connect, job, client, index, task
        self.seeded_noise = seeded_noise
        self.availability = availability or Availability()
        self.faults = faults or Faults()
        self.device, self.heartbeat_s, self.rejoin_s, self.seed = device, heartbeat_s, rejoin_s, seed
        self.trainers = trainers or TrainerPool(task, 1, seed)
        # what is kept between rounds (client_agent.state)
        self.store = store if store is not None else MemoryStore()
        self.progress = progress  # (client, steps done, steps total) during local training, for progress bars
        self.audit_log = Path(audit_log) if audit_log else None  # JSON lines: one per broker-confirmed upload
        self.stop = threading.Event()
        self.finished = False  # set when the aggregator said the job is over
        self.finish_round = False  # a stop still lets the round under way end (its grant, its upload)
        self.manifest = self.trainers.manifest
        self.model_names = frozenset(self.manifest.names)
        self.groups = self.trainers.groups
        self.version = messages.NO_VERSION  # the version of the global model kept (NO_VERSION: none)
        # the newest announcement read while a secure buffer held this client (asynchronous jobs)
        self.newer: Envelope | None = None
        self.uploaded = 0  # uploads this agent object confirmed (a host's: this round's)
        self.answered = False  # its last secure round's unmasking answered (a host's: this round's)
        self.last_round = 0
        self.log = AgentLog()
        # client hooks this agent may import when an announcement names one: fedmq's own, and those in the
        # module of the job's strategy as this agent was told it (a package.module:Class strategy)
        self.hook_modules = {strategy.partition(":")[0]} if is_import_path(strategy) else set()
        self._hooks: dict[str, type[ClientHook]] = {}
        self._events: Subscription | None = None  # announcements and grants of the current connection
        self._broker: Broker | None = None
        self._refused: BrokerError | None = None  # a heartbeat refused for good: the agent ends with it
        # told when an asynchronous buffer's check-in is out, with the version trained from (a host parks
        # the client's round: client_agent.host)
        self.on_check_in: Callable[[Agent, int], None] | None = None

    @property
    def connected(self) -> bool:
        """Joined the job (for /readyz): False while offline, reconnecting or stopped."""
        return self._broker is not None

    # ------------------------------------------------------------------ connection
    def _join(self) -> Broker:
        joined = join(self.connect, self.job, self.client, self.stop, lambda b: self._presence("online", b))
        if joined is None:
            raise Offline("stopped", True)
        self._broker, self._events = joined
        return self._broker

    def _leave(self, graceful: bool) -> None:
        broker, self._broker = self._broker, None
        leave(broker, (lambda b: self._presence("offline", b)) if graceful else None)

    def _presence(self, state: str, broker: Broker | None = None, timeout: float | None = None) -> None:
        broker = broker or self._broker
        if broker is None:
            return
        env = messages.presence(self.job, self.client, state, self.version)
        publish_presence(broker, self.job, self.client, env, timeout)

    def _heartbeats(self) -> None:
        # a seeded phase per client: agents started together would otherwise heartbeat in bursts of K
        phase = (stable_seed(self.client, "beat") % 1000) / 1000 * self.heartbeat_s
        if self.stop.wait(phase):
            return
        while not self.stop.wait(self.heartbeat_s):
            # a beat is worth nothing once the aggregator's horizon (3 beats) has passed: never wait longer
            try:
                self._presence("online", timeout=3 * self.heartbeat_s)
            except BrokerError as exc:
                if exc.permanent:  # refused for good (broker.transport.errors.refusal): the agent ends
                    self._refused = exc
            except AttributeError:
                pass

    # ------------------------------------------------------------------ main loop
    def run(self) -> AgentLog:
        beat = threading.Thread(target=self._heartbeats, name=f"{self.client}-presence", daemon=True)
        beat.start()
        while not self.stop.is_set():
            try:
                self._join()
                self._serve()
            except ClientHookError:  # the job needs what this agent cannot run: say so and leave the job
                self._leave(True)
                raise
            except Offline as off:
                self._leave(off.graceful)
                if not self.stop.is_set():
                    log.info("agent offline", client=self.client, why=str(off))
                    self.stop.wait(self.rejoin_s)
            except BrokerError as exc:  # connection lost for good: drop it and join again
                if exc.permanent:
                    self._leave(False)
                    raise
                log.warning("broker connection lost", client=self.client, error=str(exc))
                self._leave(False)
                self.stop.wait(self.rejoin_s)
        self._leave(True)
        return self.log

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self._refused is not None:
                raise self._refused
            # idle agents wake rarely (simulate runs K of them)
            env = self._next(timeout=max(self.heartbeat_s, 0.5))
            if env is not None and env.kind is Kind.ANNOUNCE:
                self._on_announce(env)
            while self.newer is not None and not self.stop.is_set():
                env, self.newer = self.newer, None  # read while a secure buffer held us
                self._on_announce(env)

    def _next(self, timeout: float) -> Envelope | None:
        events = self._events
        delivery = events.next(timeout) if events is not None else None
        if delivery is None:
            return None
        broker = self._broker
        try:
            env = decode_event(delivery.body, self.job)
        except CodecError as exc:
            log.warning("message rejected", client=self.client, reason=exc.reason)
            if broker:
                broker.reject(delivery, requeue=False)
            return None
        if broker:
            broker.ack(delivery)
        if env.kind is Kind.END:  # the job ran all its rounds: leave (run() returns)
            log.info("job finished: leaving", client=self.client, rounds=env.payload["rounds"])
            self.finished = True
            self.stop.set()
            return None
        return env

    # ------------------------------------------------------------------ the global model
    def _kept(self, name: str) -> tuple[int, State] | None:
        return self.store.get(self.client, name)

    def _fetch_model(
        self, env: Envelope, manifest: Manifest | None = None, own: State | None = None
    ) -> State | None:
        """The announced version, from what we keep or from the model stream (the smallest form we can apply),
        with the strategy's extra tensors when ``manifest`` names them; a partial push is laid over ``own``
        (the client's own values, ClientHook.own_state) or else the model we keep. None when it cannot be had
        (logged): we sit this round out."""
        manifest = manifest or self.manifest
        version = env.model_version
        kept = self._kept("model")
        if kept is not None and kept[0] == version:
            return kept[1]
        entries = env.payload["models"]
        if own is None and kept is not None:
            own = kept[1]
        entry = (
            next((e for e in entries if kept is not None and e["base_version"] == kept[0] >= 0), None)
            or next((e for e in entries if e["partial"] and own is not None), None)
            or next(
                (e for e in entries if e["base_version"] == messages.NO_VERSION and not e["partial"]), None
            )
        )
        broker = self._broker
        if entry is None or broker is None:
            log.warning("no form of the announced model we can apply", client=self.client, version=version)
            return None
        try:
            menv = self._read_model(broker, entry, version)
            if menv.payload["base_version"] >= 0:  # a delta onto the version we keep: ours alone
                if kept is None or menv.payload["base_version"] != kept[0]:
                    raise CodecError("unexpected", "a delta onto a version this client does not keep")
                state = decode_state(menv.payload["tensors"], manifest, kept[1])
            else:  # the same for every client of this process that reads this message
                tensors = menv.payload["tensors"]
                state = self.trainers.shared_decode(
                    (entry["id"], tuple(manifest.names)), lambda: decode_state(tensors, manifest, None)
                )
        except CodecError as exc:
            log.warning("global model rejected", client=self.client, reason=exc.reason, detail=str(exc))
            return None
        except BrokerError as exc:  # not in the stream (aged out, or the connection went): sit this round out
            log.warning("global model not fetched", client=self.client, error=str(exc))
            return None
        pushed = {k: torch.from_numpy(v) for k, v in state.items()}
        if menv.payload["partial"]:  # dynamic pulling downwards: keep our own values for the rest
            assert own is not None
            pushed = {k: pushed.get(k, own[k]) for k in manifest.names}
        elif len(pushed) < len(manifest):
            log.warning(
                "global model rejected", client=self.client, reason="partial", detail="tensors missing"
            )
            return None
        return pushed

    def _read_model(self, broker: Broker, entry: dict[str, Any], version: int) -> Envelope:
        """Read one announced model message from the job's stream (by its id, from where it was published).

        The start is the aggregator's clock; a broker whose clock is behind by more than the second it rounds
        down to would make the read start after the model: then read the whole stream (a few models) again."""
        queue = topology.q_models(self.job)
        try:
            delivery = broker.fetch(queue, entry["id"], offset=entry["since"], timeout=FIRST_TRY_S)
        except BrokerError:
            log.info(
                "model not found from its publish time; reading the stream from its start", client=self.client
            )
            delivery = broker.fetch(queue, entry["id"], offset="first", timeout=FETCH_TIMEOUT_S)
        self.log.fetched_bytes += len(delivery.body)
        menv = messages.decode(delivery.body)
        if menv.kind is not Kind.MODEL or menv.job != self.job or menv.model_version != version:
            raise CodecError("unexpected", f"{menv.kind.value} v{menv.model_version} is not model v{version}")
        return menv

    # ------------------------------------------------------------------ one round
    def _on_announce(self, env: Envelope) -> None:
        rnd, payload = env.round, env.payload
        sync = payload["mode"] == "sync"
        if sync and (rnd <= self.last_round or self.client not in payload["selected"]):
            return
        with self.trainers.taking_part(rnd, payload["selected"] if sync else (), self.client):
            try:
                self._take_part(env, sync)
            except CodecError as exc:  # what the announce asks cannot be built: sit this round out
                log.warning("announce rejected", client=self.client, reason=exc.reason, detail=str(exc))

    def _take_part(self, env: Envelope, sync: bool) -> None:
        rnd, payload = env.round, env.payload
        if not self.availability.online(self.client, rnd if sync else env.model_version):
            self.log.offline_rounds.append(rnd)
            raise Offline(f"availability model: offline in slot {rnd}", True)
        self.last_round = rnd
        cfg = RoundConfig.from_payload(payload["config"])
        version = env.model_version
        hooks = self._client_hooks(payload.get("client"), version)
        faults = self.faults.draw(self.client, rnd)
        log.info("round training", client=self.client, round=rnd, version=version)
        if "cut" in faults:
            self.log.faults.append((rnd, "cut"))
            raise Offline("fault: connection cut", False)
        # secure aggregation: the keys go out now, so that the cohort forms while the clients train
        clip = cfg.secagg_clip
        if clip:
            self._check_secure(payload.get("client"))
        secure = self.secure_upload(self, rnd, version, clip, cfg.train.seed, not sync) if clip else None
        if secure is not None and sync:
            secure.advertise()  # (an asynchronous buffer's client checks in once it has trained)
        context = ClientContext(self.client, rnd, version, cfg.train.seed, self.groups)
        context.noise_seed = cfg.train.seed if self.seeded_noise else None
        for hook, _ in hooks:
            hook.context = context
            if secure is not None and isinstance(hook, ClientDP):
                secure.dp = hook
        own = next((s for hook, kept in hooks if (s := hook.own_state(kept)) is not None), None)
        # decoding before a trainer is free overlaps another client's training; clients go in in fold order
        with self.trainers.ahead((rnd, self.client)):
            manifest = self._manifest_for(hooks)
            held = self._fetch_model(env, manifest, own)
            if held is None:
                return
            why = state_problem(held, {t.name: t.shape for t in manifest})
            if why is not None:  # a model (or control variate) no step could move: not trained, not kept
                raise CodecError("bad-state", f"global model of version {version}: {why}")
            context.held = held
            start = held
            for hook, kept in hooks:
                start = hook.start(start, kept)
            with self.trainers.borrow() as model:
                result = self._train(model, start, cfg, rnd, crash="crash-train" in faults, hooks=hooks)
                trained = self._trained_state(model)
            # the trainer is free again: the next client trains while this one encodes its update
            if secure is not None:
                change = flat_change(self._finish(trained, result, hooks), held)
                self._keep(held, cfg, version)
                # while it waits for the cohort, the client holds its change and nothing model-sized else
                held = start = trained = context.held = context.trained = {}
                FREED.took()
            else:
                prepared = self._prepare(trained, held, cfg, rnd, version, result, hooks=hooks)
            waits = secure is not None or (sync and cfg.grant) or "slow" in faults or "crash-grant" in faults
            if not waits:  # sent while paced: a broker that slows uploads then slows the training too
                self._report(rnd, version, result)
                self._upload(rnd, version, prepared)
                return
        if "slow" in faults:
            self.log.faults.append((rnd, "slow"))
            time.sleep(self.faults.slow_seconds)
        self._report(rnd, version, result)
        if secure is not None:
            self.answered = secure.run(change, result, lambda: self._crash_after_grant(rnd, faults))
            return
        if sync and cfg.grant and not self._wait_grant(rnd):
            return
        self._crash_after_grant(rnd, faults)
        self._upload(rnd, version, prepared)

    def _upload_masked(self, rnd: int, version: int, result: TrainResult, env: Envelope) -> None:
        """Upload a masked update (secure aggregation): uncompressed, as its bytes are uniform."""
        self._upload(rnd, version, Prepared(result, messages.encode(env, level=0), env.msg_id))

    def _note_fault(self, rnd: int, what: str) -> None:
        self.log.faults.append((rnd, what))

    def _crash_after_grant(self, rnd: int, faults: set[str]) -> None:
        """The crash-grant fault: down after the grant, before the upload (under secure aggregation: after
        sharing its keys, before the masked upload)."""
        if "crash-grant" in faults:
            self.log.faults.append((rnd, "crash-grant"))
            raise Offline("fault: crashed after the grant", False)

    def _report(self, rnd: int, version: int, result: TrainResult) -> None:
        self._send(
            messages.report(self.job, rnd, self.client, version, result.reported, result.n_samples),
            topology.rk_report(self.job, self.client),
        )

    def _client_hooks(self, spec: Any, version: int) -> list[tuple[ClientHook, Kept]]:
        """The round's client hooks (fedmq.hooks), built from the announcement's client map, each with the
        client's state kept for it; none when the job has no client side. ClientHookError (one line) when this
        agent cannot run one."""
        if not spec:
            return []
        if spec["version"] > PROTOCOL:
            raise ClientHookError(
                f"the job's rounds need client-map version {spec['version']}; "
                f"this agent reads up to {PROTOCOL}: upgrade fedmq on the agents"
            )
        hooks = []
        for entry in spec["hooks"]:
            hook = self._client_hook(entry)
            namespace = f"hook.{hook.name or type(hook).__name__}"
            hooks.append((hook, Kept(self.store, self.client, namespace, version)))
        return hooks

    @staticmethod
    def _check_secure(spec: Any) -> None:
        """A secure job's client map is of version client_map.SECURE or newer: an older aggregator masks with
        other masks (ClientHookError, one line, rather than a round whose masks do not cancel)."""
        if (spec or {}).get("version", 0) < client_map.SECURE:
            raise ClientHookError(
                "the job's aggregator runs an older secure aggregation (other masks): "
                "upgrade fedmq on the aggregator"
            )

    def _client_hook(self, entry: dict[str, Any]) -> ClientHook:
        """One hook of the client map: imported only from fedmq or the job's strategy's module."""
        path = entry["hook"]
        module = path.partition(":")[0]
        if not (module.startswith("fedmq.") or module in self.hook_modules):
            raise ClientHookError(
                f"the job's strategy needs client hook {path!r}, which this agent may not import: "
                "start the agent with the job's --config (its strategy's module is then allowed)"
            )
        cls = self._hooks.get(path) or load_class(path, ClientHook, "client hook", ClientHookError)
        self._hooks[path] = cls
        if entry["hook_version"] != cls.version:
            raise ClientHookError(
                f"client hook {path!r}: the job runs version {entry['hook_version']}, "
                f"this agent has {cls.version}"
            )
        try:
            return cls(**bind(cls, entry["args"], f"client hook {path!r}"))
        except Exception as exc:  # BadParameter, or the hook's own check of its arguments
            # the aggregator checked them when the job started: these came from a damaged or forged announce
            raise CodecError("bad-payload", f"client hook {path!r} could not be built: {exc}") from None

    def _manifest_for(self, hooks: Sequence[tuple[ClientHook, Kept]]) -> Manifest:
        """The model's manifest and the tensors the strategy keeps beside it (ClientHook.extra_tensors)."""
        extras: dict[str, str] = {}
        for hook, _ in hooks:
            extras.update(type(hook).extra_tensors(self.manifest.names))
        return self.manifest.extended(extras)

    def _train(
        self,
        model: torch.nn.Module,
        held: State,
        cfg: RoundConfig,
        rnd: int,
        crash: bool,
        hooks: Sequence[tuple[ClientHook, Kept]] = (),
    ) -> TrainResult:
        # the model's own tensors: not those a strategy keeps beside it (ClientHook.extra_tensors)
        load_state(model, {k: v for k, v in held.items() if k in self.model_names})
        train = replace(cfg.train, device=self.device, seed=stable_seed(cfg.train.seed, self.client, rnd))
        if crash:
            self.log.faults.append((rnd, "crash-train"))
            raise Offline("fault: crashed during training", False)
        report = (lambda done, total: self.progress(self.client, done, total)) if self.progress else None
        for hook, kept in hooks:
            hook.begin(held, train, kept)
        removers = [install_gradient_terms(model, hook) for hook, _ in hooks]
        try:
            result = self.trainers.train(model, self.index, train, report)
        finally:
            for remove in removers:
                remove()
        self.log.rounds_trained.append(rnd)
        return result

    def _trained_state(self, model: torch.nn.Module) -> State:
        """Our model after local training, as uploaded: a copy of the trainer's parameters, so that the
        trainer can go to the next client before the update is encoded (a copy costs a memcpy of the model;
        encoding costs several times that)."""
        return {k: v.clone() for k, v in model_state(model).items()}

    def _prepare(
        self,
        trained: State,
        held: State,
        cfg: RoundConfig,
        rnd: int,
        version: int,
        result: TrainResult,
        hooks: Sequence[tuple[ClientHook, Kept]] = (),
    ) -> Prepared:
        """Encode the update (before the grant, so the trainer and the global model can go) and keep what
        the job's algorithm needs for our next round."""
        upload = self._finish(trained, result, hooks)
        unknown = set(upload) - set(held)
        if not upload or unknown:
            raise ClientHookError(
                f"the client hooks left {'nothing' if not upload else 'unknown tensors'} to upload"
                + (f": {', '.join(sorted(unknown)[:3])}" if unknown else "")
            )
        spec = EncodingSpec.parse(cfg.encoding)
        tensors = encode_state(upload, spec, held if spec.delta else None)
        readers = [(hook, kept) for hook, kept in hooks if type(hook).reads_what_is_sent()]
        if readers:
            manifest = self._manifest_for(hooks)
            decoded = decode_state(tensors, manifest, held if spec.delta else None, as_delta=spec.delta)
            update = {k: torch.from_numpy(v) for k, v in decoded.items()}
            for hook, kept in readers:
                hook.sent(update, kept)
        env = messages.update(self.job, rnd, self.client, version, result.reported, result.n_samples, tensors)
        sent = {k: v.clone() for k, v in upload.items()} if self.log.sent is not None else None
        self._keep(held, cfg, version)
        return Prepared(result, messages.encode(env), env.msg_id, sent, cfg.edges)

    def _finish(self, trained: State, result: TrainResult, hooks: Sequence[tuple[ClientHook, Kept]]) -> State:
        """What the client hooks make of the trained model (ClientHook.finish): what is uploaded."""
        upload = trained
        if hooks:
            hooks[0][0].context.trained = trained  # one context, shared by the round's hooks
        for hook, kept in hooks:
            upload = hook.finish(upload, result, kept)
        return upload

    def _keep(self, held: State, cfg: RoundConfig, version: int) -> None:
        """Keep the model trained from until the next round where the job asks for it (cfg.keep_model)."""
        if cfg.keep_model:
            self.store.put(self.client, "model", version, held)
            self.version = version
        else:
            self.store.drop(self.client, "model")
            self.version = messages.NO_VERSION

    def _wait_grant(self, rnd: int) -> bool:
        """Wait for this round's grant; a newer announce means the round closed without us. A stop with
        ``finish_round`` set (`fedmq agent run` on SIGTERM, bounded by its --stop-grace) still waits: the
        round under way is finished."""
        env = self._wait_for(Kind.GRANT, rnd)
        return env is not None and self.client in env.payload["granted"]

    def _wait_for(self, kind: Kind, rnd: int) -> Envelope | None:
        """The next message ``kind`` of round ``rnd`` (a grant, a step of secure aggregation); None when a
        newer announce came first (the round closed without us: we take part in the new one) or the agent
        stops (a stop with ``finish_round`` set still waits)."""
        while not self.stop.is_set() or (self.finish_round and not self.finished):
            env = self._next(timeout=0.5)
            if env is None:
                continue
            if env.kind is kind and env.round == rnd:
                return env
            if env.kind is Kind.GRANT and env.round == rnd and self._released(env):
                return None  # the round closed without us (a secure round's end)
            if env.kind is Kind.ANNOUNCE and env.round > rnd:
                if env.payload["mode"] == "async":
                    self.newer = env  # our buffer closed without us: the serving loop trains on it next
                elif not self.stop.is_set():
                    self._on_announce(env)  # our round closed without us; take part in the new one
                return None
        return None

    def _wait_for_cohort(self, since: int, check_in: str) -> Envelope | None:
        """After an asynchronous buffer's check-in (message id ``check_in``): the next cohort of a round from
        ``since`` on that names this client; None when a grant refuses that check-in or the agent stops.
        Newer announcements are kept for after (``newer``); cohorts of others, and the end of a buffer this
        client was in before, are not ours to answer."""
        while not self.stop.is_set() or (self.finish_round and not self.finished):
            env = self._next(timeout=0.5)
            if env is None:
                continue
            cohort = env.kind is Kind.SECAGG_COHORT and env.round >= since
            if cohort and self.client in env.payload["members"]:
                return env
            if env.kind is Kind.GRANT and check_in in env.payload.get("refused", ()):
                return None  # our check-in was not taken (too stale, or offline meanwhile)
            if env.kind is Kind.ANNOUNCE and (self.newer is None or env.round > self.newer.round):
                self.newer = env
        return None

    def _checked_in(self, version: int) -> None:
        """An asynchronous buffer's check-in from ``version`` is out. A host then lets the client train from
        a newer version while this round waits for its cohort (its newer check-in replaces this one if no
        cohort took it yet); a one-client agent waits, and trains from the newest version it read after."""
        if self.on_check_in is not None:
            self.on_check_in(self, version)

    def _released(self, env: Envelope) -> bool:
        """An empty grant ends the round for this client: for everyone waiting, or for those it names in
        "released" (one that only refuses check-ins releases nobody in a round)."""
        payload = env.payload
        everyone = () if "refused" in payload else (self.client,)
        return not payload["granted"] and self.client in payload.get("released", everyone)

    def _upload(self, rnd: int, version: int, prepared: Prepared) -> None:
        """Publish the update: to the inbox, or with edge aggregators to the one that folds ours."""
        body, msg_id = prepared.body, prepared.msg_id
        # the fault suite watches these two lines to kill an agent mid-upload (see tests/fault/fault_plan.py)
        log.info("uploading update", client=self.client, round=rnd, msg_id=msg_id, bytes=len(body))
        key = (
            topology.rk_edge_update(self.job, self.client, topology.edge_of(self.client, prepared.edges))
            if prepared.edges
            else topology.rk_update(self.job, self.client)
        )
        self._publish(body, msg_id, key)
        log.info("update confirmed", client=self.client, round=rnd, msg_id=msg_id)
        self.log.uploads.append((rnd, msg_id))
        self.uploaded += 1
        self._audit(rnd, msg_id, version)
        if self.log.sent is not None and prepared.sent is not None:
            self.log.sent[rnd] = (prepared.result.n_samples, prepared.sent)

    def _audit(self, rnd: int, update_id: str, version: int) -> None:
        """Append one confirmed upload to the audit log (flushed: a kill -9 right after cannot lose it)."""
        if self.audit_log is None:
            return
        line = json.dumps(
            {
                "client": self.client,
                "round": rnd,
                "update_id": update_id,
                "model_version": version,
                "time": time.time(),
            }
        )
        with open(self.audit_log, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _send(self, env: Envelope, routing_key: str) -> None:
        self._publish(messages.encode(env), env.msg_id, routing_key)

    def _publish(self, body: bytes, msg_id: str, routing_key: str) -> None:
        broker = self._broker
        if broker is None:
            raise Offline("not connected", False)
        broker.publish(routing_key, body, message_id=msg_id)
