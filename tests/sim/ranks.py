"""The ranks of a harness worker's collective puts: real processes in one gloo process
group, each with its own Store on the harness's store, started by the worker when its
flavor has collective puts and kept for the round.

    python -m tests.sim.ranks WORKER_CONFIG.json RANK WORLD PORT

Protocol (lines of JSON): the rank prints {"ready": true} once the group is up, then per
line read on stdin {"ref", "step", "spec", "expected"?} it runs the collective
put_snapshot of content.rank_state(spec, rank, world), then checks out its own rows of
"own" collectively (into= a Sharded: through the chunk index rank 0 wrote at commit), and
and base and var (the same on every rank: with shared reads, in about half the rounds,
each of their blocks is read by its owner rank and sent to the others), and
prints {"root", "time", "job", "fenced", "mismatch"?} or {"result": <error type>, "error"}.
It dies with its worker (PDEATHSIG): a worker killed -9 mid-put leaves the outcome
unknown, as for any put.

In about half the rounds (seeded, the same on both ranks) each call goes through a Store
opened for it and closed after it, as a script that opens the store per snapshot does: the
collective calls' names in the c10d Store must not depend on the Store object.

Half the calls (the worker's seeded choice, journaled as blocking=False) are asynchronous:
the rank scribbles over its state as soon as its future returns, then waits for it.
A line {"restore": true, "ref"} is a collective restore instead: restore_latest() of a
CheckpointManager on the ref, into this rank's rows (rollback.rank_restore), printing the
step and note it read (or the error), which the worker judges (R2). A line {"stagefail": {...}}
is two step() calls of an asynchronous CheckpointManager, one rank's state failing in the
first (rollback.rank_stagefail, R3). A line {"preempt": {...}} is a run of step() calls of
an asynchronous CheckpointManager in which one rank or both send themselves SIGTERM at a
seeded moment (preempt.rank_preempt, P1).
A call may name a rank that skips it ({"skip": RANK}: it prints nothing and goes on to the
next line at once, as a rank whose own policy decided otherwise), and may
be made without a step ({"nostep": true}: every rank must refuse it).

A rank other than 0 whose store is through a tier checks T17 itself before each close of
its Store: once wait_durable() says nothing is left (no upload queued, no word of rank 0
unapplied), its tier holds no part of a job's snapshot that the last word it heard from
rank 0 (Uploader.follow) leaves out, unless the cleanup said it failed; a finding goes to
TIER-follow.json beside the tier, which check.check_tiers reads. In half the rounds
(seeded) the cleanup runs after every upload (uploader.TIDY_EVERY = 1) and each upload
waits 0.3 s first, so that parts of the rank are still queued when it runs.

Faults: the worker's profile without its kill points (a rank's death would only be
reported by the worker killing itself, see Worker.op_cput): delays, slow keys and
injected storage failures (a failed rank aborts the collective put on every rank).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import sys

import torch

from tensorstore_ck.tier.collective import KEEP_PREFIX

from . import content
from .faults import Faults
from .preempt import rank_preempt
from .rollback import rank_restore, rank_stagefail
from .worker import FENCES, _die_with_parent, _err, open_store, tier_bytes


def _scribble(x) -> None:
    """Overwrite every tensor of a rank's state in place."""
    import tensorstore_ck as tsck
    if isinstance(x, dict):
        for v in x.values():
            _scribble(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _scribble(v)
    elif isinstance(x, tsck.Replicated):
        _scribble(x.tensor)
    elif isinstance(x, tsck.Sharded):
        _scribble(x.local)
    elif isinstance(x, torch.Tensor):
        x.fill_(-7)


def _tier_prune(s, job: str, rng: random.Random) -> str:
    """Rank 0's tier pruned by a rule of its own (the tier's table only: the remote's rules
    are the harness's retention ops), as a CheckpointManager's prune after a snapshot; the
    other rank's tier then follows it."""
    import tensorstore_ck as tsck
    from tensorstore_ck.maintain.gc import prune_job
    s.core.refs.retention_set(job, tsck.Retention(keep_last=rng.randint(1, 3)).to_dict())
    try:
        return f"expired {len(prune_job(s.core, job).expired)}"
    except tsck.GcBusy:
        return "busy"


class _Follow:
    """T17 (module docstring): the last word of rank 0 this process heard per job, and
    whether a cleanup failed (then the word may be lost: no finding)."""

    def __init__(self, tier: str):
        import logging

        from tensorstore_ck.tier import uploader
        self.path, self.words, self.failed = tier.rstrip("/") + "-follow.json", {}, False
        follow = uploader.Uploader.follow
        me = self

        def recording(up, job, keep):
            me.words[job] = {bytes(r) for r in keep}
            return follow(up, job, keep)
        uploader.Uploader.follow = recording

        class Failed(logging.Handler):
            def emit(self, record):
                if "could not drop this rank's old parts" in record.getMessage():
                    me.failed = True
        logging.getLogger("tensorstore_ck").addHandler(Failed(logging.WARNING))

    def check(self, s) -> None:
        """Before `s` closes: the finding, if any, appended to self.path."""
        if not self.words or self.failed or s.closed:
            return
        try:
            if not s.wait_durable(timeout=20):
                return
            refs = s._tier.core.refs
            bad = []
            for root in refs.tier_rows.parts(rank0=False):
                job = (refs.catalog_get(root, checked=False) or {}).get("job")
                if job in self.words and root[:KEEP_PREFIX] not in self.words[job]:  # (the word's prefixes)
                    bad.append(f"T17 tier {os.path.basename(self.path)[:-12]} keeps its part of {root.hex()[:16]} "
                               f"(job {job}), which rank 0's last word left out, with nothing left queued")
        except Exception:  # noqa: BLE001 - the close reports a store that fails
            return
        if bad:
            with open(self.path, "a") as f:
                f.write(json.dumps(bad) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent()
    with open(path) as f:
        cfg = json.load(f)
    import tensorstore_ck as tsck
    import torch.distributed as dist
    torch.set_num_threads(1)
    kv = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=kv, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    profile = {k: v for k, v in (cfg.get("faults") or {}).items() if not k.startswith("kill")}
    faults = Faults(profile, cfg["seed"] * 31 + rank)
    per_call = random.Random(cfg["seed"] * 7 + 3).random() < 0.5  # the config's seed: the same on every rank
    kw = {}
    if cfg.get("rank_tiers"):  # each rank through its own local tier (docs/design/tiers.md, "Collective puts")
        cfg = dict(cfg, tier=cfg["rank_tiers"][rank])
        if random.Random(cfg["seed"] * 7 + 5).random() < 0.5:
            kw["replicas"] = 1
        if cfg.get("rank_budget"):  # every rank's tier under a budget: a put waits for room (T13)
            kw["local_budget"] = int(cfg["rank_budget"])
    if not cfg.get("rank_tiers") and not cfg.get("tier"):
        # Shared reads (collective/shared.py) in about half the rounds; each rank's own choice,
        # of which rank 0's decides for all: its checkouts get base and var (the same on every
        # rank) from their owners, through the faults' delays and failures.
        kw["shared_reads"] = random.Random(cfg["seed"] * 7 + 17 + rank).random() < 0.5
    prunes = random.Random(cfg["seed"] * 7 + 11 + rank)
    follow = None
    import time

    from tensorstore_ck.tier import uploader
    lag = 0.0
    if cfg.get("rank_tiers") and rank > 0:
        follow = _Follow(cfg["tier"])
        if random.Random(cfg["seed"] * 7 + 13).random() < 0.5:
            uploader.TIDY_EVERY = 1
            lag = 0.3  # a backlog of this rank's parts for the cleanup to meet
    if cfg.get("rank_budget"):
        lag = 1.0  # a backlog of parts, slower than the puts, for the budget to meet (T13)
    if lag:
        upload = uploader.Uploader._upload

        def lagging(up, seq, entry):
            time.sleep(lag)
            return upload(up, seq, entry)
        uploader.Uploader._upload = lagging
    s = open_store(cfg, faults, **kw)
    faults.gc_busy = lambda phases: s.reftable.gc_state()["phase"] in phases  # the Store of the moment
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if per_call and s.closed:
            s = open_store(cfg, faults, **kw)
        cmd = json.loads(line)
        if cmd.get("restore") or cmd.get("stagefail") or cmd.get("preempt"):  # a CheckpointManager's (R2, R3, P1)
            run = rank_preempt if cmd.get("preempt") else rank_stagefail if cmd.get("stagefail") else rank_restore
            out = run(s, cmd, rank, world)
            if per_call:
                if follow is not None:
                    follow.check(s)
                s.close()
            print(json.dumps(out), flush=True)
            continue
        if cmd.get("skip") == rank:  # this rank skips this call (as a rank whose policy decided alone)
            continue  # (silently: the worker reads one line per call it makes)
        spec = cmd["spec"]
        pkw = {"expected": cmd["expected"]} if "expected" in cmd else {}  # (kw: the Store's own options)
        if not cmd.get("nostep"):  # (without: a put nothing names, which every rank must refuse)
            pkw["step"] = cmd["step"]
        timeout = cmd.get("timeout", 60)
        fenced0 = FENCES.n
        if cmd.get("kill0") and rank == 0:
            import tensorstore_ck.tier.collective as peers

            def die(*_a):  # published in this rank's tier; the others not told
                os.kill(os.getpid(), signal.SIGKILL)
            peers.CollectiveTier.top_blob = die
        try:
            st = content.rank_state(spec, rank, world)
            if cmd.get("async"):
                # Asynchronous: the rank gets its future once its state is staged and may
                # change its tensors at once (scribbled here): the snapshot must hold them
                # as they were at the call (check.py reads it back against the spec).
                fut = s.put_snapshot(st, ref=cmd["ref"], meta={"sim": spec}, timeout=timeout, blocking=False, **pkw)
                _scribble(st)
                info = fut.result(timeout=150)
            else:
                info = s.put_snapshot(st, ref=cmd["ref"], meta={"sim": spec}, timeout=timeout, **pkw)
            out = {"root": info.root, "time": info.time, "ref_job": info.job, "fenced": FENCES.n - fenced0}
            if cfg.get("rank_budget"):
                out["tier_bytes"] = tier_bytes(cfg["tier"])
            want, a = content.own_piece(spec, rank, world)
            whole = content.state(spec)
            into = {"own": tsck.Sharded(torch.zeros_like(want), (content.OWN_LEN,), (a,)),
                    "base": torch.zeros_like(whole["base"]), "var": torch.zeros_like(whole["var"])}
            try:
                s.checkout(info.root, into=into, timeout=60)
                if not torch.equal(into["own"].local.view(torch.int32), want.view(torch.int32)):
                    out["mismatch"] = [f"rank {rank}: its rows of own differ after a collective checkout"]
                for k in ("base", "var"):  # the same on every rank: read once, by the block's owner, when shared
                    if content.differences(into[k], whole[k], k):
                        out.setdefault("mismatch", []).append(f"rank {rank}: {k} differs after a collective "
                                                              "checkout")
                if s._sharing is not None:  # blocks this rank got from their owners, all checkouts so far
                    out["shared_got"] = s._sharing.got
            except tsck.TsckError as e:  # a gc may remove the snapshot meanwhile (another
                out["read"] = f"{type(e).__name__}: {str(e)[:200]}"  # worker moved the ref)
            except Exception as e:  # noqa: BLE001 - a raw exception in a read is a bug; the put stands
                out["mismatch"] = [f"rank {rank}: raw {type(e).__name__} in the checkout of its rows: {str(e)[:300]}"]
            if cfg.get("rank_tiers") and rank == 0 and prunes.random() < 0.35:
                out["tier_prune"] = _tier_prune(s, info.job, prunes)
        except Exception as e:  # noqa: BLE001 - reported to the worker, which journals it
            out = _err(e)
        if per_call:
            if follow is not None:
                follow.check(s)
            s.close()
        print(json.dumps(out), flush=True)
    if not s.closed:
        if follow is not None:
            follow.check(s)
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
