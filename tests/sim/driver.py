"""The seeded interleaving harness: the FoundationDB-simulation / Jepsen idea at
this project's scale.

    python -m tests.sim --backend file|pg|s3 --seed N (--rounds R | --seconds S) [--focus F]

A run is a sequence of rounds on one store. In a round, 2-4 worker processes
(tests/sim/worker.py, each opening the store itself) run seeded random operations:
put_snapshot (blocking and asynchronous, some conditional; content shared across
workers so that dedup meets gc), tag, pin/unpin, set_retention (keep_last per job),
gc (the API with a random stale_after, or `tsck gc`), prune (one job), removals by
name (delete_ref, forget, untag), fsck, and reads. Each process
wraps its storage and its ref table in a seeded fault injector (tests/sim/faults.py:
delays aimed at windows such as tag objects and gc's deletes, transient failures,
kill -9 of itself at a chosen fault point), and the driver kills workers at random
moments too. Then, with the workers stopped, as an operator would: sometimes the ref
table is deleted and `recover` rebuilt it (a first recover maybe killed part-way), a
gc left locked by a killed gc is taken over, and the invariants are checked. In the
recover-live flavor the table is lost at the start of a round instead, and recover runs
beside the workers, killed -9 at random moments and run again.

Invariants (tests/sim/check.py), after every round:
  I1  every ref tip, tag, pin and catalog row checks out, bit-exact against the content
      its writer put (rebuilt from the spec the snapshot carries in meta["sim"]);
  I2  fsck (full) of the quiescent store is clean, and a gc run then succeeds;
  I3  no call returned success for something that did not happen, or that was undone
      without a cause: a successful put's snapshot stays (same content) unless
      retention may have dropped it (keep_last=N of its job and >= N other puts of
      the job may have been published after it); a ref tip never goes back behind a
      put that began after the tip's put returned; a successful tag exists on its root; a tag() that said RefNotFound
      created nothing; a successful pin holds until an unpin may have undone it (or
      the ref table was rebuilt: pins live only there);
  I4  calls judged on their own: an fsck running beside writers and gc reports no
      damage; a read returns exactly what was put (also each rank's own rows, read back
      through the chunk index after a collective put); no raw (non-TsckError) exception;
  I5  recover succeeds, and a second recover changes nothing (refs, tags, pins,
      catalog, reflogs);
  I6  after recover every ref is at the newest commit of its history whose tree is
      whole (even if a first recover was killed half-way);
  I7  what users removed stays removed, also through a recover over the live table: a
      deleted ref (unless a put on it may have run since), a forgotten snapshot, an
      untagged tag (its storage object goes first); unless the ref table was lost.
  I8  liveness: no successful put was fenced more than twice (a fenced writer takes a
      gc hold, so the gc's next deletion phase waits for its move).
  I9  the converse of I3, as strict: no call reported failure for something that
      happened (a put that raised, not OutcomeUnknown, published nothing; a tag that
      raised does not exist; a pin that raised is not there by its own doing).
  R1  a rollback (a CheckpointManager's restore(step)) that returned leaves its ref on
      the restored snapshot or on what may have moved it since, never on the abandoned
      run's tip (tests/sim/rollback.py; I3 lets a ref go back only for such a rollback);
  R2  every rank of a collective restore (restore_latest, one rank's part damaged in
      most) gets the same outcome: one snapshot read whole on each, or one error type.
  R3  a manager's snapshot one rank cannot stage (its state_dict() raises) is lost on
      every rank at once: an abort naming that error, well before the deadline; the next
      snapshot commits alike on every rank.
  P1  a SIGTERM to one rank or both at any moment of a collective CheckpointManager's run
      of asynchronous snapshots (before a step(), a snapshot in flight, between steps, from
      a thread at a seeded moment) is acted on at one step by every rank, with one outcome:
      the same step saved, whose checkout by one process is the ranks' states at that step,
      or none on any rank; nothing partial published (tests/sim/preempt.py; --focus preempt).
Writers through a local tier (open_store(local=), in seeded rounds; --focus tier: all):
their uploads are killed at the uploader's stages and at random, and check.check_tiers
judges T1-T9 (a remote ref names no missing object; a durable mark means the remote
catalog has it; each tier passes its fsck; one root in every tier; tier checkouts
bit-exact; wait_durable's True; no close() on damage; no ref moved back; no part intent left
by a rank that heard its put's outcome; a block damaged on a tier's disk, worker op rot,
never reaches the remote damaged: T10, and only it excuses T3, T5 and T7). To I1-I9 such a put is of unknown
outcome: it reaches the remote only if and when an uploader gets there. Some tiers' writers
have a job of their own (its retention set at start, pruned after puts, tags and pins on its
snapshots, some removed again), some a budget, some a tier shared by two processes, and a
tier may lose its ref table before a round (refused at open naming recover, `tsck recover`):
T11 nothing the job keeps (rules over both catalogs, tags, pins) is lost in both tiers; T12
after a clean close() what the job keeps is in the remote catalog; T13 a tier's bytes within
its budget plus a snapshot (judged where the budget bounds: tsck.TierFull); T14 no
IntegrityError, and no uploader stopped on one, where no tier was damaged (--focus
tier-share: one of the two uploaders of a tier trails the other on the same snapshot,
whose copy the other evicts under it); T15 the lost table's open refused naming recover;
T16 a close with the remote down ends within its timeout and says what stays queued; T17
a rank's tier keeps no part rank 0's last word left out once its uploads are done (--focus
ctier: collective puts through the ranks' tiers in every round); T18 a put through a tier
does not fail on its remote being down (--focus tier-down: every tier writer's remote
goes, its PostgreSQL table too). Removals, undeletes and answers through a tier, and outages
of the remote that come and go while a tier writer puts (tests/sim/tierops.py): T20 a removal
through a tier is in effect in both tables or refused with neither changed; T21 resolve and
show through a tier name what checkout reads; T22 after an outage longer than any fixed
count of attempts the uploads resume and the writer was told (--focus tier-ops).
An operation whose worker was killed, or that ended in OutcomeUnknown, has an unknown
outcome: either is allowed, a corrupt one never. On pg and s3 the workers reach the
ref table and the S3 server through tests/sim/netproxy.py, which drops answers, holds
COMMITs and black-holes the server at seeded random moments (rounds print
unknown_outcomes= and the proxies' counts).

Seeds: the run's seed fixes every random choice (rounds, workers, operations, fault
profiles, kill points and times); it is printed first (`HARNESS seed=...`), and a
failure prints the violations, the journal events involved, the journal tail and a
replay command. Processes and threads interleave differently on every run, so a
replay repeats the schedule of operations and faults, not the exact timing: rerun it
a few times (or with --rounds up to the failing one) to reproduce.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import tensorstore_ck as tsck

from .. import _zygote
from .._util import at_once
from . import check, content, preempt, rollback, tierops
from .backends import Location
from .netproxy import NetFaults
from .worker import CLOSE_DOWN_TIMEOUTS, Journal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFS = ["ja/main", "ja/side", "jb/main"]
JOBS = ["ja", "jb"]

# Per flavor: operation weights and how hard to aim at each window. The default ("mix")
# draws a flavor per round from the seed; --focus fixes one.
_BASE = {"ops": (8, 16), "slow_tags": 0.3, "slow_delete": 0.4, "fail": 0.2, "self_kill": 0.15,
         "driver_kill": 0.4, "kill_after_commit": 0.1, "kill_after_p": 0.5, "reuse_p": 0.35, "resave_p": 0.5,
         "recover_p": 0.25, "recover_kill": 0.6, "quiet_gc": 0.4, "delete_delay": [0.02, 0.06],
         "slow_commit": 0.2}
FLAVORS = {
    "mix": dict(_BASE, weights={"put": 5, "cput": 2, "tag": 2, "pin": 1.5, "unpin": 0.7, "retention": 1, "gc": 1.5,
                                "fsck": 0.7, "read": 1, "prune": 0.5}, rollback_p=0.06, crestore_p=0.5),
    # the window of a tag or pin landing on a snapshot a gc expires and deletes
    "tag-gc": dict(_BASE, weights={"put": 4, "cput": 1, "tag": 3, "pin": 2, "unpin": 0.5, "retention": 0.7, "gc": 2.5,
                                   "read": 0.5}, slow_tags=0.8, fail=0.05, recover_p=0.1),
    # the window of fsck walking snapshots that a gc beside it expires and deletes
    "fsck-gc": dict(_BASE, weights={"put": 4, "cput": 1, "gc": 2.5, "fsck": 2.5, "retention": 0.7, "read": 0.5},
                    slow_delete=0.6, fail=0.05, recover_p=0.1),
    # recover's windows: writers killed while gc deletes what they reuse, then the ref
    # table lost and rebuilt by a recover that is itself killed part-way
    "recover": dict(_BASE, weights={"put": 6, "cput": 2, "gc": 3, "retention": 1, "tag": 0.5, "pin": 0.3},
                    slow_delete=1.0, kill_after_p=1.0, self_kill=0.3, driver_kill=0.8, kill_after_commit=0.6,
                    reuse_p=0.8, resave_p=0.9, recover_p=1.0, recover_kill=0.8, slow_commit=0.6, vulture_p=0.5,
                    hot_ref_p=0.5),
    # the window of gc and writers judging staleness differently (needs --stale-skew)
    "stale": dict(_BASE, weights={"put": 5, "gc": 3, "retention": 1, "read": 0.5}, slow_delete=0.9,
                  fail=0.0, self_kill=0.05, driver_kill=0.2, recover_p=0.05, reuse_p=0.8, resave_p=0.9,
                  delete_delay=[0.1, 0.3], slow_commit=0.8, vulture_p=0.6),
    # removals by name and pruning beside writers, tags, pins, gc and recover:
    # delete_ref/forget/untag drop catalog rows and tags while gc and prune reclaim, and a
    # recover run over the live table must not bring back what was removed
    "remove": dict(_BASE, weights={"put": 5, "cput": 1, "delete_ref": 1, "forget": 1.5, "untag": 1, "tag": 1.5, "pin": 1,
                                   "unpin": 0.5, "prune": 1.5, "gc": 1, "retention": 1, "read": 1, "fsck": 0.3},
                   slow_tags=0.5, recover_p=0.15, recover_live_p=0.6, rollback_p=0.1, crestore_p=0.5),
    # recover beside gc, prune and writers: the ref table is lost at the start of the round
    # and `recover` runs while the workers do, killed -9 at random moments and started
    # again; only a finished recover may let a gc or prune delete (docs/design/recover.md,
    # "Why no gc deletes over a table being rebuilt"). No retention op: the driver sets keep_last high, so prune runs
    # and any snapshot a gc or prune took over the incomplete table is missed by I3. Half the rounds put every
    # writer on one ref: the recover adopts commits whose moves are losing races (one put, one snapshot: I3).
    "recover-live": dict(_BASE, weights={"put": 5, "gc": 3, "prune": 1.5, "tag": 0.5, "pin": 0.3, "read": 0.5,
                                         "fsck": 0.3}, recover_p=0.0, live_recover_p=1.0, live_kill=0.8,
                         live_attempts=3, quiet_gc=0.2, hot_ref_p=0.5),
}
# Commits whose answer never came (tests/sim/netproxy.py at high rates, every round): puts,
# tags and pins whose COMMIT is dropped or held while the server is black-holed past the
# workers' connect timeout (pg, s3; on file the network is not in the path). Not in the
# mix's draw: --focus net, and the mix's rounds get the proxies at their usual rates.
FLAVORS["net"] = dict(_BASE, weights={"put": 6, "tag": 1.5, "pin": 1, "unpin": 0.3, "gc": 0.7, "retention": 0.5,
                                      "read": 1}, fail=0.0, self_kill=0.05, driver_kill=0.2, recover_p=0.0,
                      kill_after_commit=0.0, net="heavy")
# --focus rollback: rollbacks (a CheckpointManager's restore(step)) often, the writer killed
# as one returns in a third of them, a collective restore after every collective put,
# one rank's part damaged in most, and half the collective puts made through a manager
# whose state fails on one rank (tests/sim/rollback.py: R1, R2, R3). Not in the mix's draw.
FLAVORS["rollback"] = dict(FLAVORS["mix"], weights=dict(FLAVORS["mix"]["weights"], cput=4), rollback_p=0.3,
                           rollback_kill=0.3, crestore_p=1.0, stagefail_p=0.5, tier_p=0.0, ctier_p=0.0)
MIX_DRAW = {"mix": 4, "tag-gc": 2, "fsck-gc": 2, "recover": 2, "stale": 1, "remove": 2}
# Writers with a local tier (open_store(remote, local=TIER)), beside the others: in a
# round drawn with probability tier_p (a stream of its own, so the other workers'
# schedules stay what they were), 1-2 of the workers after the first. They put (blocking
# and async), read through the tier, wait_durable; their uploader may be killed at one of
# its stages (faults.py kill_upload) with probability tier_kill; they end by closing
# (uploads finished), waiting a while, or being killed with uploads queued. The tiers
# persist across rounds: a later worker re-opens one and resumes its queue.
TIERS = 3
TIER_WEIGHTS = {"put": 5, "read": 1, "durable": 1.5}
# A catalog writer (a job of its own in its tier, drawn from a stream of its own): its
# rules set at start and the job pruned after most puts (as a CheckpointManager does), tags
# and pins on any of the job's snapshots in the tier, some removed again.
CATALOG_WEIGHTS = dict(TIER_WEIGHTS, tag=1.0, pin=0.7, untag=0.3, unpin=0.4)
TIER_STAGES = ["block", "block", "node", "commit", "move", "durable"]
TIER_ENDS = ["close", "close", "wait", "kill"]
for _f in FLAVORS.values():
    _f.setdefault("tier_p", 0.4)
    _f.setdefault("tier_kill", 0.4)
    _f.setdefault("ctier_p", 0.3)
    # Only --focus step draws these (in the seeded mix they changed the schedules CI's
    # seeds were chosen for: see TESTING.md, "Out of step").
    _f.setdefault("skip_p", 0.0)   # a collective put that rank 1 skips (Worker._skip_pair)
    _f.setdefault("grow_p", 0.0)   # an asynchronous put whose state's size is not the last one's
    # Rollbacks before a worker's ops and collective restores after its collective puts
    # (rollback.py; streams of their own, so the other draws stay as they were).
    _f.setdefault("rollback_p", 0.0)
    _f.setdefault("rollback_kill", 0.25)  # the writer killed as its rollback returns
    _f.setdefault("crestore_p", 0.0)
FLAVORS["recover-live"]["tier_p"] = 0.0  # the table is rebuilt under the writers there: not mixed with tiers
# --focus step: collective puts often, a rank skipping one (with and without steps) in half,
# asynchronous puts of states whose size changes between calls (the staging buffers).
FLAVORS["step"] = dict(FLAVORS["mix"], weights=dict(FLAVORS["mix"]["weights"], cput=5, put=8), skip_p=0.5,
                       grow_p=0.9, blocking_p=0.2)
# --focus tier: every round has tier writers, their uploaders killed more often.
FLAVORS["tier"] = dict(FLAVORS["mix"], tier_p=1.0, tier_kill=0.7, ctier_p=0.6, rot_p=0.3, catalog_p=0.8,
                       share_p=0.5, budget_p=0.5, tier_lost_p=0.2, down_p=0.2)
# --focus tier-share: two processes on one tier with a job, a budget and lagging uploads in
# every round, starting together: both uploaders send the same queued snapshot, one of them
# trailing (its looks at the remote slowed: _trailing), and the other marks it durable and
# evicts it while the trailing one still reads it. No collective puts (their ranks take
# the seconds a round has to start on a small host), fewer kills.
FLAVORS["tier-share"] = dict(FLAVORS["tier"], two_writers=True, share_p=1.0, catalog_p=1.0, budget_p=1.0,
                             lag_p=1.0, tier_kill=0.2, rot_p=0.0, tier_lost_p=0.0, down_p=0.0, ctier_p=0.0,
                             trail_p=1.0, budget_snaps=(1, 1), driver_kill=0.1, self_kill=0.05,
                             weights={k: w for k, w in FLAVORS["mix"]["weights"].items() if k != "cput"})
# --focus tier-down: every tier writer that is not killed ends with its remote gone (T16):
# the storage refuses every request and, on pg and s3, the remote ref table stops answering
# or refuses connections (Faults.remote_down); no uploader kills or damage, so the closes
# are reached with uploads queued.
FLAVORS["tier-down"] = dict(FLAVORS["tier"], down_p=1.0, tier_kill=0.0, rot_p=0.0)
# --focus ctier: collective puts through the ranks' tiers in every round, often, so rank 1's
# tier follows many of rank 0's prunes (T17).
FLAVORS["ctier"] = dict(FLAVORS["tier"], ctier_p=1.0, weights=dict(FLAVORS["mix"]["weights"], cput=8))
# --focus tier-ops: removals, undeletes and answers through the tiers often, and outages of
# the remote that come and go in most tier writers (tierops.py: T20-T22).
FLAVORS["tier-ops"] = dict(FLAVORS["tier"], outage_p=0.7, tier_remove_p=0.4, tier_kill=0.2, rot_p=0.0, ctier_p=0.0)
FLAVORS["tier"]["outage_p"], FLAVORS["tier"]["tier_remove_p"] = 0.3, 0.15
FLAVORS["tier-share"]["outage_p"] = 0.0  # (its two uploaders race on one snapshot: none away)
FLAVORS["remove"]["tier_remove_p"] = 0.2
# Preemptions (preempt.py: a SIGTERM at a seeded moment of a collective CheckpointManager's
# run of steps, P1): in some of the mix's collective puts (set after the flavors copied from
# the mix, whose seeded schedules stay as they were), in most of --focus preempt's.
FLAVORS["preempt"] = dict(FLAVORS["mix"], weights=dict(FLAVORS["mix"]["weights"], cput=4), preempt_p=0.6,
                          tier_p=0.0, ctier_p=0.0)
FLAVORS["mix"]["preempt_p"] = 0.15
# Seconds past its time a writer with an outage may take: the outage, then its uploads.
OUTAGE_GRACE = tierops.OUTAGE_CAP + tierops.RESUME_WAIT
# Seconds past its time a writer whose remote goes down as it ends may take: T16's bound.
DOWN_GRACE = max(CLOSE_DOWN_TIMEOUTS) + check.DOWN_MARGIN
# Objects that fail every read with a non-transient error (EIO, EACCES, EISDIR) while a
# worker's fsck or gc runs (faults.py `unreadable`; a stream of its own): in every round of
# --focus unreadable, and in 30% of a worker's rounds on the dirfs backend (a filesystem of
# folders through fsspec, where the fault comes from below the store's retry layer).
FLAVORS["unreadable"] = dict(FLAVORS["fsck-gc"], unreadable_p=1.0)
UNREADABLE = {"p": 0.5, "errnos": [5, 5, 13, 21]}  # EIO, EIO, EACCES, EISDIR
# Collective puts through local tiers: in a round drawn with probability ctier_p (a stream
# of its own), the first worker's ranks open the store each through its own tier (RANK_TIERS,
# one per rank, kept across rounds: rank 0's tier c0, rank 1's c1), rank 0's tier pruned by
# a rule of its own at times (the tier's prune, as a CheckpointManager's), so that rank 1's
# tier follows it (peers.py); check.check_tiers judges them with the other tiers.
RANK_TIERS = ("c0", "c1")
# Seconds a worker may take to say it is ready (its open, its ranks' start: worker.py waits
# up to 90 s for each rank's group): past them its open hangs, and it is killed as stuck.
OPEN_WAIT = 150.0


def _net_brief(net: dict) -> str:
    # o: ref moves' COMMITs orphaned (the session kept, holding the ref's lock, its client gone)
    return ",".join(f"{k}:{v['drops']}d/{v['holds']}h/{v.get('orphans', 0)}o/{v['blackouts']}b"
                    for k, v in net.items())


def leases_for(backend: str) -> list[float]:
    return [15.0, 20.0] if backend == "s3" else [1.0, 2.0, 5.0]


def _stat(pid) -> tuple[str, int, int] | None:
    """(state, process group, threads) of `pid` from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and parentheses
        return fields[0].decode(), int(fields[2]), int(fields[17])
    except (OSError, IndexError, TypeError, ValueError):
        return None


