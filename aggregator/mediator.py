"""FedMed's mediator: top-K upload grants on the reported losses and the loss-change strategy switch.

* ``top_k(reports, beta)``: K = ceil(β·M) clients with the lowest reported loss, ties broken by client id
  (string order). β = 1 grants everyone (the engine then skips the grant phase).
* ``choose(mean_loss)``: "adaptive" when |L_r − L_{r−1}| ≥ ε, else "fedavg"; the round's L_r is the
  unweighted mean of the reported client losses (``mean_loss``). First round (no L_{r−1}): "adaptive" —
  the change from "no loss yet" is treated as unbounded, so early, fast-moving rounds use the adaptive
  aggregation the switch is meant for; FedAvg takes over once the loss settles.
  ``choose`` records L_r as the previous loss for the next round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedmq.checks import check_number
from fedmq.errors import BadParameter


def _check_loss(client: str, loss: Any) -> float:
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise BadParameter(f"loss reported by {client!r} must be a finite number, got {loss!r}")
    return float(loss)


class Mediator:
    def __init__(
        self, epsilon: float = 0.1, adaptive_name: str = "adaptive", fallback_name: str = "fedavg"
    ) -> None:
        self.epsilon = check_number("epsilon", epsilon, low=0.0)
        self.adaptive_name = adaptive_name
        self.fallback_name = fallback_name
        self.previous_loss: float | None = None
        self.history: list[tuple[float, str]] = []  # (L_r, choice) per round

    @staticmethod
    def top_k(reports: Mapping[str, float], beta: float) -> list[str]:
        """The granted clients, lowest loss first."""
        check_number("beta", beta, low=0.0, low_open=True, high=1.0)
        checked = {str(c): _check_loss(str(c), loss) for c, loss in reports.items()}
        # 1e-9: ceil(0.3·10) must be 3, not 4 from 3.0000000000000004
        k = math.ceil(beta * len(checked) - 1e-9)
        return [c for c, _ in sorted(checked.items(), key=lambda kv: (kv[1], kv[0]))[:k]]

    @staticmethod
    def mean_loss(reports: Mapping[str, float]) -> float:
        if not reports:
            raise BadParameter("mean_loss needs at least one reported loss")
        return math.fsum(_check_loss(str(c), v) for c, v in reports.items()) / len(reports)

    def choose(self, mean_loss: float) -> str:
        loss = _check_loss("the round", mean_loss)
        if self.previous_loss is None or abs(loss - self.previous_loss) >= self.epsilon:
            choice = self.adaptive_name
        else:
            choice = self.fallback_name
        self.previous_loss = loss
        self.history.append((loss, choice))
        return choice

    def state_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "previous_loss": self.previous_loss,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            prev = state.get("previous_loss")
            previous = None if prev is None else _check_loss("previous round", prev)
            history = [(float(loss), str(choice)) for loss, choice in state.get("history", [])]
            epsilon = check_number("epsilon", state.get("epsilon", self.epsilon), low=0.0)
        except (TypeError, ValueError, AttributeError) as exc:
            raise BadParameter(f"mediator state is malformed: {exc}") from None
        self.previous_loss, self.history, self.epsilon = previous, history, epsilon
