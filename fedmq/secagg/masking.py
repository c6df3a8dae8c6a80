"""SecAgg+ as a pure state machine: one client's side and the server's side of one round or buffer, no I/O.

Bonawitz et al. 2017, Fig. 4, over the neighbours of Bell et al. 2020's graph (graph.py). A protocol layer
drives it message by message (messages.py) and decides who is still there:

- Round 0, AdvertiseKeys: ``MaskingClient(name, context).advertise()`` → ``PublicKeys``. The server forms the
  cohort from those who advertised (in a synchronous round, the selected clients that answered; in an
  asynchronous buffer, the clients as they check in, until the buffer is full), draws the graph's seed and
  sends everyone the ``Cohort`` and the roster of public keys.
- Round 1, ShareKeys: ``client.share_keys(cohort, roster)`` → ``SharedKeys``; ``server.receive_shares``.
- Round 2, MaskedInputCollection: ``server.inbox(name)`` (closes Round 1) → ``client.mask(x, inbox)`` → the
  masked vector (x itself, masked in place); ``server.receive_masked``.
- Round 4, Unmasking: ``server.unmask_request()`` (closes Round 2) → ``client.unmask(request)`` →
  ``UnmaskShares``; ``server.receive_unmask``; ``server.aggregate()`` → the sum of the survivors' inputs.

``context`` names the round or buffer (e.g. "job-7/round-12", "job-7/buffer-40"); every derived key depends on
it, and a client's key pairs and self-mask seed are drawn afresh for each MaskingClient, so nothing is reused
from one round or buffer to the next. The server keeps only the running sum of the masked vectors.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection, Mapping

import numpy as np

from fedmq.errors import SecAggError
from fedmq.secagg import keys, prg, shamir
from fedmq.secagg.graph import Cohort
from fedmq.secagg.keys import PublicKeys
from fedmq.secagg.messages import (
    COMMITMENT_BYTES,
    SharedKeys,
    UnmaskRequest,
    UnmaskShares,
    pack_shares,
    unpack_shares,
)


def seed_commitment(context: str, owner: str, seed: bytes) -> bytes:
    """SHA-256 of the self-mask seed b_u, bound to the round and its owner (b_u is 16 random bytes, so the
    commitment tells nothing about it)."""
    parts = (b"fedmq-secagg-v1/seed", context.encode(), owner.encode(), seed)
    return hashlib.sha256(b"".join(len(p).to_bytes(4, "big") + p for p in parts)).digest()


def mask_sign(owner: str, peer: str) -> int:
    """Δ_{u,v} of Bonawitz et al. 2017, Round 2: +1 when u > v, -1 when u < v, so the two masks cancel."""
    return 1 if owner > peer else -1


class MaskingClient:
    """One client in one round or buffer (``context``)."""

    def __init__(self, name: str, context: str) -> None:
        self.name = name
        self.context = context
        self._channel = keys.generate()  # c_u
        # what Shamir shares: s_u^SK and PRG(b_u)'s key are expanded from 16 random bytes each (keys.expand)
        self._key_secret = os.urandom(shamir.SECRET_BYTES)
        self._mask = keys.mask_key(self._key_secret, context, name)  # s_u
        self._seed = os.urandom(shamir.SECRET_BYTES)  # b_u
        self._cohort: Cohort | None = None
        self._held: dict[str, tuple[shamir.Share, shamir.Share]] = {}  # neighbour → (key share, seed share)
        # neighbour → the key agreed on the channel (keys.derive puts the pair in order: one key both ways)
        self._channel_keys: dict[str, bytes] = {}
        # neighbour → s_{u,v}, agreed when the keys are shared: masking, after training, only expands them
        self._pair_seeds: dict[str, bytes] = {}
        self._masked_with: frozenset[str] | None = None
        self._answered = False

    def advertise(self) -> PublicKeys:
        """Round 0 (AdvertiseKeys): c_u^PK and s_u^PK."""
        return PublicKeys(keys.public_bytes(self._channel), keys.public_bytes(self._mask))

    def share_keys(self, cohort: Cohort, roster: Mapping[str, PublicKeys]) -> SharedKeys:
        """Round 1 (ShareKeys): t-of-k shares of s_u^SK and of b_u, one pair for each neighbour, encrypted to
        it under a key agreed from c_u^SK and its c_v^PK."""
        if self._cohort is not None:
            raise SecAggError("out-of-order", f"{self.name} already shared its keys in {self.context}")
        neighbours = cohort.neighbours(self.name)
        if roster.get(self.name) != self.advertise():
            raise SecAggError("bad-roster", f"the roster does not hold {self.name}'s own public keys")
        missing = [v for v in neighbours if v not in roster]
        if missing:
            raise SecAggError("bad-roster", f"the roster lacks the keys of {', '.join(missing)}")
        self._cohort = cohort
        t, k = cohort.threshold, len(neighbours)
        key_shares = shamir.split(self._key_secret, t, k)
        seed_shares = shamir.split(self._seed, t, k)
        ciphertexts = {}
        for v, key_share, seed_share in zip(neighbours, key_shares, seed_shares):
            secret = keys.derive(self._channel, roster[v].channel, keys.SHARE_KEY, self.context, self.name, v)
            self._channel_keys[v] = secret
            self._pair_seeds[v] = keys.derive(
                self._mask, roster[v].mask, keys.MASK_SEED, self.context, self.name, v
            )
            ciphertexts[v] = keys.encrypt(
                secret, self.context, self.name, v, pack_shares(key_share, seed_share)
            )
        return SharedKeys(ciphertexts, seed_commitment(self.context, self.name, self._seed))

    def mask(self, x: np.ndarray, inbox: Mapping[str, bytes]) -> np.ndarray:
        """Round 2 (MaskedInputCollection): y_u = x_u + PRG(b_u) + Σ_v Δ_{u,v} · PRG(s_{u,v}) in Z_{2^32},
        over the neighbours v whose shares ``inbox`` brings (those still in the round after Round 1). Each
        share is decrypted now, so a share altered on the way is named before anything is masked. ``x`` is
        masked in place and returned (no model-sized copy); on a refusal it is left as it was."""
        cohort = self._cohort
        if cohort is None or self._masked_with is not None:
            raise SecAggError("out-of-order", f"{self.name} masks once, after sharing its keys")
        if x.dtype != prg.DTYPE or x.ndim != 1:
            raise SecAggError("bad-length", f"{self.name}'s input is not a uint32 vector")
        strangers = sorted(set(inbox) - set(cohort.neighbours(self.name)))
        if strangers:
            raise SecAggError(
                "bad-share", f"{self.name} got shares from non-neighbours {', '.join(strangers)}"
            )
        held = {}
        for v, ciphertext in sorted(inbox.items()):
            plaintext = keys.decrypt(self._channel_keys[v], self.context, v, self.name, ciphertext)
            held[v] = unpack_shares(plaintext, v)
            if held[v][0].index != cohort.neighbours(v).index(self.name) + 1:
                raise SecAggError("bad-share", f"the shares {v} sent {self.name} carry the wrong index")
        masks = [(keys.expand(self._seed, keys.SELF_MASK, self.context, self.name), 1)]
        masks += [(self._pair_seeds[v], mask_sign(self.name, v)) for v in sorted(inbox)]
        prg.apply(x, masks)
        self._held, self._masked_with = held, frozenset(inbox)
        return x

    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        """Round 4 (Unmasking): the shares of b_v for surviving neighbours and of s_v^SK for dropped ones.

        Refused (nothing revealed) when the request asks for both secrets of one client, counts this client
        as dropped, names fewer than t survivors (their "sum" could be one input: Bonawitz et al. abort
        then) or comes a second time: any of those could hand the server an input unmasked."""
        if self._masked_with is None or self._answered or self._cohort is None:
            raise SecAggError("out-of-order", f"{self.name} answers one unmasking request, after masking")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped or self.name in dropped or self.name not in survivors:
            raise SecAggError(
                "inconsistent-request",
                f"{self.name} refuses to unmask: a request must name survivors and dropped clients apart",
            )
        if len(survivors) < self._cohort.threshold:
            raise SecAggError(
                "too-few-survivors",
                f"{self.name} refuses to unmask a sum of {len(survivors)}, {self._cohort.threshold} needed",
            )
        self._answered = True
        return UnmaskShares(
            seeds={v: seed for v, (_, seed) in self._held.items() if v in survivors},
            keys={v: key for v, (key, _) in self._held.items() if v in dropped},
        )


class MaskingServer:
    """The server's side of one round or buffer: it learns the sum of the survivors' inputs and nothing else
    of any one of them (against a semi-honest server and fewer than t colluding neighbours of any client)."""

    def __init__(self, cohort: Cohort, roster: Mapping[str, PublicKeys], context: str, length: int) -> None:
        if set(roster) != set(cohort.members):
            raise SecAggError("bad-roster", "the roster and the cohort name different clients")
        if length < 1:
            raise SecAggError("bad-length", f"a vector has at least one coordinate, not {length}")
        self.cohort, self.roster, self.context, self.length = cohort, dict(roster), context, length
        self.faults: list[str] = []  # one line per share found wrong while the sum could still be recovered
        self._shared: dict[str, SharedKeys] = {}  # U_2
        self._masked: set[str] = set()  # U_3
        self._total = np.zeros(length, prg.DTYPE)
        self._answers: dict[str, UnmaskShares] = {}  # U_5
        self._phase = 1

    def _enter(self, phase: int, what: str) -> None:
        if self._phase > phase:
            raise SecAggError("out-of-order", f"too late in {self.context} for {what}")
        self._phase = phase

    def _once(self, sender: str, allowed: Collection[str], seen: Collection[str], what: str) -> None:
        if sender not in allowed:
            raise SecAggError("not-a-member", f"{what} from {sender}, who has no part in it")
        if sender in seen:
            raise SecAggError("duplicate", f"a second {what} from {sender}")

    def receive_shares(self, sender: str, shared: SharedKeys) -> None:
        """Round 1: a client's encrypted shares, one for each of its neighbours exactly."""
        self._enter(1, "shared keys")
        self._once(sender, set(self.cohort.members), self._shared, "shared keys")
        if set(shared.ciphertexts) != set(self.cohort.neighbours(sender)):
            raise SecAggError("bad-share", f"{sender} did not send one share for each of its neighbours")
        if len(shared.seed_commitment) != COMMITMENT_BYTES:
            raise SecAggError("bad-share", f"{sender}'s seed commitment is not {COMMITMENT_BYTES} bytes")
        self._shared[sender] = shared

    def inbox(self, recipient: str) -> dict[str, bytes]:
        """Round 2's input for one client: the shares its neighbours in U_2 sent it (Round 1 is closed)."""
        self._enter(2, "an inbox")
        if recipient not in self._shared:
            raise SecAggError("not-a-member", f"{recipient} did not share its keys in {self.context}")
        return {v: self._shared[v].ciphertexts[recipient] for v in self._partners(recipient)}

    def _partners(self, member: str) -> list[str]:
        return [v for v in self.cohort.neighbours(member) if v in self._shared]

    def receive_masked(self, sender: str, y: np.ndarray) -> None:
        """Round 2: a masked vector, checked before it is added to the running sum (a wrong one is named
        and changes nothing)."""
        self._enter(2, "a masked vector")
        self._once(sender, self._shared, self._masked, "masked vector")
        if not isinstance(y, np.ndarray) or y.dtype != prg.DTYPE or y.shape != (self.length,):
            got = f"{y.dtype} {y.shape}" if isinstance(y, np.ndarray) else type(y).__name__
            raise SecAggError("bad-length", f"{sender} sent {got}, {self.length} uint32 expected")
        np.add(self._total, y, out=self._total)
        self._masked.add(sender)

    def unmask_request(self) -> UnmaskRequest:
        """Round 4's request (Round 2 is closed). Fewer survivors than t: refused, as the paper aborts."""
        self._enter(4, "the unmasking request")
        if len(self._masked) < self.cohort.threshold:
            raise SecAggError(
                "too-few-survivors",
                f"{len(self._masked)} of {len(self.cohort.members)} clients sent masked inputs, "
                f"{self.cohort.threshold} needed",
            )
        dropped = tuple(sorted(set(self._shared) - self._masked))
        return UnmaskRequest(tuple(sorted(self._masked)), dropped)

    def receive_unmask(self, sender: str, answer: UnmaskShares) -> None:
        """Round 4: a survivor's shares; shares it could not hold or was not asked for are refused."""
        self._enter(4, "unmasking shares")
        self._once(sender, self._masked, self._answers, "unmasking answer")
        mine = set(self._partners(sender))
        asked = {"seeds": self._masked, "keys": set(self._shared) - self._masked}
        for kind, shares in (("seeds", answer.seeds), ("keys", answer.keys)):
            extra = sorted(set(shares) - (mine & asked[kind]))
            if extra:
                raise SecAggError(
                    "bad-share", f"{sender} sent {kind} shares it was not asked for: {', '.join(extra)}"
                )
            # a holder's share of v's secret has its place among v's neighbours as index
            wrong = sorted(
                v for v, s in shares.items() if s.index != self.cohort.neighbours(v).index(sender) + 1
            )
            if wrong:
                raise SecAggError(
                    "bad-share", f"{sender}'s {kind} shares of {', '.join(wrong)} carry wrong indices"
                )
        self._answers[sender] = answer

    def _request(self, owner: str, kind: str) -> shamir.Request:
        """What rebuilding ``owner``'s secret of ``kind`` ("seeds": b_u, "keys": s_u^SK's) takes: the shares
        its holders sent, the check against what the owner committed to or advertised, and its name."""
        holders = {h: getattr(a, kind)[owner] for h, a in self._answers.items() if owner in getattr(a, kind)}
        if kind == "seeds":
            commitment = self._shared[owner].seed_commitment

            def check(secret: bytes) -> bool:
                return seed_commitment(self.context, owner, secret) == commitment

            return holders, check, f"{owner}'s self-mask seed"

        def check_key(secret: bytes) -> bool:
            rebuilt = keys.mask_key(secret, self.context, owner)
            return keys.public_bytes(rebuilt) == self.roster[owner].mask

        return holders, check_key, f"{owner}'s mask key"

    def aggregate(
        self, combine_batch: Callable[[list[shamir.Points]], list[bytes | None]] = shamir.combine_each
    ) -> np.ndarray:
        """Σ x_u over the survivors U_3 (uint32): the running sum less each survivor's PRG(b_u) and less the
        pairwise masks its dropped neighbours will never cancel. Any secret that cannot be rebuilt and
        checked is a SecAggError, and nothing is returned. ``combine_batch`` combines the secrets' shares
        (shamir.recover_all: in this process, or on the aggregator's worker processes)."""
        self._enter(4, "the aggregate")
        survivors, dropped = sorted(self._masked), sorted(set(self._shared) - self._masked)
        requests = [self._request(u, "seeds") for u in survivors] + [
            self._request(u, "keys") for u in dropped
        ]
        recovered = shamir.recover_all(requests, self.cohort.threshold, combine_batch)
        for (_, _, what), (_, bad) in zip(requests, recovered):
            self.faults += [f"{h}'s share of {what} is wrong" for h in bad]
        secrets = [secret for secret, _ in recovered]  # the survivors' seeds, then the dropped clients' keys
        masks = [
            (keys.expand(seed, keys.SELF_MASK, self.context, u), -1)
            for u, seed in zip(survivors, secrets[: len(survivors)])
        ]
        for u, key_secret in zip(dropped, secrets[len(survivors) :]):
            private = keys.mask_key(key_secret, self.context, u)
            for v in self._partners(u):
                if v in self._masked:  # v added Δ_{v,u} · PRG(s_{v,u}); take it out
                    pair = keys.derive(private, self.roster[v].mask, keys.MASK_SEED, self.context, u, v)
                    masks.append((pair, -mask_sign(v, u)))
        total = self._total.copy()
        prg.apply(total, masks)
        self._phase, self._total = 5, np.zeros(0, prg.DTYPE)
        return total