def _group_alive(pgid: int) -> bool:
    """Does a process of group `pgid` still run? A zombie whose threads have all ended (only
    its exit status left) does not; one whose leader ended first while a thread still
    finishes (a write in flight) does, and the gc lock rightly calls its holder alive."""
    for d in os.listdir("/proc"):
        st = _stat(d) if d.isdigit() else None
        if st is not None and st[1] == pgid and (st[0] not in ("Z", "X") or st[2] > 1):
            return True
    return False


def _reap(p: subprocess.Popen, wait: float = 120.0) -> str | None:
    """Kill what is left of an ended worker's process group and wait until it is gone.

    A worker's ranks and `tsck gc` children die with it (PDEATHSIG), but later: the
    kernel delivers that signal as the worker exits, and a loaded host takes a while
    to end a process holding torch. Until then such a child may hold the gc lock and
    renew it; the round's checks judge a store whose every writer has stopped (I2).
    -> None, or what went wrong (a process that outlived SIGKILL by `wait` seconds)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return None
    until = time.monotonic() + wait
    while _group_alive(p.pid):
        if time.monotonic() > until:
            return f"I4 a process of worker pid {p.pid}'s group outlived SIGKILL by {wait:.0f}s"
        time.sleep(0.01)
    return None


# A saver process ends within a second of its parent's death (docs/design/saver.md); a
# loaded host's scheduling is allowed for. Past this, a killed writer's saver outlived it.
SAVER_ORPHAN_WAIT = 10.0
_SAVER_MARK = b"tensorstore_ck.write.saver import main"


def _stacks_then_kill(p) -> None:
    """SIGKILL a stuck worker, after SIGUSR1 has had its threads' stacks written to its
    .err (faulthandler, registered by worker.main) for the report to show where it hung."""
    try:
        p.send_signal(signal.SIGUSR1)
        p.wait(0.5)  # (the dump is written by the C handler at once; a worker ends only by the kill)
    except subprocess.TimeoutExpired:
        pass
    except OSError:
        pass
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)


def _savers_in(pgid: int) -> list[int]:
    """The saver processes (saver.py's child) running in process group `pgid`; not one the
    harness stopped (SIGSTOP, a hung saver): it can run no handler until continued."""
    out = []
    for d in os.listdir("/proc"):
        st = _stat(d) if d.isdigit() else None
        if st is None or st[1] != pgid or st[0] in ("Z", "X", "T", "t"):
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if _SAVER_MARK in f.read():
                    out.append(int(d))
        except OSError:
            pass
    return out


def _orphaned_savers(orphans: list[tuple[int, float]]) -> list[str]:
    """Each (saver pid, when its writer was SIGKILLed): the saver must be gone by
    SAVER_ORPHAN_WAIT after that (before _reap's killpg would end it anyway)."""
    bad = []
    for pid, t in orphans:
        while (st := _stat(pid)) is not None and st[0] not in ("Z", "X") and time.time() < t + SAVER_ORPHAN_WAIT:
            time.sleep(0.02)
        if (st := _stat(pid)) is not None and st[0] in ("T", "t"):
            continue  # stopped by the writer's own injected hang (SIGSTOP) after it was listed: it can
            # run no handler until continued, and _reap's killpg ends it (as _savers_in leaves those out)
        if st is not None and st[0] not in ("Z", "X"):
            bad.append(f"I4 saver pid {pid} outlived its writer, SIGKILLed {time.time() - t:.1f} s before: "
                       f"{_proc_text(pid)}")
    return bad


def _proc_text(pid) -> str:
    """What /proc says of a process (state, group, threads), for a violation's message."""
    st = _stat(pid)
    return "gone" if st is None else f"state {st[0]}, group {st[1]}, threads {st[2]}"


class Harness:
    def __init__(self, seed: int, backend: str, *, rounds: int, focus: str | None = None, stale_skew: bool = True,
                 round_seconds: float = 5.0, pg_dsn: str | None = None, run_dir: str | None = None,
                 keep: bool = False, log=print):
        self.seed, self.backend, self.rounds, self.focus = seed, backend, rounds, focus
        self.stale_skew, self.round_seconds, self.log, self.keep = stale_skew, round_seconds, log, keep
        self.run_dir = run_dir or tempfile.mkdtemp(prefix=f"tsck-sim-{seed}-")
        os.makedirs(os.path.join(self.run_dir, "journal"), exist_ok=True)
        self.loc = Location(backend, self.run_dir, pg_dsn)
        self.net = NetFaults(self.loc)  # workers reach PostgreSQL and S3 through faulty proxies
        self.dj = Journal(os.path.join(self.run_dir, "journal", "driver.jsonl"), "driver")
        self.di = 0
        self.barriers: list[float] = []  # when the ref table was deleted
        self._tier_puts = self._tier_durable = self._budget_over = 0
        self.tiers = {f"t{k}": os.path.join(self.run_dir, "tiers", f"t{k}") for k in range(TIERS)}
        self.rank_tiers = {n: os.path.join(self.run_dir, "tiers", n) for n in RANK_TIERS}
        self.procs: dict[str, subprocess.Popen] = {}

    # -- plumbing ---------------------------------------------------------------------
    def _open(self, **kw) -> tsck.Store:
        st = self.loc.spec()
        return tsck.open_store(st["url"], refs=st["refs"], storage_options=st["storage_options"], create=False,
                               workers=3, **kw)

    def _spawn(self, cfg: dict) -> subprocess.Popen:
        """Start a worker (or a live recover) as the leader of a process group of its own."""
        path = os.path.join(self.run_dir, f"{cfg['id']}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_"))}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONFAULTHANDLER"] = "1"
        err = open(os.path.join(self.run_dir, f"{cfg['id']}.err"), "wb")
        # A process group of its own: its ranks and `tsck gc` children are in it (see _reap).
        p = _zygote.Popen([sys.executable, "-m", "tests.sim.worker", path], cwd=REPO, env=env,
                          stdout=err, stderr=err, start_new_session=True)
        err.close()
        self.procs[cfg["id"]] = p
        return p

    def _driver_op(self, op: str, args: dict, fn):
        """Run and journal one of the driver's own operations (an operator's action)."""
        i, self.di = self.di, self.di + 1
        self.dj.write(i=i, op=op, args=args, start=time.time())
        try:
            out = fn() or {}
        except tsck.TsckError as e:
            out = {"result": type(e).__name__, "error": str(e)[:400]}
        out.setdefault("result", "ok")
        self.dj.write(i=i, end=time.time(), **out)
        return out

    def _profile(self, rng: random.Random, fl: dict) -> dict:
        p = {"delay_p": rng.choice([0.0, 0.1, 0.3]), "delay_max": rng.choice([0.005, 0.02, 0.05]), "slow": {}}
        if rng.random() < fl["slow_tags"]:
            p["slow"]["tags/"] = rng.choice([0.3, 1.0])
        if rng.random() < fl["slow_delete"]:
            p["slow"]["delete"] = rng.choice(fl["delete_delay"])
        if rng.random() < 0.3:
            p["slow"]["ref-write"] = 0.02
        if rng.random() < fl["slow_commit"]:  # a writer between its blocks and its ref move: gc may freeze
            p["slow"]["commits/"] = rng.choice([0.2, 0.5])
        if rng.random() < fl["fail"]:
            p.update(fail_p=0.01, fail_ops=["put", "get", "delete", "list"])
        if rng.random() < fl["self_kill"]:
            p["kill_at"] = rng.randint(10, 500)
        if rng.random() < fl["kill_after_commit"]:
            # put-done of a commit: on a local disk it is written, not yet named (sync names
            # it); sync-done: everything named, the ref not moved
            op = rng.choice(["put-done", "sync-done"])
            p["kill_after"] = {"op": op, "prefix": "commits/" if op == "put-done" else "", "p": fl["kill_after_p"],
                               "during_gc": ["deleting"] if fl["kill_after_p"] >= 1 else ["marking", "deleting"]}
        return p

    # -- a round ------------------------------------------------------------------------
    def round(self, r: int) -> list[str]:
        rng = random.Random(f"{self.seed}:{r}")
        flavor = self.focus or rng.choices(list(MIX_DRAW), list(MIX_DRAW.values()))[0]
        fl = FLAVORS[flavor]
        t0 = self._round_t0 = time.time()
        n = rng.randint(2, 4)
        # gc leases (seconds): each gc declares its own; on s3 a lease must outlast a delete
        # request (the 6 s of client timeouts set in backends.py) and two renewal periods.
        leases = leases_for(self.backend)
        gc_stale = rng.choice(leases)
        # Own tensors a worker may put again: those of snapshots kept now but no ref's tip,
        # tag or pin (retention drops them as puts come: their blocks turn into gc
        # candidates while writers reuse them), else of recent puts.
        # Also those of snapshots no longer kept (a killed gc leaves their blocks behind:
        # candidates of every gc until one deletes them).
        with self._open() as s:
            rt = s.reftable
            protected = {r for _, r in rt.list()} | {r for _, r in rt.tags()} | rt.pins()
            rows = {root.hex(): row for root, row in rt.catalog_iter()}
            specs = [(row.get("meta") or {}).get("sim") for root, row in rows.items()
                     if bytes.fromhex(root) not in protected]
        gone = [o.args["spec"] for o in check.load_ops(self.run_dir)
                if o.op == "put" and o.ok and o.out["root"] not in rows][-20:]
        reuse = [sp.get("u", [sp["w"], sp["o"]]) for sp in gone + specs if sp]
        cfgs = []
        # One ref for every writer of the round (a stream of its own: the other draws stay as
        # they were): puts race for it, each loser re-encodes its commit and removes the one
        # the table refused, and the round's recover must find one snapshot per put (I3).
        hot = random.Random(f"{self.seed}:{r}:hot").random() < fl.get("hot_ref_p", 0.0)
        for k in range(n):
            wid = f"r{r}w{k}"
            cfgs.append({
                "id": wid, "seed": rng.getrandbits(62), "role": "ops", "store": self.net.spec(),
                "journal": os.path.join(self.run_dir, "journal", f"{wid}.jsonl"),
                "ops": rng.randint(*fl["ops"]), "seconds": self.round_seconds,
                # collective puts by the round's first worker only (its ranks are 2 more processes)
                "weights": {op: w for op, w in fl["weights"].items() if op != "cput" or k == 0},
                "refs": REFS[:1] if hot else REFS, "jobs": JOBS, "step_base": r * 100000 + k * 1000,
                "reuse": reuse, "reuse_p": fl["reuse_p"], "resave_p": fl["resave_p"],
                "vulture_p": fl.get("vulture_p", 0.0),
                # writers opened with their own (small) gc_lease, the lease of
                # their own gcs; only a gc's lease decides, so it must change nothing
                "gc_lease": rng.choice([0.3, 1.0, 5.0, 30.0]) if self.stale_skew else None,
                "gc_stale": gc_stale, "gc_leases": leases if self.stale_skew else [gc_stale], "faults": self._profile(rng, fl), "pause": rng.choice([0.0, 0.05, 0.2])})
        for c in cfgs:
            c["skip_p"], c["grow_p"], c["blocking_p"] = fl["skip_p"], fl["grow_p"], fl.get("blocking_p", 0.6)
            if hot:  # a commit written slowly: the ref moves meanwhile, its move loses the race
                slow = c["faults"].setdefault("slow", {})
                slow["commits/"] = max(slow.get("commits/", 0.0), 1.0)
        tiered = self._tier_writers(r, fl, cfgs)
        for c in cfgs:  # (a tier writer's puts reach the remote ref through its uploader: no rollbacks)
            c["rollback_p"], c["rollback_kill"] = (0.0 if c.get("tier") else fl["rollback_p"]), fl["rollback_kill"]
            c["crestore_p"], c["stagefail_p"] = fl["crestore_p"], fl.get("stagefail_p", 0.0)
            c["preempt_p"] = fl.get("preempt_p", 0.0)
        # Some writers of the one ref (not through a tier: its races are the tier's own) are
        # killed right after the move that follows a lost race, before the refused commit is
        # removed: recover must adopt one of the two (a stream of its own).
        krng = random.Random(f"{self.seed}:{r}:kill-raced")
        for c in cfgs:
            if hot and "tier" not in c and krng.random() < 0.5:
                c["faults"]["kill_raced"] = 0.6
        urng = random.Random(f"{self.seed}:{r}:unreadable")
        for c in cfgs:
            if urng.random() < fl.get("unreadable_p", 0.3 if self.backend == "dirfs" else 0.0):
                c["faults"]["unreadable"] = UNREADABLE
        if cfgs[0]["weights"].get("cput") and random.Random(f"{self.seed}:{r}:ctier").random() < fl["ctier_p"]:
            cfgs[0]["rank_tiers"] = [self.rank_tiers[n] for n in RANK_TIERS]
            # Some with a budget of 1-3 snapshots' bytes on every rank's tier (a stream of its own).
            brng = random.Random(f"{self.seed}:{r}:rank-budget")
            if brng.random() < fl.get("budget_p", 0.2):
                cfgs[0]["rank_budget"] = brng.randint(1, 3) * content.stored_bytes(content.make_spec("w", 0, 0, 0))
        # Driver kills: (seconds after that worker is ready, which worker).
        kills = [(rng.uniform(0.0, self.round_seconds), rng.randrange(n))
                 for _ in range(2) if rng.random() < fl["driver_kill"]]
        # (no draw for the other flavors: their seeded schedules stay as they were)
        live = self._live_recover_start(rng, fl, r) if fl.get("live_recover_p") and \
            rng.random() < fl["live_recover_p"] else None
        bad = self._lose_tier_tables(r, fl, tiered)
        # its own draws: the schedules of operations stay what they were
        net_on = self.net.start_round(random.Random(f"{self.seed}:{r}:net"), heavy=fl.get("net") == "heavy")
        # The round's workers start their operations together (worker.py's meet): the first
        # one's two ranks take seconds to start on a loaded machine, and its collective puts
        # are to meet the others' gcs and puts, not follow them.
        for c in cfgs:
            c["meet"] = {"path": os.path.join(self.run_dir, "journal", f"r{r}.meet"), "n": len(cfgs)}
        procs = [self._spawn(c) for c in cfgs]
        ready: dict[int, float] = {}
        killed = stuck = 0
        stuck_pids: set = set()
        orphans: list = []  # (saver pid, when its writer was killed): each must end by itself
        driver_pids: set = set()  # SIGKILLed by a driver kill (a worker may have ended meanwhile)
        # A worker not ready by OPEN_WAIT hangs in its open (a loaded machine's start of a
        # worker and its two ranks takes tens of seconds: that is not the round's
        # time, so readiness is each worker's own event, never a clock shared with the others).
        open_stop = time.time() + OPEN_WAIT
        hard_stop = 0.0
        while any(p.poll() is None for p in procs):
            now = time.time()
            for k, c in enumerate(cfgs):
                if k not in ready and os.path.exists(c["journal"] + ".ready"):
                    ready[k] = now
                    # Past its time plus a grace, a worker is stuck (waiting out a dead gc
                    # for its gc_lease, say): killed, its last call's outcome unknown. The
                    # ready ones share the latest bound (a late one keeps the others company).
                    # (a writer with an outage waits it out, and its uploads, after its time)
                    # (one whose remote goes down as it ends has its close's bound too, T16: its
                    # last put may have run past the round, waiting for room in its tier)
                    hard_stop = max(hard_stop, now + self.round_seconds + 8 + (OUTAGE_GRACE if c.get("outage") else 0)
                                    + (DOWN_GRACE if c.get("tier_end") == "down" else 0))
            for kill in [x for x in kills if x[1] in ready and ready[x[1]] + x[0] <= now]:
                kills.remove(kill)
                if procs[kill[1]].poll() is None:
                    savers = _savers_in(procs[kill[1]].pid)
                    procs[kill[1]].send_signal(signal.SIGKILL)
                    orphans += [(pid, time.time()) for pid in savers]
                    killed += 1
                    driver_pids.add(procs[kill[1]].pid)
            if live is not None:
                self._live_recover_tick(live, rng, now)
            for k, p in enumerate(procs):
                if (now > hard_stop if k in ready else now > open_stop) and p.poll() is None \
                        and p.pid not in stuck_pids:  # once each, not every 20 ms
                    _stacks_then_kill(p)
                    stuck_pids.add(p.pid)
            stuck = len(stuck_pids)
            time.sleep(0.02)
        bad += _orphaned_savers(orphans)
        bad += [e for e in map(_reap, procs) if e]
        self._repair_planted()
        for c, p in zip(cfgs, procs):
            if p.returncode not in (0, -signal.SIGKILL):
                with open(os.path.join(self.run_dir, f"{c['id']}.err"), errors="replace") as f:
                    bad.append(f"I4 worker {c['id']} exited {p.returncode}: {f.read()[-1500:]}")
        net = self.net.end_round()  # held COMMITs land now, after their clients gave up
        t_work = time.time() - t0
        # by the worker itself (Worker._die_after): SIGKILLed, and not by this driver
        self_killed = sum(1 for p in procs if p.returncode == -signal.SIGKILL
                          and p.pid not in driver_pids and p.pid not in stuck_pids)
        recovered = rng.random() < fl["recover_p"]
        t1 = time.time()
        if recovered:
            bad += self._recover_phase(rng, fl, r)
        if live is not None:
            recovered = True
            bad += self._live_recover_finish(live, r)
        t2 = time.time()
        bad += self._settle_and_check(rng, fl)
        ids = {c["id"] for c in cfgs}
        hits, fenced, collective, collective_async, shared = {}, 0, 0, 0, 0  # the presence record, writers' holds, collective puts
        kept, relaid = {}, 0  # puts planned from a kept layout (per writer Store), puts of a changed layout
        unchanged, frozen_writes = {}, 0  # tensors proven unchanged (per writer process), puts after a frozen write
        raced = 0  # puts that lost a race for their ref (and removed the commit the table refused)
        ctier = 0  # collective puts through the ranks' tiers (published there; their outcome remote is unknown)
        unknown = 0  # calls that ended in OutcomeUnknown (the network proxies' lost answers)
        kill0: dict = {}  # collective puts through tiers whose rank 0 died publishing: what rank 1 was told
        phases = 0  # deletion phases the round's gcs and prunes opened (writers fenced in each)
        rots = stopped = 0  # blocks damaged on a tier's disk (op rot); uploaders that stopped on damage
        unread: dict = {}  # fsck/gc calls under the `unreadable` fault, by outcome ("fsck:ok", "gc:UnreadableObject")
        skips: dict = {}  # collective puts one rank skipped, by what rank 0 was told; "next:" the put after
        grown = 0  # asynchronous puts of a state whose size was drawn for the call
        saved: dict = {}  # asynchronous puts through a saver process, by outcome
        packed = 0  # puts whose small tensors went into packs (open_store(pack_size=))
        # rollbacks (restore(step)) by outcome; collective restores by what the ranks got
        rolls, crest = rollback.brief_rollbacks(check.load_ops(self.run_dir), ids)
        for o in check.load_ops(self.run_dir):  # were exercised (or not)
            if o.w in ids and o.op == "put" and (o.args.get("skipped_by") or o.args.get("after_skip") is not None):
                k = ("next:" if o.args.get("after_skip") is not None else "") + \
                    ("nostep:" if o.args.get("nostep") else "") + (str(o.result) if o.end is not None else "unknown")
                skips[k] = skips.get(k, 0) + 1
            grown += 1 if o.w in ids and o.op == "put" and o.ok and "g" in (o.args.get("spec") or {}) else 0
            if o.w in ids and o.op == "put" and o.args.get("saver"):
                k = (str(o.result) if o.end is not None else "killed") + \
                    (f"({o.args['saver_sig'].lower()})" if o.args.get("saver_sig") else "")
                saved[k] = saved.get(k, 0) + 1
            packed += 1 if o.w in ids and o.op == "put" and o.result == "ok" and o.args.get("packs") else 0
            if o.w in ids and o.op == "put" and o.args.get("upload_saver_sig"):  # a tier's saver hit as it uploads
                k = f"upload({o.args['upload_saver_sig'].lower()})"
                saved[k] = saved.get(k, 0) + 1
            if o.w in ids and o.args.get("unreadable") and o.end is not None:
                unread[f"{o.op}:{o.result}"] = unread.get(f"{o.op}:{o.result}", 0) + 1
            rots += 1 if o.w in ids and o.op == "rot" and o.ok and o.out.get("key") else 0
            # (wait_durable raises the uploader's stop once; close() then says nothing more)
            stopped += 1 if o.w in ids and o.op in ("close", "durable") and o.result == "IntegrityError" else 0
            unknown += 1 if o.w in ids and o.result == "OutcomeUnknown" else 0
            phases += (o.out.get("phases") or 0) if o.w in ids and o.ok and o.op in ("gc", "prune") else 0
            ctier += 1 if o.w in ids and o.result == "ok" and o.op == "put" and o.args.get("rank_tiers") else 0
            if o.w in ids and o.op == "put" and o.args.get("kill0") and o.end is not None:
                told = (o.out.get("ranks") or [None, None])[1]
                kill0[told] = kill0.get(told, 0) + 1
            if o.w in ids and o.ok and o.op == "put":
                hits[o.w] = max(hits.get(o.w, 0), o.out.get("hits", 0))
                kept[o.w] = max(kept.get(o.w, 0), o.out.get("kept_plans", 0))
                unchanged[o.w] = max(unchanged.get(o.w, 0), o.out.get("unchanged", 0))
                frozen_writes += 1 if o.args.get("frozen") not in (None, "kept") else 0
                relaid += 1 if "l" in (o.args.get("spec") or {}) else 0
                fenced += o.out.get("fenced") or 0
                raced += 1 if o.out.get("races") else 0
                collective += 1 if o.args.get("collective") else 0
                shared = max(shared, o.out.get("shared_got") or 0)
                collective_async += 1 if o.args.get("collective") and not o.args.get("blocking", True) else 0
        stuck_ids = "".join(f"{', ' if k else ': '}{c['id']}{'' if cfgs.index(c) in ready else ' never ready'}"
                            for k, c in enumerate(c for c, p in zip(cfgs, procs) if p.pid in stuck_pids))
        self.log(f"round {r} flavor={flavor} workers={n} gc_stale={gc_stale} presence_hits={sum(hits.values())} "
                 f"kept_plans={sum(kept.values())} unchanged_reused={sum(unchanged.values())} "
                 f"frozen_writes={frozen_writes} relaid_puts={relaid} fenced_puts={fenced} raced_puts={raced}"
                 f"{f'(one ref, {self._killed_raced(ids)} killed after their move)' if hot else ''} "
                 f"collective_puts={collective} ({collective_async} async, {ctier} through tiers, "
                 f"{shared} blocks got from their owner rank by shared reads) "
                 f"rank0_killed={sum(kill0.values())}{'(rank 1 told ' + ','.join(f'{k}:{v}' for k, v in kill0.items()) + ')' if kill0 else ''} "
                 f"skipped_by_a_rank={','.join(f'{k}x{v}' for k, v in sorted(skips.items())) or 0} grown_async={grown} "
                 f"saver_puts={','.join(f'{k}x{v}' for k, v in sorted(saved.items())) or 0} packed_puts={packed} "
                 f"{rolls}(killed after: {self._killed_raced(ids, 'after-rollback')}) {crest} "
                 f"{preempt.brief_preempts(check.load_ops(self.run_dir), ids)} "
                 f"unknown_outcomes={unknown} deletion_phases={phases} tier={self._tier_brief(tiered, ids)} "
                 f"{tierops.brief(check.load_ops(self.run_dir), ids)} rot={rots}(uploaders stopped on it: {stopped}) "
                 f"unreadable={','.join(f'{k}x{v}' for k, v in sorted(unread.items())) or 0} "
                 f"net={'off' if not net_on else _net_brief(net)} "
                 f"kills={killed}+{self_killed}+{stuck} (driver+self+stuck{stuck_ids}, savers orphaned: {len(orphans)}) "
                 f"recover={'yes' if recovered else 'no'} {'OK' if not bad else 'FAILED'} "
                 f"({time.time() - t0:.1f}s: workers {t_work:.1f}, recover {t2 - t1:.1f}, "
                 f"checks {time.time() - t2:.1f})")
        return bad

    def _tier_writers(self, r: int, fl: dict, cfgs: list) -> list[dict]:
        """Make 1-2 of the round's workers (never the first: it drives the collective puts)
        writers through a local tier, each its own, or (share_p, a stream of its own) the
        second opening the first's tier too: two processes, one tier, one queue. Then
        _catalog_writers gives some a job of their own."""
        trng = random.Random(f"{self.seed}:{r}:tier")
        if len(cfgs) < 2 or trng.random() >= fl["tier_p"]:
            return []
        m = trng.randint(1, min(2, len(cfgs) - 1)) if not fl.get("two_writers") or len(cfgs) < 3 else 2
        out = []
        names = trng.sample(sorted(self.tiers), m)
        if m == 2 and random.Random(f"{self.seed}:{r}:share").random() < fl.get("share_p", 0.2):
            names[1] = names[0]
        for k, name in zip(trng.sample(range(1, len(cfgs)), m), names):
            c = cfgs[k]
            c.update(tier=self.tiers[name], weights=dict(TIER_WEIGHTS), vulture_p=0.0,
                     tier_end=trng.choice(TIER_ENDS))
            if trng.random() < fl["tier_kill"]:
                at = trng.choice(TIER_STAGES)
                c["faults"]["kill_upload"] = {"at": at, "n": trng.randint(1, 6) if at == "block" else 1}
            # The early upload (blocks sent from memory as the put writes them) in half the
            # writers, from a stream of its own so the draws above keep their seeds' schedule.
            c["early_upload"] = random.Random(f"{self.seed}:{r}:{k}:early").random() < 0.5
            # Some that would close cleanly close with the remote down (T16), a stream of its own.
            if c["tier_end"] != "kill" and random.Random(f"{self.seed}:{r}:{k}:down").random() < fl.get("down_p", 0.05):
                c["tier_end"] = "down"
            # Some upload through a saver process (open_store(saver="process")), a stream of
            # its own; not those ending "down": the saver opens the remote without the fault
            # wrapper that takes the remote down.
            if c["tier_end"] != "down" and random.Random(f"{self.seed}:{r}:{k}:saver").random() < 0.3:
                c["saver"] = True
            c["sharing"] = names.count(name)
            # Some damage their own tier's disk (worker op "rot"), drawn from a stream of its own too.
            rot_rng = random.Random(f"{self.seed}:{r}:{k}:rot")
            if rot_rng.random() < fl.get("rot_p", 0.1):
                c["rot"] = True
                # mostly without the early upload: the uploader then reads back what it sends
                c["early_upload"] = c["early_upload"] and rot_rng.random() < 0.3
                c["weights"]["rot"] = 1.5
                # Its remote block writes slowed, so the damage it does as a put returns
                # often lands before the uploader reads that block.
                c["faults"]["slow"] = dict(c["faults"].get("slow") or {}, **{"blocks/": 0.2})
            # Some have the remote away for a stretch, and back, while they put (tierops.Outage:
            # T22), a stream of its own; not a writer whose uploader is to be killed or stop on
            # damage, that ends "down" or uploads through a saver (which the outage misses).
            orng = random.Random(f"{self.seed}:{r}:{k}:outage")
            if orng.random() < fl.get("outage_p", 0.05) and c["tier_end"] != "down" and not c.get("saver") \
                    and not c.get("rot") and "kill_upload" not in c["faults"]:
                c["outage"] = {"at": orng.randint(1, 2), "pause": list(orng.choice(tierops.PAUSES))}
            # Removals, undeletes and answers through the tier (tierops.maybe_tier_op: T20, T21, I7).
            c["tier_remove_p"] = fl.get("tier_remove_p", 0.05)
            out.append(c)
        self._catalog_writers(r, fl, out)
        self._trailing(r, fl, out)
        return out

    def _trailing(self, r: int, fl: dict, tiered: list) -> None:
        """In a tier two processes share (trail_p per tier, a stream of its own): one of
        them looks at each remote object slowly (faults.py slow_head), so its uploader
        trails the other's on the same queued snapshot, whose copy the other then marks
        durable and takes from the tier (its budget's eviction, its job's prune) while
        this one still reads it: no damage (Uploader.gone_meanwhile)."""
        trng = random.Random(f"{self.seed}:{r}:trail")
        by_tier: dict[str, list] = {}
        for c in tiered:
            by_tier.setdefault(c["tier"], []).append(c)
        for path, cs in sorted(by_tier.items()):
            if len(cs) > 1 and trng.random() < fl.get("trail_p", 0.0):
                trng.choice(cs)["faults"]["slow_head"] = {"max": trng.choice([0.2, 0.4])}

    def _catalog_writers(self, r: int, fl: dict, tiered: list) -> None:
        """Give the writers of some tiers (catalog_p per tier, a stream of its own) the
        tier's job ("j" + the tier's name, its refs the writer's slot's: a second writer of
        a shared tier has refs of its own in the same job): its retention (keep_last 1-3,
        keep_best in half), set at start; prunes after puts; tags, pins and their removals;
        some a budget of 1-3 snapshots' bytes, one for every process of that tier."""
        crng = random.Random(f"{self.seed}:{r}:catalog")
        by_tier: dict[str, list] = {}
        for c in tiered:
            by_tier.setdefault(c["tier"], []).append(c)
        one = content.stored_bytes(content.make_spec("w", 0, 0, 0))
        for path, cs in sorted(by_tier.items()):
            on = crng.random() < fl.get("catalog_p", 0.4)
            keep_last, keep_best = crng.randint(1, 3), crng.choice([0, 1])
            budget = crng.randint(*fl.get("budget_snaps", (1, 3))) * one if crng.random() < fl.get("budget_p", 0.2) \
                else None
            # Uploads that lag behind the puts (the remote's block requests slowed): a backlog
            # for the backlog rule, durable copies held back from the budget.
            lag = crng.random() < fl.get("lag_p", 0.5)
            if not on:
                continue
            job = "j" + os.path.basename(path)
            for slot, c in enumerate(cs):
                tail = "" if slot == 0 else str(slot + 1)
                c.update(catalog={"job": job, "keep_last": keep_last, "keep_best": keep_best},
                         refs=[f"{job}/main{tail}", f"{job}/side{tail}"], jobs=[job], weights=dict(CATALOG_WEIGHTS),
                         budget=budget, sharing=len(cs), reuse=[])
                if c.get("rot"):
                    c["weights"]["rot"] = 1.5
                if lag:
                    c["lag"] = True
                    c["faults"]["slow"] = dict(c["faults"].get("slow") or {}, **{"blocks/": 0.2})

    def _lose_tier_tables(self, r: int, fl: dict, tiered: list) -> list[str]:
        """Before the round's tier writers open their tiers (tier_lost_p each, a stream of
        its own): a tier that holds snapshots loses its ref table, removed (refs.lmdb gone, as
        a disk's table file lost) or emptied (data.mdb cut to 0 bytes, as a node's filesystem
        crash leaves it: a table that knows none of the commits the tier holds); opening it
        must be refused, NotAStore naming `tsck recover PATH` (T15), before anything is
        created; the operator runs `tsck recover PATH`, and the writer's open then finds the
        rebuilt table and uploads the recovered tip."""
        lrng = random.Random(f"{self.seed}:{r}:lost")
        bad = []
        for path in sorted({c["tier"] for c in tiered}):
            if lrng.random() >= fl.get("tier_lost_p", 0.03) or not os.path.isdir(os.path.join(path, "commits")):
                continue
            name = os.path.basename(path)
            how = lrng.choice(["removed", "emptied"])

            def lose():
                table = os.path.join(path, "refs.lmdb")
                if how == "removed":
                    shutil.rmtree(table)
                else:
                    with open(os.path.join(table, "data.mdb"), "r+b") as f:
                        f.truncate(0)
                        os.fsync(f.fileno())
            self._driver_op("tier_lost", {"tier": name, "how": how}, lose)
            st = self.loc.spec()

            def refused_open():
                try:
                    tsck.open_store(st["url"], refs=st["refs"], storage_options=st["storage_options"], create=False,
                                    local=path).close()
                except tsck.NotAStore as e:
                    return {"refused": str(e)[:400], "names_recover": f"tsck recover {path}" in str(e)}
                return {"result": "opened"}
            out = self._driver_op("tier_open", {"tier": name, "lost_table": True}, refused_open)
            if out["result"] != "ok" or not out.get("names_recover"):
                bad.append(f"T15 tier {name} lost its ref table ({how}) and its open was not refused naming "
                           f"`tsck recover {path}`: {out}")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_"))}
            env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")

            def recover():
                p = _zygote.run([sys.executable, "-m", "tensorstore_ck", "recover", path], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=300)
                return {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-400:],
                        "result": "ok" if p.returncode == 0 else "CliError"}
            out = self._driver_op("tier_recover", {"tier": name}, recover)
            if out["result"] != "ok":
                bad.append(f"T15 `tsck recover {path}` failed: {out}")
        return bad

    def _tier_brief(self, tiered: list, ids: set) -> str:
        """tier=W:T:END[:early|:saver][:rot][:kill-STAGE],... then the snapshots in all the tiers so far, of
        those the ones marked durable (as the checks found them), and the round's workers
        killed inside their uploader."""
        if not tiered:
            return "off"
        parts = [f"{c['id']}:{os.path.basename(c['tier'])}:{c['tier_end']}"
                 + (":saver" if c.get("saver") else ":early" if c.get("early_upload") else "")
                 + (":rot" if c.get("rot") else "")
                 + (f":kill-{c['faults']['kill_upload']['at']}" if "kill_upload" in c["faults"] else "")
                 + (f":keep{c['catalog']['keep_last']}{'+best' if c['catalog']['keep_best'] else ''}"
                    if c.get("catalog") else "")
                 + (f":budget{c['budget'] // 1000}k" if c.get("budget") else "")
                 + (":shared" if c.get("sharing", 1) > 1 else "") + (":lag" if c.get("lag") else "")
                 + (":trail" if "slow_head" in c["faults"] else "") + (":outage" if c.get("outage") else "")
                 for c in tiered]
        counts: dict = {}  # the catalog writers' calls by outcome (tag:ok, kept:ok, prune:GcBusy...)
        fences = 0  # the uploaders' fenced remote moves: a closing writer's fences less its puts'
        gone = 0  # uploads that found their copy taken by another process of the tier (as each writer ended)
        for o in check.load_ops(self.run_dir):
            if o.w in ids and o.op == "close" and o.args.get("tier") and "fences" in o.out:
                fences += o.out["fences"]
            gone += o.out.get("gone", 0) if o.w in ids and o.op == "uploader" and o.ok else 0
            if o.w in ids and o.op == "put" and o.args.get("tier") and o.ok:
                fences -= o.out.get("fenced", 0)
            if (o.w in ids and o.op in ("tag", "pin", "untag", "unpin", "prune", "kept") and o.args.get("tier")) \
                    or (o.w == "driver" and o.op == "tier_recover" and o.start >= self._round_t0):
                k = f"{o.op}:{'killed' if o.end is None else o.result}"
                counts[k] = counts.get(k, 0) + 1
        return ",".join(parts) + f"(puts={self._tier_puts}, durable={self._tier_durable}, " \
                                 f"upload_kills={self._upload_kills(ids)}, upload_fences={max(0, fences)}, " \
                                 f"upload_gone={gone}, " \
                                 f"budget_over={self._budget_over}, " \
                                 f"catalog={','.join(f'{k}x{v}' for k, v in sorted(counts.items())) or 0})"

    def _upload_kills(self, ids: set) -> int:
        """Workers of the round killed inside their uploader (journaled kill records; two
        I/O threads may both reach the stage before the signal lands: one kill)."""
        n = 0
        for w in ids:
            try:
                with open(os.path.join(self.run_dir, "journal", f"{w}.jsonl")) as f:
                    n += any('"op": "upload-' in line for line in f)
            except OSError:
                pass
        return n

    def _recover_phase(self, rng: random.Random, fl: dict, r: int) -> list[str]:
        """The ref table is lost; an operator runs recover (with no writer running). The
        first may be killed part-way (at a random ref-table write), then run again."""
        with self._open() as s:
            store_id = s.config["id"]
        self.barriers.append(time.time())
        self._driver_op("delete_refs", {}, lambda: self.loc.delete_ref_table(store_id))
        bad = []
        for attempt in range(4):
            kill = "auto" if attempt < 2 and rng.random() < fl["recover_kill"] else None
            wid = f"r{r}rec{attempt}"
            cfg = {"id": wid, "seed": rng.getrandbits(62), "role": "recover", "store": self.loc.spec(),
                   "journal": os.path.join(self.run_dir, "journal", f"{wid}.jsonl"),
                   "faults": {"slow": {"ref-write": 0.01} if kill else {}, "kill_at": kill}}
            p = self._spawn(cfg)
            try:
                p.wait(300)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                bad.append(f"I5 recover {wid} did not finish in 300 s")
                return bad
            if p.returncode == -signal.SIGKILL:
                continue
            if p.returncode != 0:
                with open(os.path.join(self.run_dir, f"{wid}.err"), errors="replace") as f:
                    bad.append(f"I5 recover {wid} exited {p.returncode}: {f.read()[-1500:]}")
                return bad
            break
        with self._open() as s:
            bad += check.check_recovered(s)
            before = check.snapshot_of_table(s)
        with self._open(create_refs=True) as s:
            out = self._driver_op("recover", {"second": True}, lambda: {
                k: v for k, v in s.recover().to_json().items() if k in ("refs_restored", "tags_restored",
                                                                        "catalog_rows_added")})
            after = check.snapshot_of_table(s)
        if out["result"] != "ok":
            bad.append(f"I5 second recover failed: {out}")
        elif before != after or out["refs_restored"] or out["tags_restored"] or out["catalog_rows_added"]:
            diff = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
            bad.append(f"I5 a second recover changed things: report {out}; differences {json.dumps(diff)[:1500]}")
        # Retention rules live only in the ref table: the operator sets them again.
        last = {}
        for o in check.load_ops(self.run_dir):
            if o.op == "retention":
                last[o.args["job"]] = {k: o.args[k] for k in ("keep_last", "keep_best", "metric") if o.args.get(k)}
        with self._open() as s:
            for job, rule in sorted(last.items()):
                self._driver_op("retention", dict(rule, job=job, keep_last=rule.get("keep_last")),
                                lambda: s.set_retention(job, tsck.Retention(**rule) if rule else None))
        return bad

    # -- recover beside the workers (flavor recover-live) -------------------------------
    def _live_recover_start(self, rng: random.Random, fl: dict, r: int) -> dict:
        """Lose the ref table and start `recover` before the workers: they open the table
        it creates, and run gc, prune and puts while it rebuilds. It is killed -9 at a
        random moment (by the driver, or at a random ref-table write of its own) and run
        again, up to live_attempts times (the last is never killed by the driver)."""
        with self._open() as s:
            store_id = s.config["id"]
        self.barriers.append(time.time())
        self._driver_op("delete_refs", {"live": True}, lambda: self.loc.delete_ref_table(store_id))
        live = {"r": r, "n": 0, "attempts": fl.get("live_attempts", 3), "kill_p": fl.get("live_kill", 0.8),
                "proc": None, "kill_at": None, "next_at": 0.0, "killed": 0}
        self._live_recover_spawn(live, rng)
        # The workers open the table recover creates (only recover may create one): its
        # journal's first record is written once the store is open.
        until = time.time() + 120
        while not self._journal_started(live["cfg"]["journal"]) and live["proc"].poll() is None \
                and time.time() < until:
            time.sleep(0.02)
        # The rules are lost with the table: set high, prune runs but expires nothing a check could miss.
        with self._open() as s:
            for job in JOBS:
                self._driver_op("retention", {"job": job, "keep_last": 1000},
                                lambda: s.set_retention(job, tsck.Retention(keep_last=1000)))
        return live

    def _killed_raced(self, ids, kill: str = "ref-written-after-a-lost-race") -> int:
        """Writers of the round killed by kill_raced (their journals say so), or by
        another planned kill (`kill`: "after-rollback", as its rollback returned)."""
        n = 0
        for wid in ids:
            try:
                with open(os.path.join(self.run_dir, "journal", f"{wid}.jsonl")) as f:
                    n += sum(1 for line in f if f'"{kill}"' in line)
            except OSError:
                pass
        return n

    @staticmethod
    def _journal_started(path: str) -> bool:
        try:
            return os.path.getsize(path) > 0
        except OSError:
            return False

    def _live_recover_spawn(self, live: dict, rng: random.Random) -> None:
        k = live["n"]
        last = k + 1 >= live["attempts"]
        auto = not last and rng.random() < 0.3
        wid = f"r{live['r']}live{k}"
        cfg = {"id": wid, "seed": rng.getrandbits(62), "role": "recover", "store": self.loc.spec(),
               "journal": os.path.join(self.run_dir, "journal", f"{wid}.jsonl"), "wait": 120,
               # slow reads of commits and slow table writes: a rebuild that lasts while workers run
               "faults": {"slow": {"commits/": 0.05, "ref-write": 0.02}, "kill_at": "auto" if auto else None}}
        live.update(n=k + 1, cfg=cfg, proc=self._spawn(cfg),
                    kill_at=None if last or rng.random() >= live["kill_p"]
                    else time.time() + rng.uniform(0.05, self.round_seconds / 2))

    def _live_recover_tick(self, live: dict, rng: random.Random, now: float) -> None:
        p = live["proc"]
        if p.poll() is None:
            if live["kill_at"] is not None and now >= live["kill_at"]:
                p.send_signal(signal.SIGKILL)
                live["killed"] += 1
                live["kill_at"] = None
            return
        if p.returncode == -signal.SIGKILL and live["n"] < live["attempts"]:
            if not live["next_at"]:
                live["next_at"] = now + rng.uniform(0.0, 1.0)  # the operator notices, starts it again
            elif now >= live["next_at"]:
                live["next_at"] = 0.0
                self._live_recover_spawn(live, rng)

    def _live_recover_finish(self, live: dict, r: int) -> list[str]:
        """After the workers: the live recover ends (or was killed for good); a last one
        finishes the rebuild; a second changes nothing (I5). I6 is not judged: writers
        moved refs during the rebuild, and their view wins over storage's newest commit."""
        bad = []
        p = live["proc"]
        try:
            p.wait(300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return [f"I5 recover {live['cfg']['id']} beside the workers did not finish in 300 s"]
        if p.returncode not in (0, -signal.SIGKILL):
            with open(os.path.join(self.run_dir, f"{live['cfg']['id']}.err"), errors="replace") as f:
                bad.append(f"I5 recover {live['cfg']['id']} exited {p.returncode}: {f.read()[-1500:]}")
        with self._open() as s:
            # A worker killed in a gc left its lock (taken over at once, its process being gone);
            # one still alive would be waited out, as the live recovers do, not refused (GcBusy).
            out = self._driver_op("recover", {"after_live": True}, lambda: {
                k: v for k, v in s.recover(wait=300).to_json().items()
                if k in ("refs_restored", "catalog_rows_added")})
            before = check.snapshot_of_table(s)
            again = self._driver_op("recover", {"second": True}, lambda: {
                k: v for k, v in s.recover().to_json().items() if k in ("refs_restored", "tags_restored",
                                                                        "catalog_rows_added")})
            after = check.snapshot_of_table(s)
        if out["result"] != "ok" or again["result"] != "ok":
            bad.append(f"I5 recover after the workers failed: {out} / {again}")
        elif before != after or again["refs_restored"] or again["tags_restored"] or again["catalog_rows_added"]:
            diff = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
            bad.append(f"I5 a second recover changed things: report {again}; differences {json.dumps(diff)[:1500]}")
        self.log(f"  live recover: {live['n']} run(s), {live['killed']} killed by the driver")
        return bad

    def _repair_planted(self) -> None:
        """A block damaged for a collective restore whose worker was killed before it put
        the block back (rollback.py): put back now, before anything is judged."""
        left = rollback.left_damage(self.run_dir)
        if left:
            with self._open() as s:
                storage = s.assets.storage
                self._driver_op("repair", {"keys": [rec["key"] for rec in left]},
                                lambda: {"done": [rollback.repair(storage, rec) for rec in left]})

    def _settle_and_check(self, rng: random.Random, fl: dict) -> list[str]:
        bad = []
        with self._open() as s:
            st = s.reftable.gc_state()
            if st["phase"] != "idle" or rng.random() < fl["quiet_gc"]:
                # A gc killed mid-way left the lock; every worker has stopped, on this host, so
                # its holder is known dead and the next gc takes it over at once (docs/design/
                # gc.md, "A holder known dead"), without waiting for its lease.
                if st["phase"] != "idle" and (st.get("lease_left") or not st.get("holder_gone")):
                    bad.append(f"I2 the gc lock of stopped worker {st.get('owner')} was not taken over at once "
                               f"(holder_gone={st.get('holder_gone')}, lease_left={st.get('lease_left')}; "
                               f"its process: {_proc_text((st.get('proc') or {}).get('pid'))})")
                    time.sleep((st.get("lease_left") or 0.0) + 0.1)  # the rest of the round is still judged
                out = self._driver_op("gc", {"quiescent": True, "took_over": st["phase"] != "idle"}, lambda: {
                    "expired": s.gc(lease=max(leases_for(self.backend))).expired})
                if out["result"] != "ok":
                    bad.append(f"I2 a gc on the quiescent store failed: {out}")
            if rng.random() < fl.get("recover_live_p", 0.0):
                # recover over the live table (an operator unsure what was lost): it must not
                # bring back a deleted ref, a forgotten snapshot or an untagged tag (I7)
                out = self._driver_op("recover", {"live": True}, lambda: {
                    k: v for k, v in s.recover().to_json().items() if k in ("refs_restored", "tags_restored")})
                if out["result"] != "ok":
                    bad.append(f"I5 recover over the live table failed: {out}")
            ops = check.load_ops(self.run_dir)
            bad += check.check_removed(s, ops, self.barriers)
            bad += check.check_readable(s)
            bad += check.check_fsck(s, "quiescent")
            bad += check.check_history(s, ops, self.barriers)
            bad += check.check_failures(s, ops)
            bad += rollback.check_rollbacks(s, ops, self.barriers)  # R1
            bad += rollback.check_restores(ops)  # R2
            bad += rollback.check_stagefails(ops)  # R3
            bad += preempt.check_preempts(ops)  # P1
            tiers = {n: p for n, p in {**self.tiers, **self.rank_tiers}.items() if os.path.isdir(p)}
            tb, stats = check.check_tiers(s, tiers, ops)
            bad += tb
            bad += tierops.check_tier_ops(tiers, ops, self.barriers)  # T20-T22
            bad += tierops.check_undeleted(s, ops, self.barriers)
            self._tier_puts, self._tier_durable, self._budget_over = stats["puts"], stats["durable"], stats["budget_over"]
            self._retire_rotted(ops)
        return bad

    def _retire_rotted(self, ops: list) -> None:
        """A tier whose disk a writer damaged (op "rot") is replaced after its round's
        checks by a fresh one under a new name, as a node's disk is: its uploader would
        stop on the damage at every open, and its puts' names stay its own for T4."""
        for o in ops:
            name = o.args.get("tier")
            if o.op == "rot" and o.ok and o.out.get("key") and name in self.tiers:
                fresh = f"{name.split('g')[0]}g{len(self.tiers) + len(ops)}"
                del self.tiers[name]
                self.tiers[fresh] = os.path.join(self.run_dir, "tiers", fresh)

    # -- the run ------------------------------------------------------------------------
    def replay_command(self, rounds: int) -> str:
        cmd = f"python -m tests.sim --backend {self.backend} --seed {self.seed} --rounds {rounds}"
        if self.focus:
            cmd += f" --focus {self.focus}"
        if not self.stale_skew:
            cmd += " --no-stale-skew"
        if self.round_seconds != 5.0:
            cmd += f" --round-seconds {self.round_seconds}"
        return cmd

    def run(self, stop_at: float | None = None) -> int:
        self.log(f"HARNESS seed={self.seed} backend={self.backend} rounds={self.rounds} "
                 f"focus={self.focus or 'mix'} stale_skew={'on' if self.stale_skew else 'off'} "
                 f"package={os.path.dirname(tsck.__file__)} dir={self.run_dir}")
        t0 = time.time()
        try:
            self._create_racing(random.Random(f"{self.seed}:create").randint(2, 6))
            for r in range(self.rounds):
                if stop_at is not None and time.time() > stop_at:
                    break
                bad = self.round(r)
                if bad:
                    self._report(bad, r)
                    return 1
            self.log(f"HARNESS seed={self.seed} backend={self.backend}: {r + 1} rounds OK "
                     f"in {time.time() - t0:.0f}s")
            return 0
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
                if (left := _reap(p)) is not None:
                    self.log(left)
            self.net.close()
            self.loc.close()
            if not self.keep and "bad" in locals() and not bad:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _create_racing(self, k: int) -> None:
        """Create the store as a job's ranks do: k opens at once, on a location (and, on pg
        and s3, a database) that holds nothing yet. Every open must succeed and all must
        agree on one store."""
        def one():
            with tsck.open_store(self.loc.url, refs=self.loc.spec()["refs"], block_size=content.BLOCK_SIZE,
                                 storage_options=self.loc.storage_options,
                                 inline_threshold=content.INLINE_THRESHOLD) as s:
                return s.config["id"]

        ids, errs = at_once(k, one)
        if errs or len(set(ids)) != 1:
            raise SystemExit(f"HARNESS FAILED seed={self.seed}: {k} opens creating the store at once: "
                             f"errors {errs}, store ids {sorted(set(ids))}")
        self.log(f"store created by {k} opens at once")

    def _report(self, bad: list[str], r: int) -> None:
        self.log(f"HARNESS FAILED seed={self.seed} backend={self.backend} round={r}: {len(bad)} violation(s)")
        for b in bad[:25]:
            self.log("  VIOLATION " + b)
        ops = check.load_ops(self.run_dir)
        named = set(re.findall(r"\b[0-9a-f]{16}", " ".join(bad)))
        involved = [o for o in ops if any(h in json.dumps([o.args, o.out]) for h in named)]
        if involved:
            self.log("  journal events naming the snapshots above:")
            for o in involved[-25:]:
                self.log("    " + o.brief())
        self.log("  journal tail (newest last):")
        for o in ops[-25:]:
            self.log("    " + o.brief())
        for name in sorted(os.listdir(self.run_dir)):
            if name.startswith(f"r{r}w") and name.endswith(".err"):  # stacks of a worker killed as stuck
                with open(os.path.join(self.run_dir, name), errors="replace") as f:
                    text = f.read()
                m = re.search(r"^(Current thread|Thread) 0x", text, re.M)
                if m:
                    at = m.start()
                    self.log(f"  {name[:-4]}'s threads when it was killed as stuck:")
                    for line in text[at:].splitlines()[:120]:
                        self.log("    " + line)
        self.log(f"  journals and worker logs kept in {self.run_dir}")
        self.log(f"  replay: {self.replay_command(r + 1)}")
