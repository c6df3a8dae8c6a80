"""Fixed-point quantization of a float update into the ring Z_{2^32}, and back from a sum of m of them.

Masking works in a finite ring (Bonawitz et al. 2017, Fig. 4: inputs and masks are vectors over Z_R), here
R = 2^32: uint32 arithmetic, whose wraparound is the ring's. A coordinate x is clipped to [-c, c], shifted to
[0, 2c] and scaled to b bits: y = (x + c) / step with step = 2c / (2^b - 1), so y ∈ [0, 2^b - 1]. The sum of
m such values is below m · 2^b, so it is exact in Z_{2^32} whenever m · 2^b ≤ 2^32: ``for_clients`` chooses
b = 32 - ceil(log2 m) (28 bits for 10 clients, 25 for 100) and refuses a b above it. The masks cancel in the
sum modulo 2^32, and the unmasked sum S gives Σ x ≈ S · step - m · c.

Rounding is stochastic: q = floor(y + u), u uniform in [0, 1). Each q is an unbiased estimate of y, so the
errors of many clients and rounds average out instead of adding up as a fixed bias would (deterministic
rounding sends every value in the same half-step the same way, round after round); the price is a worst-case
error of one step per client instead of half. A sum of m inputs is within m · step of the sum of the clipped
inputs, coordinate by coordinate (``error_bound``).

Weighted means (FedAvg's Σ n_k Δ_k / Σ n_k) are summed as two parts of one vector: the client scales its
clipped update by its weight w ∈ [0, 1] (w = n_k / n_max, n_k capped at the job's n_max, so w · Δ stays in
[-c, c]) and appends w, quantized with the same b bits on [0, 1]; the server divides the first sum by the
second (``encode_weighted``, ``decode_weighted_mean``). In an asynchronous buffer the update is also scaled
by its staleness weight s ∈ (0, 1] and the appended weight is not (BufferedAsync's Σ s_k n_k Δ_k / Σ n_k).
Both parts stay within the same overflow bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedmq.errors import SecAggError
from fedmq.secagg.prg import CHUNK, DTYPE

RING_BITS = 32
MIN_BITS = 8  # fewer bits a coordinate than this is refused rather than run at a uselessly coarse step


def max_bits(clients: int) -> int:
    """The largest b with clients · 2^b ≤ 2^32: a sum of that many b-bit values cannot wrap around."""
    if clients < 1:
        raise SecAggError("bad-parameter", f"a sum needs at least one client, not {clients}")
    return RING_BITS - math.ceil(math.log2(clients))


@dataclass(frozen=True)
class Quantizer:
    clip: float  # c: coordinates are clipped to [-c, c]
    bits: int  # b: bits a coordinate
    clients: int  # m: the most inputs one sum may hold

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError("bad-parameter", f"the clipping range must be finite and > 0, not {self.clip}")
        top = max_bits(self.clients)
        if not MIN_BITS <= self.bits <= top:
            raise SecAggError(
                "overflow",
                f"{self.bits} bits a coordinate for {self.clients} clients: the sum needs "
                f"clients · 2^bits ≤ 2^{RING_BITS}, so bits within {MIN_BITS}..{top}",
            )

    @classmethod
    def for_clients(cls, clients: int, clip: float) -> Quantizer:
        """The finest quantization whose sum over ``clients`` inputs cannot overflow."""
        return cls(clip=clip, bits=max_bits(clients), clients=clients)

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def step(self) -> float:
        return 2 * self.clip / self.levels

    def error_bound(self, count: int) -> float:
        """Largest error of a decoded sum of ``count`` inputs against the sum of the clipped inputs."""
        return count * self.step

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A float vector as b-bit values in Z_{2^32}; ``rng`` draws the rounding."""
        return self._encode(x, 1.0, rng, 0)

    def encode_weighted(
        self, x: np.ndarray, weight: float, rng: np.random.Generator, scale: float = 1.0
    ) -> np.ndarray:
        """scale · weight · clip(x) followed by the weight itself, one coordinate more than x (weight in
        [0, 1]; scale in (0, 1]: an asynchronous buffer's staleness weight)."""
        if not 0.0 <= weight <= 1.0:
            raise SecAggError("bad-parameter", f"a weight is within [0, 1], not {weight}")
        if not 0.0 < scale <= 1.0:
            raise SecAggError("bad-parameter", f"a staleness weight is within (0, 1], not {scale}")
        w = np.floor(weight * self.levels + rng.random())  # drawn first, as the vector's rounding is
        out = self._encode(x, weight * scale, rng, 1)
        out[-1] = w
        return out

    def _encode(self, x: np.ndarray, factor: float, rng: np.random.Generator, extra: int) -> np.ndarray:
        """factor · clip(x) as b-bit values, stochastically rounded (floor(y + u), u uniform in [0, 1)), and
        ``extra`` coordinates more for the caller. Computed a cache-sized chunk at a time in float64 (the
        rounding's draws come in the same order as for the whole vector at once), so a model-sized update
        costs its uint32 output and no model-sized float64 copies."""
        x = np.asarray(x).reshape(-1)
        n = x.shape[0]
        out = np.empty(n + extra, DTYPE)
        y = np.empty(min(n, CHUNK), np.float64)
        for start in range(0, n, CHUNK):
            part = x[start : start + CHUNK]
            m = part.shape[0]
            z = y[:m]
            z[:] = part
            if not np.isfinite(z).all():
                raise SecAggError("non-finite", "the update has NaN or infinite coordinates")
            np.clip(z, -self.clip, self.clip, out=z)
            if factor != 1.0:
                z *= factor
            z += self.clip
            z /= self.step
            z += rng.random(m)
            np.floor(z, out=z)
            out[start : start + m] = z
        return out

    def _count(self, total: np.ndarray, count: int) -> None:
        """Checks a sum before decoding: ``count`` honest inputs sum to at most count · (2^b - 1) in every
        coordinate, so a larger one proves that some client sent values outside the quantized range (masked
        vectors cannot be checked one by one; this is the one range check the sum allows)."""
        if not 1 <= count <= self.clients:
            raise SecAggError("bad-parameter", f"a sum of {count} inputs: 1..{self.clients} expected")
        if total.dtype != DTYPE:
            raise SecAggError("bad-length", f"a sum is a uint32 vector, not {total.dtype}")
        if total.size and int(total.max()) > count * self.levels:
            raise SecAggError(
                "out-of-range", f"the sum exceeds what {count} inputs of {self.bits} bits can reach"
            )

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """Σ x over ``count`` inputs (float64) from the sum of their encodings."""
        self._count(total, count)
        return total.astype(np.float64) * self.step - count * self.clip

    def decode_weighted_mean(self, total: np.ndarray, count: int) -> tuple[np.ndarray, float]:
        """(Σ w_k x_k / Σ w_k, Σ w_k) from the sum of ``count`` weighted encodings."""
        self._count(total, count)
        weight = float(total[-1]) / self.levels
        if weight <= 0:
            raise SecAggError("zero-weight", f"the {count} inputs carry no weight")
        return self.decode_sum(total[:-1], count) / weight, weight
