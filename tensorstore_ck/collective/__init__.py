"""Collective snapshots under torch.distributed.

put_snapshot and checkout are collective when torch.distributed is initialised
(or a group= is given). No tensor data crosses ranks in a put, ever:

    every rank   plans (validates) its own state -> hello (step, ref, job, a 16-byte
                 digest of its pieces of sharded tensors: its layout)
    rank 0       checks that all ranks agree; asks the ranks whose layout it does not
                 hold (from the job's previous snapshot) for their pieces -> need; checks
                 that the pieces tile each sharded tensor exactly (once per layout of the
                 whole job), reads the gc fence -> go
    every rank   hashes and writes its own blocks (a Replicated tensor's blocks
                 are spread over the ranks: each is written by exactly one),
                 writes its own manifest sub-tree, syncs -> done (32-byte root + stats +
                 a digest of its Replicated tensors' block addresses)
    rank 0       checks that the replicas agree (else abort: nobody wrote the blocks of
                 a diverged replica), composes one commit whose top names every rank's
                 tree through a rank tree and a chunk index cut by offset range
                 (format/world.py; the index built once per layout it checks),
                 claims the outcome ("decided" = commit), moves the ref once -> result
                 (if a gc deletion phase fenced the move: a re-validation round, in
                 which every rank re-uploads what the phase deleted of its own part,
                 then the move again)
    every rank   acks once it holds the outcome (result or abort); rank 0, which
                 usually hosts the Store, returns only when every rank has acked

Coordination goes through the process group's c10d Store (set/add/wait with
our own deadlines), never through collectives, so a dead or stalled rank cannot
poison the process group: when the deadline passes, rank 0 (or any rank that
fails) claims the outcome "abort" and writes an abort key, every live rank
raises SnapshotAborted, nothing is published, and the group stays usable for
training. The claim (one compare_set) makes abort and commit exclusive: once
rank 0 has claimed "commit", a rank whose deadline passes waits for the
result instead of declaring an abort, so a published snapshot is never
reported aborted while the Store is reachable; and rank 0 beats a counter while it
publishes, so the others wait for a slow rank 0 and give up only on a silent one.
A call's keys are named by what the call is, never by how many calls a process has
made: a put by its ref, its step (which a collective put must be given) and how many
puts of that ref and step this process made before; a checkout by the put named last
and how many checkouts followed it. A rank that skips a call, or makes another in its
place, costs that one call (OutOfStep, named as such: each rank posts which call it is
in, and a rank waiting for another reads it), never every later one: the next call has
the same name on every rank again. A call's outcome stays in the Store until every rank
has acked it. Nobody polls: a rank blocks on the keys it needs (c10d
`wait`, in a few slices of its timeout), an abort writes those keys to wake it, and a
counter's last arrival posts the one key rank 0 blocks on, so a rank's requests per
call are a constant however long it waits. The argument is in
docs/design/collective.md.

The rooms, top to bottom (pyproject.toml's contract for this package):

    put.py        the collective put, round by round (PutCall.run)
    checkout.py   the collective checkout, given resolve and read as roles
    job.py        CollectiveJob: what a call is given by the Store that makes it
    shared.py     shared reads: a checkout's block that several ranks read is read from
                  storage once, by its owner rank, and sent to the others over a TCP
                  side channel (each copy checked against its address)
    channel.py    the c10d channel of one call: keys, waits, aborts, claims, acks,
                  the out-of-step checks, rank 0's heartbeat (StoreGroup, guard)
    layout.py     rank 0's check of the ranks' layouts: digests, tiling, kept layouts
    naming.py     the names of calls (CollectiveContext, CALLS) and of ranks in messages
"""

from __future__ import annotations

from .channel import AUTO, StoreGroup, is_collective
from .checkout import collective_checkout
from .job import CollectiveJob
from .naming import CALLS, CollectiveContext
from .put import begin_put, collective_put, run_put

__all__ = ["collective_put", "begin_put", "run_put", "collective_checkout", "is_collective", "CollectiveContext",
           "CollectiveJob", "CALLS", "StoreGroup", "AUTO"]
