"""The memory tier (open_store(remote, memory=DIR, replicas=k, durable_every=N);
docs/design/memtier.md): a local tier whose directory is in host memory, and the
schedule on which a tier's snapshots reach the remote store.

Where the bytes live: a node's tmpfs (/dev/shm), not the training process. A restart
ends every worker of the job, and memory a worker held would be gone on every node
exactly when a restore needs it; a tmpfs file outlives the worker, a restarted worker
on the same node opens it again, and it is lost with its node, the failure the copies
on other nodes (replicas=k, placed by node) are there for.

The schedule: with durable_every=N the first snapshot of a ref a process puts through
the tier, and then every N-th, is uploaded (with durable_every=timedelta(minutes=10),
the first put of the ref once ten minutes passed since its last uploaded one); the
others stay in the tiers, their commit marked `tier_only` (docs/FORMAT.md). Rank 0
decides for a collective snapshot (the mark is in the commit every rank adopts). A
tier-only snapshot is kept, with its copies on the holders, until a newer snapshot of
the ref stands in for it (durable, or a later tier-only one whose put returned); then it
is expired from the tier (gc.retention_plan), whatever retention's rules say: the rules
keep durable snapshots, and a tier-only one must never become the only copy of a
snapshot they keep.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import re
import time

from ..core.validate import TIER_ONLY, tier_only
from ..errors import GcBusy, InvalidArgument, TsckError
from ..util.localfile import MEMORY_FS, existing_ancestor, fs_type

__all__ = ["TIER_ONLY", "MEMORY_FS", "memory_dir", "default_budget", "fs_type", "Schedule", "scheduled",
           "tier_only", "drop_superseded"]

log = logging.getLogger(__name__)
DEFAULT_ROOT = "/dev/shm"


def memory_dir(memory, url: str) -> str:
    """open_store(memory=) -> the tier's directory: True is a directory of this store under
    /dev/shm, one per node and local rank ($LOCAL_RANK, torchrun's; else $RANK, else 0) and
    user; a path must be on a file system whose files are host memory (InvalidArgument
    naming what it is on: a disk tier is local=).

    By local rank, not rank: a restarted job may number its nodes otherwise (torchrun's
    rendezvous orders them anew, an elastic restart has fewer or more), and a node's i-th
    rank must open the tier its i-th rank had, the one the peers' reads look for
    (placement.read_from). The node's name is in it too: nodes simulated on one host
    ($TSCK_NODE) share its /dev/shm."""
    if memory is True:
        from .placement import this_node
        if fs_type(DEFAULT_ROOT) not in MEMORY_FS:
            raise InvalidArgument(f"memory=True keeps the tier under {DEFAULT_ROOT}, which is not a tmpfs here: "
                                  "give memory= a directory on one (mount -t tmpfs), or use local= for a disk tier")
        var = "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "RANK"
        rank = os.environ.get(var, "0")
        if not rank.isdigit():
            raise InvalidArgument(f"memory=True names the tier by this process's local rank, and {var}={rank!r} is "
                                  "not one: give memory= a directory of this rank's own")
        tag = hashlib.blake2b(str(url).encode(), digest_size=8).hexdigest()
        node = re.sub(r"[^A-Za-z0-9._-]", "_", this_node())[:64].lstrip(".") or "_"
        return os.path.join(DEFAULT_ROOT, f"tsck-{os.getuid()}", tag, f"{node}.{int(rank)}")
    if not isinstance(memory, (str, os.PathLike)) or not os.fspath(memory):
        raise InvalidArgument(f"memory must be True or a directory path on a tmpfs, got {memory!r}")
    path = os.fspath(memory)
    kind = fs_type(path)
    if kind not in MEMORY_FS:
        raise InvalidArgument(f"memory={path!r} is on {kind or 'a file system that cannot be named'}, not in host "
                              f"memory ({' or '.join(MEMORY_FS)}): give a directory under a tmpfs such as "
                              f"{DEFAULT_ROOT}, or use local= for a disk tier")
    return path


NODE_SHARE = 0.5  # of a tmpfs: what the memory tiers of a node's ranks may take by default


def default_budget(path: str) -> int:
    """A memory tier's byte budget when open_store(local_budget=) is not given: half the
    tmpfs it is on, shared by the node's ranks ($LOCAL_WORLD_SIZE, torchrun's; 1 without
    it). A tmpfs is host memory that nothing frees: filled, its writers get ENOSPC (NCCL's
    and DataLoader workers' shared memory too, on /dev/shm) and the node's processes
    compete with it for RAM. The tier needs about (k+1) x a rank's share of the state
    (docs/design/memtier.md, "Where the memory lives"), far below this on a node fit for
    the job; past it, a put raises TierFull instead of the node running out."""
    st = os.statvfs(existing_ancestor(path))
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1
    return max(1, int(st.f_blocks * st.f_frsize * NODE_SHARE) // ranks)


def scheduled(every) -> bool:
    """Whether open_store(durable_every=) keeps some snapshots out of the remote: an int
    above 1, or a time (datetime.timedelta)."""
    return isinstance(every, datetime.timedelta) or every > 1


class Schedule:
    """Which snapshots of a tier reach the remote: the first of each ref this process
    puts, then every `every`-th (an int), or the first put once `every` (a
    datetime.timedelta) has passed since the ref's last durable one, by this process's
    monotonic clock (`clock`); the others are tier-only. Rank 0 decides for a collective
    snapshot, so one clock decides for the job."""

    def __init__(self, every, clock=time.monotonic):
        self.every = every
        self._clock = clock
        self._since: dict[str, int] = {}  # ref -> tier-only snapshots put since its last durable one
        self._last: dict[str, float] = {}  # ref -> clock() at its last durable one (a time schedule)

    def durable(self, ref: str) -> bool:
        """Decide for the next snapshot of `ref` (and count it)."""
        if isinstance(self.every, datetime.timedelta):
            now, last = self._clock(), self._last.get(ref)
            if last is None or now - last >= self.every.total_seconds():
                self._last[ref] = now
                return True
            return False
        n = self._since.get(ref)
        if n is None or n + 1 >= self.every:
            self._since[ref] = 0
            return True
        self._since[ref] = n + 1
        return False


def drop_superseded(core, job: str) -> None:
    """The tier-only snapshots of `job` a newer snapshot of their ref stands in for, expired
    from the tier and their objects deleted (gc.prune_job): the tier holds each ref's
    newest, not every snapshot the schedule kept out of the remote. A gc holding the
    tier leaves them to the next put (or that gc)."""
    from ..maintain.gc import prune_job
    try:
        prune_job(core, job)
    except GcBusy as e:
        log.debug("local tier: superseded tier-only snapshots of job %s left to the next put: %s", job, e)
    except TsckError as e:
        log.warning("local tier: superseded tier-only snapshots of job %s could not be dropped (%s); the next put "
                    "or `tsck gc` of the tier does it", job, e)
