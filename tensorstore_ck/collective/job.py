"""What one collective call is given (CollectiveJob): the roles it uses, each an explicit
field, so that nothing in the call reaches back into the Store that makes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: publish.py and plan.py are the Store's to load
    from ..util.ids import Digest
    from ..write.plan import Plan
    from ..write.publish import Publisher
    from ..core.validate import SnapshotArgs
    from .naming import CollectiveContext


@dataclass(frozen=True)
class CollectiveJob:
    """What one collective put or checkout needs, built by the Store that makes it; nothing
    here calls back into the Store. A put fills publisher, prepare and plan (tier, timing
    and ident as it has them), a checkout resolve and read."""
    calls: CollectiveContext         # the process's call names: they name the call's keys
    group: Any                       # the process group (AUTO: the default one)
    timeout: float                   # seconds every rank waits for the others
    publisher: "Publisher | None" = None                 # put: every rank writes, rank 0 publishes, through it
    prepare: "Callable[[], SnapshotArgs] | None" = None  # put: the arguments, checked inside the call
    plan: "Callable[[], Plan] | None" = None             # put: this rank's plan (validates its state)
    # put: what it does besides the protocol. Through local tiers a tier.collective.CollectiveTier
    # (each rank's store is its own tier: each rank writes under its own tier's fence, rank 0
    # hands its commit, top node and rank-tree paths to the others, and every rank queues its
    # upload once the snapshot is published locally); else a tier.none.NoCollective (nothing).
    tier: Any = None
    timing: "Callable[[], Any] | None" = None  # put: -> publish.Timing of this rank's call (rank 0's is recorded)
    ident: Any = None  # put: (ref, step) as the caller gave them: they name the call (CollectiveContext.next)
    # checkout: rank 0 names the snapshot with it (Core.resolve; through a local tier, the
    # newer of the tier's and the remote's), so every rank reads the same one
    resolve: "Callable[[str], Digest] | None" = None
    read: "Callable[..., Any] | None" = None   # checkout: (root, rank, SharedRead | None) -> the state, as a rank reads it
    # checkout through tiers with replicas: tip(target) -> this rank's own tier's newest snapshot of
    # the ref (bytes, b"" for none), posted with its hello; newest(target, root, posted) -> what rank 0
    # reads instead of `root` when its own tier lost the ref (its node lost) and another rank's tier
    # holds a newer snapshot of it (posted() reads the others' tips: O(W), on that path only);
    # root None: no tier knows the ref (-> None where no other rank's tier does either)
    tip: "Callable[[str], bytes] | None" = None
    newest: "Callable[[str, Digest | None, Callable[[], list]], Digest | None] | None" = None
    # checkout: Channel -> a SharedRead (shared.py: the ranks read each block several of them read
    # once), made on every rank when rank 0's `shares` says so (one rank's choice for all)
    share: "Callable[[Any], Any] | None" = None
    shares: bool = False
    kv: Any = None                   # the c10d store (None: the group's default one)
