"""What the engine keeps of a job's differential privacy (aggregator/privacy.py has the plan): the
accountant, stepped once per release, in every checkpoint; ε and δ for each round's record, the status and
the summary; and the stop before a release would pass the target ε."""

from __future__ import annotations

from typing import Any

import structlog

from fedmq.aggregator.checkpoint import CheckpointRefused
from fedmq.aggregator.privacy import DPPlan, finite_or_none
from fedmq.errors import FedmqError

log = structlog.get_logger(__name__)

CHECKPOINT_KEY = "dp_accountant"  # the accountant's state in a checkpoint's extra


class PrivacyLedger:
    """The accountant of a job under DP; ``noise_seed``: the job's seed when its noise is seeded (`fedmq
    simulate`), None for the OS CSPRNG."""

    def __init__(self, plan: DPPlan, noise_seed: int | None) -> None:
        self.plan, self.noise_seed = plan, noise_seed
        self.accountant = plan.accountant()

    def release(self) -> None:
        self.accountant.step()

    def within_budget(self) -> bool:
        """Whether one more release keeps ε within the target (always, without one); logs the stop."""
        target, acc = self.plan.target_epsilon, self.accountant
        if target is None or acc.epsilon_after(acc.releases + 1) <= target * (1 + 1e-9):
            return True
        log.warning(
            "privacy budget reached: the next release would pass the target epsilon; the job stops",
            epsilon=acc.epsilon(),
            target=target,
            releases=acc.releases,
        )
        return False

    def record(self) -> dict[str, Any]:
        """ε spent so far (None while unbounded: z = 0) and δ: a round's record, the status."""
        return {"epsilon": finite_or_none(self.accountant.epsilon()), "delta": self.accountant.delta}

    def summary(self, budget_spent: bool) -> dict[str, Any]:
        noise = "seeded from the job's seed" if self.noise_seed is not None else "os-csprng"
        return {
            **self.record(),
            "dp": {**self.plan.describe(), "noise": noise},
            "budget_spent": budget_spent,
        }

    def state_dict(self) -> dict[str, Any]:
        return {CHECKPOINT_KEY: self.accountant.state_dict()}

    @staticmethod
    def restore(ledger: PrivacyLedger | None, extra: dict[str, Any]) -> None:
        """Load the accountant from a checkpoint's ``extra``; a checkpoint of a job without DP for one with it
        (or the other way round), or of other DP settings, is refused: ε would be misstated."""
        state = extra.get(CHECKPOINT_KEY)
        if ledger is None:
            if state is not None:
                raise CheckpointRefused(
                    "the checkpoint's job ran under differential privacy; this one does not"
                )
            return
        if state is None:
            raise CheckpointRefused("the checkpoint's job ran without differential privacy; this one has it")
        try:
            ledger.accountant.load_state_dict(state)
        except (FedmqError, ValueError, TypeError, KeyError) as exc:
            raise CheckpointRefused(
                f"the checkpoint's privacy accountant does not fit this job: {exc}"
            ) from None
