"""The collective checkout: every rank says what it asks for, rank 0 checks that they
agree and names the snapshot (job.resolve), every rank reads its own view of it
(job.read). Given those two roles, it knows nothing of the Store that makes it."""

from __future__ import annotations

import hashlib

from ..errors import InvalidArgument, RefNotFound, TsckError
from ..util.ids import Digest
from .channel import Channel, guard, open_channel, outcome_round
from .job import CollectiveJob
from .naming import ranks_named

# The shared keys of a checkout whose root was posted (no abort).
_CHECKOUT_KEYS = ["hello_n", "hello_all", "tsum", "root", "acked", "ack_all"]
_SHARED = "+shared"  # after the root: the ranks read the blocks several of them read once (shared.py)
_TIP = b"\0"  # in a hello, after the target: the rank's own tier's newest snapshot of it (job.tip)


def _target_hash(spelled: str) -> int:
    """40 bits of the target as written: W of them summed fit in the Store's int64 counter."""
    return int.from_bytes(hashlib.blake2b(spelled.encode(), digest_size=5).digest(), "little")


def _target_disagreement(ch: Channel, root: Digest, spelled: str, resolve) -> str | None:
    """Rank 0, when the ranks did not all write the target as it did: read what each asked
    for (only now: O(W)) and resolve each distinct one; the same snapshot written two ways
    (its ref, its root) is agreement. -> the refusal, or None."""
    asked: dict = {}
    for r in range(ch.world):
        t = (ch.get(f"hello/{r}").partition(_TIP)[0].decode(errors="replace") if ch.kv.check([ch.pfx + f"hello/{r}"])
             else "?")
        asked.setdefault(t, []).append(r)
    roots = {spelled: root.hex()}
    for t in list(asked)[:8]:
        if t not in roots:
            try:
                roots[t] = resolve(t).hex()
            except TsckError as e:
                roots[t] = f"{type(e).__name__}: {e}"
    if len(asked) <= 8 and all(roots[t] == root.hex() for t in asked):
        return None
    parts = [f"{ranks_named(rs)} {'asks' if len(rs) == 1 else 'ask'} for {t!r} ({roots.get(t, '?')[:16]})"
             for t, rs in sorted(asked.items(), key=lambda kv: kv[1][0])[:4]]
    return ("ranks disagree on the snapshot to check out: " + "; ".join(parts)
            + " (a collective checkout reads one snapshot on every rank; nothing was read)")


def collective_checkout(job: CollectiveJob, target):
    """Every rank says what it asks for (a hello); rank 0 checks that they all ask for
    the same snapshot and resolves `target` (job.resolve: so every rank reads the same
    snapshot even if the ref moves meanwhile); every rank then reads its own view with
    job.read(root, rank).
    The check costs each rank O(1) messages: each adds a 40-bit hash of its target to the
    counter "tsum", which equals W times rank 0's hash when all agree; rank 0 reads the
    hellos themselves only when it does not."""
    ch = open_channel(job.calls, job.group, "checkout", job.timeout, job.kv)
    ch.post_at()
    ch.cleanup_old()
    resolve, read = job.resolve, job.read
    spelled = target if isinstance(target, str) else repr(target)

    tip = job.tip(spelled) if job.tip is not None and ch.rank != 0 else b""

    def hello():
        ch.add("tsum", _target_hash(spelled))
        # (after tsum: rank 0 reads it once all arrived)
        ch.arrive("hello", spelled.encode() + (_TIP + tip if tip else b""), ch.world)

    def tips() -> list:
        """Rank 0: the tips the other ranks posted (one request for all)."""
        return [v.partition(_TIP)[2] for v in ch.get_many([f"hello/{r}" for r in range(1, ch.world)])]

    def sharing(shares: bool):
        return job.share(ch) if shares else None

    if ch.rank != 0:
        # The outcome is the root (or the error); the rest is this rank's own reading.
        def wait_root():
            guard(ch, hello)
            posted = guard(ch, lambda: ch.wait_key("root", "rank 0 to resolve the target", per_rank="hello")).decode()
            ch.used = _CHECKOUT_KEYS
            return Digest.parse(posted.removesuffix(_SHARED)), posted.endswith(_SHARED)
        root, shares = outcome_round(ch, wait_root, "")
        shared = sharing(shares)
        if shared is not None:
            ch.used = _CHECKOUT_KEYS + shared.keys()
        return read(root, ch.rank, shared)

    def agree():
        ch.wait_for(["hello_all"], "arrive", "hello", of_ranks=True)  # (the hellos are read only if they differ)
        try:
            root = resolve(target)
        except RefNotFound:
            if job.newest is None:
                raise
            # Rank 0's tier lost with its node, the remote holding none of the ref yet:
            # the other ranks' tiers may (their tips).
            root = job.newest(spelled, None, tips)
            if root is None:
                raise
        else:
            if job.newest is not None:
                root = job.newest(spelled, root, tips)
        if ch.add("tsum", 0) != ch.world * _target_hash(spelled):
            problem = _target_disagreement(ch, root, spelled, resolve)
            if problem is not None:  # every rank raises it as what it is
                ch.abort(problem, "invalid_argument", shared=True)
                raise InvalidArgument(problem)
        return root

    def body():
        guard(ch, hello)
        root = guard(ch, agree)
        shares = job.shares and ch.world > 1
        guard(ch, lambda: ch.set("root", (root.hex() + (_SHARED if shares else "")).encode()))
        shared = sharing(shares)
        out = read(root, 0, shared)  # while the others pick up the root
        ch.used = _CHECKOUT_KEYS + (shared.keys() if shared is not None else [])  # (no abort: this rank read)
        return out

    return outcome_round(ch, body, f"collective checkout of {target!r}")
