"""Publishing the global model into the job's model stream: each version once per form, whatever the number of
agents that read it (the engine announces the round and says which forms there are).

Forms: ``full`` (always, so any agent can take it), ``delta`` against v−1 (delta down-encodings, when a
selected agent holds v−1 and v is not a keyframe) and ``partial``, the pull-down subset (dynamic pulling both
ways, when a selected agent holds a model). An agent fetches the form it needs for the version it holds;
``form_for`` judges the same from what the aggregator believes it holds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

import torch

from fedmq.aggregator.config import JobConfig
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, encode_state, raw_nbytes
from fedmq.pulling import select_tensors

# form -> (its announce entry, the raw fp32 bytes of what it holds)
Forms = dict[str, tuple[dict, int]]


class ModelStream:
    """The forms of one version published so far, and θ_{v−1} for the delta and pull-down forms."""

    def __init__(self, cfg: JobConfig, broker: Broker, groups: Callable[[], Mapping[str, str]]) -> None:
        self.cfg, self.broker, self._groups = cfg, broker, groups
        self.prev_state: dict[str, torch.Tensor] | None = None  # θ_{v−1}, kept for delta pushes and pull-down
        self._published: Forms = {}
        self._published_version = messages.NO_VERSION
        self._exact: tuple[int, dict] | None = None  # (version, its entry): the edges' form

    def keep_previous(self, state: dict[str, torch.Tensor]) -> None:
        """θ_v is about to be replaced: keep it as θ_{v−1} where a delta or a pull-down form needs it."""
        if EncodingSpec.parse(self.cfg.down_encoding).delta or self.cfg.pull_down:
            self.prev_state = state

    def publish(self, version: int, state: dict[str, torch.Tensor], holds: list[int]) -> Forms:
        """Publish version ``version`` (``state``) in the forms the selected agents, holding the versions
        ``holds``, need: each form once per version; returns every form published for it."""
        cfg = self.cfg
        if self._published_version != version:
            self._published, self._published_version = {}, version
        spec = EncodingSpec.parse(cfg.down_encoding)
        full = EncodingSpec(**{**spec.__dict__, "delta": False})
        wanted: dict[str, tuple[dict[str, torch.Tensor], EncodingSpec, dict | None, int, bool]] = {
            "full": (state, full, None, messages.NO_VERSION, False)
        }
        if (
            spec.delta
            and self.prev_state is not None
            and version % cfg.keyframe_every
            and any(h == version - 1 for h in holds)
        ):
            wanted["delta"] = (state, spec, self.prev_state, version - 1, False)
        pushed = self._pushed_names(version, state)
        if pushed is not None and any(h >= 0 for h in holds):
            wanted["partial"] = ({k: state[k] for k in pushed}, full, None, messages.NO_VERSION, True)
        for form, (tensors, enc, base, base_version, partial) in wanted.items():
            if form in self._published:
                continue
            env = messages.model(cfg.job, version, encode_state(tensors, enc, base), base_version, partial)
            body = messages.encode(env)
            since = time.time()
            self.broker.publish(topology.rk_model(cfg.job), body, message_id=env.msg_id)
            self._published[form] = (messages.model_entry(env, since, len(body)), raw_nbytes(tensors))
        return dict(self._published)

    def exact(self, version: int, state: dict[str, torch.Tensor]) -> dict:
        """Version ``version`` in raw fp32, published once: what edge aggregators decode their clients'
        updates against (the agents' forms may be lossy); its announce-style entry."""
        if self._exact is None or self._exact[0] != version:
            env = messages.model(self.cfg.job, version, encode_state(state, EncodingSpec.parse("raw")))
            body = messages.encode(env)
            since = time.time()
            self.broker.publish(topology.rk_model(self.cfg.job), body, message_id=env.msg_id)
            self._exact = (version, messages.model_entry(env, since, len(body)))
        return self._exact[1]

    @staticmethod
    def form_for(version: int, holds: int, forms: Forms) -> str | None:
        """The form of ``version`` an agent holding ``holds`` will fetch (None: it has it already); the agent
        itself picks the same way, from what it really holds."""
        if holds == version:
            return None
        if "delta" in forms and holds == version - 1:
            return "delta"
        if "partial" in forms and holds >= 0:
            return "partial"
        return "full"

    def _pushed_names(self, version: int, state: dict[str, torch.Tensor]) -> list[str] | None:
        """Dynamic pulling in both directions (Passban et al.): the tensors of θ_v the job's rule picks by
        their change since θ_{v−1}; agents keep their own values for the rest. None when the job does not pull
        down or for the first version (agents that hold no model take the full form)."""
        cfg = self.cfg
        if not cfg.pull_down or self.prev_state is None:
            return None
        return select_tensors(
            state,
            self.prev_state,
            self._groups(),
            cfg.pull,
            cfg.pull_fraction,
            random.Random(f"{cfg.seed}/push/{version}"),
            cfg.pull_by,
        )
