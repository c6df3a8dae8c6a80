"""A federation job's configuration, validated up front (one clear line per bad value)."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fedmq import defaults, train_config
from fedmq.aggregator.job_keys import (
    DEFAULT_STRATEGY,
    FORMER_KEYS,
    STRATEGY_ALIASES,
    JobConfigError,
    named_fedmed_variant,
    read_former_keys,
    split_privacy_table,
    split_strategy_table,
)
from fedmq.aggregator.privacy_settings import PRIVACY_TABLE, privacy_problem
from fedmq.broker.wire.messages import MAX_SECAGG_CLIP, RoundConfig
from fedmq.errors import BadParameter
from fedmq.params import check_values, unknown_parameter
from fedmq.plugins import is_import_path
from fedmq.train_config import TrainConfig

if TYPE_CHECKING:
    from fedmq.aggregator.strategies.base import RoundPlan, Strategy

# the strategies that weigh or pick clients by their models or losses (attention, JS weights, pulling): the
# client-level DP wrapper (aggregator/strategies/private.py) cannot clip and noise what they do
BY_MODEL = (
    "fedatt",
    "fedmed",
    "fedmed-relative",
    "fedmed-standardised",
    "pull-local",
    "pull-global",
    "pull-random",
)
# what --strategy offers (the registry also holds the robust guards, chosen with --robust)
STRATEGIES = (
    "fedavg",
    "fedsgd",
    *BY_MODEL,
    "async",
    "fedavgm",
    "fedadagrad",
    "fedadam",
    "fedyogi",
    "fedprox",
    "scaffold",
)
# client-level differential privacy runs with every strategy that averages the clients' changes
DP_STRATEGIES = tuple(s for s in STRATEGIES if s not in BY_MODEL)


def _raise(msg: str) -> NoReturn:
    raise JobConfigError(msg)


# the JobConfig fields `fedmq simulate` has a flag for, and the flag: a mistake names both the key (what
# Python and job files say) and the flag (cli/simulate_options.py takes its flag-to-field map from here)
FLAGS = {
    "strategy": "--strategy",
    "rounds": "--rounds",
    "clients": "--clients",
    "fraction": "--fraction",
    "min_clients": "--min-clients",
    "beta": "--beta",
    "loss_eps": "--loss-eps",
    "noise": "--noise",
    "pull_fraction": "--pull-fraction",
    "pull_down": "--pull-down",
    "encoding": "--encoding",
    "down_encoding": "--down-encoding",
    "epochs": "--epochs",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "optimizer": "--optimizer",
    "momentum": "--momentum",
    "round_lr_decay": "--round-lr-decay",
    "lr_anneal": "--lr-anneal",
    "max_steps": "--max-steps",
    "report_deadline_s": "--report-deadline",
    "update_deadline_s": "--update-deadline",
    "seed": "--seed",
    "robust": "--robust",
    "max_samples_factor": "--max-samples-factor",
    "dp": "--dp",
    "clip_norm": "--clip-norm",
    "clip_quantile": "--clip-quantile",
    "noise_multiplier": "--noise-multiplier",
    "target_epsilon": "--target-epsilon",
    "delta": "--delta",
    "edges": "--edges",
    "secagg": "--secagg",
    "secagg_clip": "--secagg-clip",
}


# a JobConfig field's declared type: what a value may be (an int is never a bool) and how a mistake names it
KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "a whole number"),
    "float": ((int, float), "a number"),
    # None: unset (lr: the strategy's own, resolved when the job is built; z, E, δ: derived under DP)
    "float | None": ((int, float, type(None)), "a number"),
    "float | str": ((int, float, str), 'a number or "adaptive"'),  # clip_norm
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "dict[str, Any]": ((dict,), "a table"),
}
FLOATS = ("float", "float | None", "float | str")  # the KINDS of a number field (a job file's ints: floats)


def key(name: str) -> str:
    """A JobConfig field as an error message names it: the key, and its flag where it has one."""
    return f"{name} ({FLAGS[name]})" if name in FLAGS else name


@dataclass(frozen=True)
class JobConfig:
    """A job's settings, validated when built and frozen after: a variant is
    ``dataclasses.replace(cfg, ...)``, which validates again."""

    job: str = "demo"
    strategy: str = DEFAULT_STRATEGY
    rounds: int = 5  # sync: rounds; async: global versions to publish
    clients: int = 10  # K, the number of agents in the federation
    fraction: float = 0.5  # C: m = max(C*K, 1) agents selected per round
    min_clients: int = 1  # a round with fewer reports/updates is closed as skipped
    beta: float = 1.0  # top-K share of reporting agents granted an upload (1 = no grant phase unless fedmed)
    loss_eps: float = 0.1  # FedMed loss switch threshold
    # randomization β: client adds noise·N(0, 1) to its weights before upload (FedAtt Eq. 6)
    noise: float = 0.0
    # dynamic pulling: share of tensors sent (0.5 = median rule, 0.33 = 33 % variant)
    pull_fraction: float = 0.5
    # dynamic pulling: pull_fraction is a share of parameters (the paper) or of tensors ("count")
    pull_by: str = "params"
    # dynamic pulling in both directions: the server pushes only the tensors its rule picks
    pull_down: bool = False
    # wire encodings (broker.wire.encodings.EncodingSpec syntax). Defaults: bf16, for the update as a delta
    # against the model it trained from (so its error is relative to the update, not to the weights), 2.5x
    # smaller than raw both ways at the same validation perplexity (docs/benchmarks.md "Equal quality, fewer
    # bytes"); "raw" both ways is bit-exact FedAvg
    # uplink: auto = delta+bf16, or raw under pull-down (whose uploads cannot be deltas)
    encoding: str = "auto"
    down_encoding: str = "bf16"  # downlink (the global model)
    keyframe_every: int = 10  # delta down-encodings: every Nth version is published full only (bounds drift)
    # sparsified uploads (delta+topk): each agent keeps what its upload left out and adds it to its next one
    # (error feedback, client_agent/agent.py); false sends each round's top-k alone, the rest is lost
    error_feedback: bool = True
    epochs: int = defaults.EPOCHS
    batch_size: int = defaults.BATCH_SIZE
    lr: float | None = None  # None: the strategy's default (defaults.lr_for: FedSGD's own, else defaults.LR)
    optimizer: str = defaults.OPTIMIZER
    momentum: float = defaults.MOMENTUM
    lr_decay: float = defaults.LR_DECAY  # local: lr × this after every local epoch
    # across rounds: round r's clients train at lr × round_lr_decay^(r−1) (FedMed: "worker models are tuned
    # with decayed learning rate"); stateless, so a resumed run continues the schedule where it stopped
    round_lr_decay: float = 1.0
    # annealing on validation (pytorch/examples' word language model): whenever the global model's validation
    # score does not improve, the clients' lr is divided by this from the next round on (1 = off); kept in the
    # checkpoint, so a resumed run continues where it stopped
    lr_anneal: float = defaults.LR_ANNEAL
    clip: float = defaults.CLIP
    max_steps: int = 0
    # mixed precision for local training on a GPU (CUDA autocast to fp16 with a gradient scaler); an agent
    # that trains on the CPU ignores it. Off by default: the reproductions compare methods in fp32
    amp: bool = False
    report_deadline_s: float = 300.0
    update_deadline_s: float = 120.0
    join_timeout_s: float = 60.0  # wait this long for agents before a round with nobody online is skipped
    heartbeat_s: float = defaults.HEARTBEAT_S
    eval_every: int = 1
    # the newest round checkpoints kept (nmt-domains keeps every round's to pick one)
    keep_checkpoints: int = 3
    seed: int = 0
    identity: str = "strict"
    # FedAvg guard: none | clip:NORM (norm clipping) | trimmed:FRAC | median (coordinate-wise)
    robust: str = "none"
    # bounds on one client's influence (aggregator.guards; 0 = off): n_k capped at this x the lower-median
    # n_k of recent rounds, and an update whose delta norm exceeds this x the round's lower-median norm is
    # left out
    max_samples_factor: float = 4.0
    norm_bound_factor: float = 10.0
    # client-level differential privacy (docs/guide/privacy.md; a job file's [privacy] table): none, central
    # (the aggregator clips every update and noises their sum) or client (every agent clips its update and
    # adds its share of the noise)
    dp: str = "none"
    # S, the L2 bound on one client's update (all its tensors together), or "adaptive": S follows the target
    # quantile clip_quantile of the updates' norms (Andrew et al. 2021)
    clip_norm: float | str = 1.0
    clip_quantile: float = 0.5
    # z: the noise's standard deviation is z·S; unset: derived from target_epsilon, else the default
    # (aggregator/privacy.py, DEFAULT_NOISE_MULTIPLIER)
    noise_multiplier: float | None = None
    # E: z is derived so that the planned rounds spend at most E, and the job stops before passing it
    target_epsilon: float | None = None
    delta: float | None = None  # δ of (ε, δ); unset: 1/K^1.1 (fedmq.privacy.accountant.default_delta)
    # two-tier aggregation (docs/guide/edges.md): 0, or the number of edge aggregators (`fedmq aggregator run
    # --tier edge`) that fold the updates of the clients routed to them into partial sums for this aggregator
    edges: int = 0
    # secure aggregation (docs/guide/secure-aggregation.md): the aggregator learns only the sum of a round's
    # updates (SecAgg+ over the job's queues); each client clips every coordinate of its update to
    # [-secagg_clip, secagg_clip] before it quantizes and masks it; the graph of who shares with whom is
    # chosen so that a client stays hidden while at most secagg_corrupt of the cohort collude with the server
    # and the round completes while at most secagg_dropout of it drop out after sharing their keys
    secagg: bool = False
    secagg_clip: float = 10.0
    secagg_corrupt: float = 0.1
    secagg_dropout: float = 0.3
    # the strategy's own parameters: its constructor's keyword arguments (the job file's [strategy] table,
    # --strategy-arg KEY=VALUE), checked against its signature when the strategy is built
    strategy_args: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.strategy, str):  # validate() names a strategy of any other type
            object.__setattr__(self, "strategy", STRATEGY_ALIASES.get(self.strategy, self.strategy))
        if self.lr is None and isinstance(self.strategy, str):
            object.__setattr__(self, "lr", defaults.lr_for(self.strategy))
        if self.encoding == "auto":
            object.__setattr__(self, "encoding", "raw" if self.pull_down else "delta+bf16")
        if isinstance(self.clip_norm, str) and self.clip_norm != "adaptive":  # a flag's text: a number
            try:
                object.__setattr__(self, "clip_norm", float(self.clip_norm))
            except ValueError:
                _raise(f'{key("clip_norm")} must be a number or "adaptive", got {self.clip_norm!r}')
        self.validate()

    def validate(self) -> None:
        """Every field, each mistake one line (JobConfigError); the first found is named."""
        self._check_types()
        self._check_strategy_args()
        self._check_names()
        self._check_round_shape()
        self._check_ranges()
        self._check_choices()
        self._check_privacy()
        self._check_edges()
        self._check_secagg()

    def _check_names(self) -> None:
        """The job id, the encodings and the strategy name."""
        from fedmq.broker.transport.topology import check_name
        from fedmq.broker.wire.encodings import EncodingSpec
        from fedmq.errors import CodecError

        try:
            check_name("job id", self.job)
        except ValueError as exc:
            raise JobConfigError(str(exc)) from None
        for name in ("encoding", "down_encoding"):
            try:
                EncodingSpec.parse(getattr(self, name))
            except CodecError as exc:
                raise JobConfigError(f"{key(name)}: {exc}") from None
        if self.strategy not in STRATEGIES and not is_import_path(self.strategy):
            raise JobConfigError(
                f"unknown strategy {self.strategy!r}; "
                f"choose one of {', '.join(STRATEGIES)} or package.module:Class"
            )

    def _check_round_shape(self) -> None:
        """Who takes part in a round and what they upload: K, C, β, the pulling rule, the minimum."""
        bad = _raise
        if self.rounds < 1:
            bad(f"{key('rounds')} must be at least 1")
        if self.clients < 1:
            bad(f"{key('clients')} must be at least 1")
        if not 0 < self.fraction <= 1:
            bad(f"{key('fraction')} C={self.fraction} must be in (0, 1]")
        if not 0 < self.beta <= 1:
            bad(f"{key('beta')} β={self.beta} must be in (0, 1]")
        if not 0 < self.pull_fraction < 1:
            bad(f"{key('pull_fraction')} {self.pull_fraction} must be in (0, 1)")
        if self.pull_by not in ("params", "count"):
            bad(
                f"{key('pull_by')} {self.pull_by!r}: use params (a share of the parameters, as in the paper) "
                "or count (of tensors)"
            )
        if self.pull_down and self.pull == "all":
            bad(
                f"{key('pull_down')} needs a dynamic-pulling strategy "
                "(pull-local, pull-global or pull-random)"
            )
        if self.pull_down and (self.encoding.startswith("delta+") or self.down_encoding.startswith("delta+")):
            bad(
                "pull-down keeps each agent's own values for the tensors not pushed, "
                "so its uploads and the pushes cannot be deltas; use an encoding without delta+"
            )
        if self.min_clients < 1:
            bad(f"{key('min_clients')} must be at least 1")

    def _check_ranges(self) -> None:
        """The numbers' ranges: counts, deadlines, decays, the guards' factors, and the local-training
        settings (TRAIN_SETTINGS, lr) against the ranges every agent trains within (train_config.RANGES)."""
        bad = _raise
        for name in ("keyframe_every", "eval_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                bad(f"{key(name)} must be at least 1")
        for name in (
            "report_deadline_s",
            "update_deadline_s",
            "join_timeout_s",
            "heartbeat_s",
            "round_lr_decay",
        ):
            if not getattr(self, name) > 0:
                bad(f"{key(name)} must be positive")
        if self.round_lr_decay > 1:
            bad(f"{key('round_lr_decay')} must be in (0, 1], got {self.round_lr_decay}")
        if not 1 <= self.lr_anneal <= 1000:
            bad(f"{key('lr_anneal')} must be in [1, 1000] (1 = off), got {self.lr_anneal}")
        for name in ("noise", "loss_eps"):
            if getattr(self, name) < 0:
                bad(f"{key(name)} must not be negative")
        for name in ("max_samples_factor", "norm_bound_factor"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < float("inf")
            ):
                bad(f"{key(name)} must be a finite number >= 0 (0 turns the bound off), got {value!r}")
        for name in (*TRAIN_SETTINGS, "lr"):
            value = getattr(self, name)
            why = train_config.out_of_range(name, value) if not isinstance(value, (bool, str)) else None
            if why:
                bad(f"{key(name)} {why}")

    def _check_choices(self) -> None:
        """The settings that name one of a few choices: optimizer, robust guard, identity."""
        bad = _raise
        if self.optimizer not in train_config.OPTIMIZERS:
            bad(f"unknown {key('optimizer')} {self.optimizer!r}; use {' or '.join(train_config.OPTIMIZERS)}")
        kind, _, arg = self.robust.partition(":")
        try:
            ok = (
                self.robust in ("none", "median")
                or (kind == "clip" and float(arg) > 0)
                or (kind == "trimmed" and 0 <= float(arg) < 0.5)
            )
        except ValueError:
            ok = False
        if not ok:
            bad(
                f"{key('robust')} {self.robust!r}: use none, clip:NORM (NORM > 0), "
                "trimmed:FRAC (0 <= FRAC < 0.5) or median"
            )
        if not (
            self.identity == "strict" or (self.identity.startswith("shared:") and len(self.identity) > 7)
        ):
            bad(f"{key('identity')} must be strict or shared:USER")

    def _check_privacy(self) -> None:
        """The differential-privacy settings (aggregator/privacy_settings.py): one line, the first wrong."""
        why = privacy_problem(self, key, DP_STRATEGIES)
        if why is not None:
            _raise(why)

    def _check_edges(self) -> None:
        """Two-tier aggregation: a synchronous strategy whose aggregate is a sum of the clients' terms."""
        if self.edges == 0:
            return
        from fedmq.broker.wire.messages import MAX_EDGES

        if not 0 < self.edges <= MAX_EDGES:
            _raise(f"{key('edges')} must be in [0, {MAX_EDGES}], got {self.edges}")
        self._require(
            "partial_sums",
            "edges",
            "needs each client's update at one aggregator (it weighs, ranks or buffers them); edges run "
            "strategies whose aggregate is a sum",
        )
        if self.dp != "none":
            _raise(f"{key('edges')}: {key('dp')} clips and noises each update at one aggregator; use one")

    def _require(self, capability: str, setting: str, why: str, *, asynchronous: bool = False) -> None:
        """Refuse in one line naming ``setting`` a round strategy without ``capability`` (a flag of its
        class: partial_sums, secure_sum), or an asynchronous one unless ``asynchronous``; ``why`` says what
        it needs and what runs."""
        from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, round_strategy, strategy_class

        name = round_strategy(self.strategy, self)
        if (self.mode == "async" and not asynchronous) or not getattr(strategy_class(name), capability):
            able = ", ".join(n for n in STRATEGY_NAMES if getattr(strategy_class(n), capability))
            _raise(f"{key(setting)}: strategy {name!r} {why}: {able}")

    def _check_secagg(self) -> None:
        """Secure aggregation: a strategy (synchronous, or buffered asynchronous) whose aggregate is a
        weighted mean of the updates, and nothing else that needs to read one client's update."""
        if not self.secagg:
            return
        if not 0 < self.secagg_clip <= MAX_SECAGG_CLIP:
            _raise(f"{key('secagg_clip')} must be in (0, {MAX_SECAGG_CLIP:g}], got {self.secagg_clip}")
        from fedmq.secagg.graph import MIN_COHORT, intolerable
        from fedmq.secagg.payloads import MAX_COHORT

        fixed = self.mode == "sync" and self.dp == "none"  # (Poisson sampling draws a cohort of any size)
        fewest = self.selected_count() if fixed else self.clients
        if fewest < MIN_COHORT:
            _raise(
                f"{key('secagg')}: a cohort of {fewest} cannot hide one input in its sum; "
                f"{'a round selects' if fixed else 'a job has'} at least {MIN_COHORT} clients under it"
            )
        most = self.most_selected()
        if most > MAX_COHORT:
            _raise(f"{key('secagg')}: a round selects up to {most}; a cohort has at most {MAX_COHORT}")
        from fedmq.aggregator.inbox import HELD_A_CLIENT, MAX_PREFETCH

        # secure buffers hold messages of each client unacked (aggregator.secure_buffers): half the inbox's
        # window at most, the rest for the steps' messages
        most_held = MAX_PREFETCH // (2 * HELD_A_CLIENT)
        if self.mode == "async" and self.clients > most_held:
            _raise(
                f"{key('secagg')}: secure buffers hold {HELD_A_CLIENT} messages a client in the inbox's "
                f"window; at most {most_held} clients, not {self.clients}"
            )
        for name in ("secagg_corrupt", "secagg_dropout"):
            if not 0 <= getattr(self, name) < 0.5:
                _raise(f"{key(name)} must be in [0, 0.5), got {getattr(self, name)}")
        # every cohort size a round or buffer may form (only those below 2 / (1 − γ − δ) can fail)
        spare = 1 - self.secagg_corrupt - self.secagg_dropout  # > 0: both are below 0.5
        small = min(self.most_selected() if fixed else self.clients, math.ceil(2 / spare) + 1)
        sizes = range(max(MIN_COHORT, self.min_clients), small + 1)
        failing = [n for n in sizes if intolerable(n, self.secagg_corrupt, self.secagg_dropout)]
        if failing:
            why = intolerable(failing[0], self.secagg_corrupt, self.secagg_dropout)
            _raise(
                f"{key('secagg_corrupt')} and {key('secagg_dropout')}: {why}; lower them, or set "
                f"{key('min_clients')} above {failing[-1]}"
            )
        self._require(
            "secure_sum",
            "secagg",
            "needs to read each client's update (it weighs, ranks or clips them one by one); a secure sum "
            "runs",
            asynchronous=True,
        )
        why = next(
            (
                what
                for what, wrong in (
                    (f"{key('beta')} < 1 grants uploads by each client's loss", self.beta < 1),
                    (
                        f"{key('dp')} central clips each update at the aggregator: use {key('dp')} client",
                        self.dp == "central",
                    ),
                    (f"{key('edges')}: edge aggregators read their clients' updates", self.edges != 0),
                    (f"{key('noise')} is FedAtt's", self.noise != 0),
                )
                if wrong
            ),
            None,
        )
        if why is not None:
            _raise(f"{key('secagg')}: {why}")

    def _check_strategy_args(self) -> None:
        """The strategy's arguments: a table of parameters, and a built-in strategy's by name, from its
        constructor's signature (read without torch: aggregator.strategies.signatures); their values are the
        constructor's to check, when it is built."""
        from fedmq.aggregator.strategies.signatures import builtin_params

        if self.strategy in STRATEGIES and isinstance(self.strategy_args, dict):
            params = builtin_params(self.strategy)
            unknown = sorted(k for k in self.strategy_args if params is not None and k not in params)
            if unknown and params is not None:
                label = f"strategy {self.strategy!r}"
                raise JobConfigError(unknown_parameter(label, str(unknown[0]), params))
        try:
            check_values(self.strategy_args, "strategy-args")
        except BadParameter as exc:
            raise JobConfigError(str(exc)) from None

    def _check_types(self) -> None:
        """Every field of the type it is declared with (a job file's JSON can hold anything): ints are ints,
        not bools; numbers are finite; ``extra`` is a table (a dict)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind, words = KINDS[str(f.type)]
            if (isinstance(value, bool) and f.type != "bool") or not isinstance(value, kind):
                raise JobConfigError(f"{key(f.name)} must be {words}, got {value!r}")
            if f.type in FLOATS and isinstance(value, (int, float)) and not math.isfinite(value):
                raise JobConfigError(f"{key(f.name)} must be finite, got {value!r}")

    @property
    def strategy_class(self) -> type[Strategy]:
        # torch: the CLI checks its flags without it
        from fedmq.aggregator.strategies.registry import strategy_class

        return strategy_class(self.strategy)

    @property
    def plan(self) -> RoundPlan:
        """The shape of the strategy's rounds (aggregator.strategies.base.RoundPlan)."""
        return self.strategy_class.plan

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def pull(self) -> str:
        """Which tensors a client uploads: all, or a dynamic-pulling rule (fedmq.pulling.MODES)."""
        return self.plan.pull

    @property
    def grant_phase(self) -> bool:
        """Top-K (β < 1) grants the best reporters; a strategy whose plan asks for it always grants."""
        return self.beta < 1 or self.plan.grant_phase

    @property
    def keep_model(self) -> bool:
        """Whether agents keep the model they trained from until their next round: the base of a delta push,
        and under pull-down the values they keep for tensors not pushed. (They keep their own trained model
        for the dynamic-pulling rule, ``keep_own``, whenever the strategy pulls.)"""
        return self.pull_down or self.down_encoding.startswith("delta+")

    @property
    def presence_window_s(self) -> float:
        """How long a presence counts: three heartbeats, so that one or two late or lost beats do not take a
        live client offline."""
        return 3 * self.heartbeat_s

    def selected_count(self) -> int:
        """m, the agents selected per round: max(C·K, 1), or all K when the strategy's plan selects all."""
        return self.clients if self.plan.select_all else max(int(self.fraction * self.clients), 1)

    def most_selected(self) -> int:
        """The most agents a synchronous round selects: m, or under DP's Poisson sampling (every agent with
        probability C) qK + 6 standard deviations, exceeded with probability below 1e-9; at most K. What the
        inbox's windows and a simulation's memory are sized for."""
        if self.dp == "none" or self.plan.select_all:
            return self.selected_count()
        mean = self.fraction * self.clients
        return min(self.clients, math.ceil(mean + 6 * math.sqrt(mean * (1 - self.fraction))) + 1)

    def round_lr(self, round_number: int, scale: float = 1.0) -> float:
        """The clients' learning rate in round ``round_number`` (1-based): lr × round_lr_decay^(round − 1),
        × ``scale`` (what annealing on validation left: the engine's, see ``lr_anneal``)."""
        lr = float(self.lr) * float(self.round_lr_decay) ** max(round_number - 1, 0) * scale
        return max(lr, math.ulp(0.0))  # a long run's product may underflow; the announce needs lr > 0

    def train_config(self, round_number: int = 1, lr_scale: float = 1.0) -> TrainConfig:
        """The local training of round ``round_number``: the job's settings of every TrainConfig field it has
        (the learning rate decayed to that round), shaped by the strategy's ``configure_train`` (FedSGD: one
        full-batch step; FedMed: report the loss at the end of training)."""
        own = {name: kind(getattr(self, name)) for name, kind in TRAIN_SETTINGS.items()}
        train = TrainConfig(**own, lr=self.round_lr(round_number, lr_scale))
        return self.strategy_class.configure_train(train)

    def round_config(self, round_number: int = 1, lr_scale: float = 1.0) -> RoundConfig:
        """What the selected agents are told in round ``round_number``: its local training, the upload's
        encoding, and the round's shape."""
        return RoundConfig(
            train=self.train_config(round_number, lr_scale),
            encoding=self.encoding,
            grant=self.grant_phase,
            keep_model=self.keep_model,
            edges=self.edges,
            secagg_clip=self.secagg_clip if self.secagg else 0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> JobConfig:
        """A job file's or config.json's keys; ``strategy`` may be a table: its ``name`` and parameters."""
        values = read_former_keys(named_fedmed_variant(split_strategy_table(split_privacy_table(values))))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise JobConfigError(f"unknown config key(s): {', '.join(unknown)}")
        return cls(**values)


# the JobConfig fields that are local-training settings (fedmq.train_config.TrainConfig), each with its
# type; the learning rate is announced decayed to the round (JobConfig.round_lr)
TRAIN_SETTINGS = {
    f.name: {"int": int, "float": float, "bool": bool, "str": str}[str(f.type)]
    for f in dataclasses.fields(JobConfig)
    if f.name in train_config.ANNOUNCED and f.name != "lr"
}


@dataclass(frozen=True)
class JobFile:
    """A job file as every command reads it (`fedmq simulate --config`, `aggregator run`, `agent run`):
    JobConfig keys at the top level (the strategy also as a ``[strategy]`` table: its name and parameters),
    the task's options in a ``[task]`` table."""

    path: Path
    job: dict[str, Any]
    task: dict[str, Any]


def read_job_file(path: Path) -> JobFile:
    """The one reader of job files; a missing file, bad TOML, an unknown key or a value of the wrong type is
    one line that names the file and the key."""
    if not path.is_file():
        raise JobConfigError(
            f"config file {path} not found" if not path.exists() else f"config file {path} is not a file"
        )
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise JobConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise JobConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    task = raw.pop("task", {})
    if not isinstance(task, dict):
        raise JobConfigError(f"config file {path}: task must be a [task] table")
    flat = sorted(k for k in raw if k in PRIVACY_TABLE.values())
    if flat:
        raise JobConfigError(
            f"config file {path}: {flat[0]} belongs in the [privacy] table "
            f"({'mode' if flat[0] == 'dp' else flat[0]} = ...)"
        )
    try:
        raw = named_fedmed_variant(split_strategy_table(split_privacy_table(raw)))
    except JobConfigError as exc:
        raise JobConfigError(f"config file {path}: {exc}") from None
    # the former keys are read as their strategy's parameters once the strategy is known (JobConfig.from_dict;
    # simulate's flags may name another strategy than the file)
    kinds = {f.name: str(f.type) for f in dataclasses.fields(JobConfig)}
    kinds.update({k: former.kind for k, former in FORMER_KEYS.items()})
    unknown = sorted(k for k in raw if k not in kinds)
    if unknown:
        raise JobConfigError(
            f"config file {path}: unknown key(s) {', '.join(unknown)} (JobConfig keys at the top level, "
            "task options in [task])"
        )
    job = {}
    for key, value in raw.items():
        types, words = KINDS[kinds[key]]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise JobConfigError(f"config file {path}: {key} must be {words}, got {value!r}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        job[key] = float(value) if kinds[key] in FLOATS and number else value
    return JobFile(path, job, task)
