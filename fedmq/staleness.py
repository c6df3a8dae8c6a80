"""The staleness weight of buffered asynchronous aggregation, s(τ) = 1/sqrt(1 + τ) for an update trained
from a model τ versions old. The aggregator's BufferedAsync weighs each update by it; under secure
aggregation the aggregator sees only the buffer's sum, so each client weighs its own change by it
(client_agent.secure_upload)."""

from __future__ import annotations

import math


def staleness_weight(tau: int) -> float:
    return 1.0 / math.sqrt(1.0 + tau)
