"""The collective put, as one sequence of rounds (PutCall.run reads them top-down):

    hello     every rank: its arguments and plan checked, posts (step, ref, job,
              expected, the digest of its layout)
    agree     rank 0: the hellos agree; the layouts it does not hold are asked for and
              the tiling checked (layout.py); the gc fence read -> need / go
    start     the other ranks: wait for rank 0's fence (sending their pieces if asked)
    write     every rank: its blocks (a replicated block by its one owner), its
              manifest sub-tree, synced -> done
    compose   rank 0: the replicas agree; the rank tree and chunk index -> the top
    claim     rank 0: the outcome "commit" claimed (no other rank may abort after this)
    publish   rank 0: Publisher.commit, the heartbeat beating; a fenced move runs a
              re-validation round on every rank, then moves again
    announce  rank 0: the result posted (through tiers: the commit, the top node and each
              16 ranks' path down the rank tree too)
    follow    the other ranks: wait for the result, serving re-validation rounds;
              a silent rank 0 is asked of the ref table

Each round talks through the call's Channel and writes through the Publisher; the
channel's guard() turns any failure into an abort of the call on every rank."""

from __future__ import annotations

import hashlib
import time
import warnings

import msgpack

from ..core.validate import UNSET
from ..errors import InvalidArgument, OutcomeUnknown, SnapshotAborted, TsckError
from ..util.ids import Digest
from .channel import (WOKEN, Channel, CommitUnderWay, Heartbeat, RevalFailed, guard, open_channel, outcome_round,
                      result_key)
from .job import CollectiveJob
from .layout import Layouts, Pieces, job_digest, layout_digest, tiling
from .naming import ranks_named

# Clock skew tolerated when a rank looks up in the ref table whether a silent rank 0 published.
CLOCK_SKEW = 120.0
# What rank 0 writes into the outcome key the others block on to start a re-validation round.
REVAL = b"\x00reval"
# A rank's stats in its done, in this order (publish.BuildStats; rank 0 adds them up).
STATS = ("bytes_total", "blocks_total", "bytes_new", "blocks_new", "stored_new")


def collective_put(job: CollectiveJob):
    """One snapshot of every rank's state (job.plan), published once by rank 0 through
    job.publisher. job.prepare() -> SnapshotArgs checks the arguments (on every rank,
    inside the collective)."""
    return run_put(begin_put(job), job)


def begin_put(job: CollectiveJob) -> Channel:
    """Name the next collective put of this process (on the caller's thread: the names
    follow the order of the calls, the same on every rank) without talking to anyone
    yet; run_put(channel, job) makes it, later and on any thread. An asynchronous put
    stages its state between the two."""
    return open_channel(job.calls, job.group, "put", job.timeout, job.kv, job.ident)


def run_put(ch: Channel, job: CollectiveJob):
    """The collective put named by ch: job.prepare() -> SnapshotArgs and job.plan() ->
    Plan run inside it (a failure of either aborts it on every rank). The deadline counts
    from here, not from begin_put: a staged put may wait behind earlier ones."""
    ch.restart()
    ch.post_at()
    ch.cleanup_old()

    def body():
        ch.check_entry()
        return PutCall(ch, job).run()
    return outcome_round(ch, body, f"collective put_snapshot (call {ch.pfx})")


class PutCall:
    """One collective put on this rank: the rounds, in the order run() makes them, and
    what they hand each other (the arguments, the plan, the fence, this rank's part)."""

    def __init__(self, ch: Channel, job: CollectiveJob):
        self.ch, self.job = ch, job
        self.publisher, self.tier = job.publisher, job.tier
        self.W, self.rank = ch.world, ch.rank
        self.need: list = []  # the ranks rank 0 asked for their pieces (their layout was new to it)
        # This rank's part: its fence, tree and node payloads (re-written if a gc deletion
        # phase fences the commit); on rank 0 also "top", the nodes of the top it composed.
        self.part: dict = {}
        self.rounds = 0  # re-validation rounds rank 0 asked for

    def run(self):
        ch = self.ch
        self.args = guard(ch, self.job.prepare)
        self.plan = guard(ch, self.job.plan)
        self.hello()
        self.fence = self.agree() if self.rank == 0 else guard(ch, self.start)
        guard(ch, self.write)
        if self.rank != 0:
            return self.follow()
        top, stats = guard(ch, self.compose)
        self.claim(top)
        return self.announce(self.publish(top, stats))

    def owns(self, leaf, i: int) -> bool:
        """Whether this rank writes block i of a replicated leaf (each is written by one rank)."""
        return _owner(leaf.path, i, self.W) == self.rank

    # -- before anything is written -----------------------------------------------------
    def hello(self) -> None:
        args = self.args
        expected = args.expected
        exp_hex = None if expected is UNSET else ("-" if expected is None else expected.hex())
        # Where this rank's pieces of sharded tensors lie: rank 0 checks that they tile. The
        # hello carries their digest; the pieces themselves go only if rank 0 asks ("need").
        self.pieces = msgpack.packb([[p, dt, list(gs), list(off), list(sh)]
                                     for p, dt, gs, off, sh, rep in self.plan.pieces if not rep])
        digest = layout_digest(self.pieces)
        guard(self.ch, lambda: self.ch.arrive("hello", msgpack.packb([args.step, args.ref, args.job, exp_hex, digest]),
                                              self.W))

    def agree(self) -> int:
        """Rank 0: every rank's hello agrees with its own; the layouts it does not hold are
        sent and checked (the whole tiling, once per whole-job layout); the gc fence is
        read before any rank looks at storage and posted. -> the fence."""
        ch, W = self.ch, self.W
        self.layouts = layouts = ch.ctx.layouts(ch.key, W, Layouts)

        def agree():
            hellos = [msgpack.unpackb(h) for h in ch.wait_all("hello", "arrive")]
            for r, h in enumerate(hellos):
                if h[:4] != hellos[0][:4]:
                    raise SnapshotAborted(
                        f"ranks disagree: rank 0 has (step, ref, job) = {tuple(hellos[0][:3])}, rank {r} has "
                        f"{tuple(h[:3])}")
                if not (isinstance(h[4], bytes) and len(h[4]) == 16):
                    raise SnapshotAborted(f"rank {r}'s hello carries no layout digest (another version of "
                                          "tensorstore_ck?)")
            digests = [h[4] for h in hellos]
            held, held_pieces = layouts.view()
            need = [r for r in range(1, W) if digests[r] != held[r]]
            got = {0: self.pieces}
            if need:  # those ranks send their pieces; the others wait for "go"
                ch.set("need", msgpack.packb([need, None]))
                for r, v in zip(need, ch.wait_all("pieces", "send their layout", among=need)):
                    if layout_digest(v) != digests[r]:  # never hold pieces under a digest not theirs
                        raise SnapshotAborted(f"rank {r} sent a layout that does not match its digest")
                    got[r] = v
            self.need = need
            self.pieces_by_rank = pieces_by_rank = Pieces([got[r] if r in got else held_pieces[r] for r in range(W)])
            self.job_digest = job = job_digest(digests)
            if not layouts.validated(job):  # a new layout anywhere: the whole check, as on a first snapshot
                problem = tiling(pieces_by_rank)
                if problem is not None:  # no rank's own mistake: every rank raises it as what it is
                    ch.abort(problem, "invalid_argument", shared=True)
                    raise InvalidArgument(problem)
                layouts.remember(job, digests, pieces_by_rank.packed)
            fence = self.publisher.fence()  # read before any rank looks at storage
            if need:
                ch.set("go", msgpack.packb(fence))
            else:
                ch.set("need", msgpack.packb([[], fence]))
            return fence
        try:
            return guard(ch, agree)
        except SnapshotAborted as e:
            if not ch.aborted:
                ch.abort(str(e).removeprefix("snapshot aborted: "))
            raise

    def start(self) -> int:
        """A rank other than 0: wait for rank 0's fence, sending its pieces first if rank 0
        asks for them. -> the fence."""
        ch = self.ch
        need, fence = msgpack.unpackb(ch.wait_key("need", "rank 0 to start the snapshot", per_rank="hello"))
        self.need = need
        if fence is None:  # rank 0 checks a layout it does not hold (all of it, or these ranks')
            if self.rank in need:
                ch.arrive("pieces", self.pieces, len(need))  # (the bytes its digest is over)
            fence = msgpack.unpackb(ch.wait_key("go", "rank 0 to check the layout", per_rank="pieces",
                                                among=need))
        return fence

    # -- every rank's part ----------------------------------------------------------------
    def write(self) -> None:
        """This rank's blocks and manifest sub-tree, synced; then "done" with its tree, its
        stats, what it wrote new and the digest of its Replicated tensors."""
        ch, publisher, tier, part, plan = self.ch, self.publisher, self.tier, self.part, self.plan
        # Every rank writes under rank 0's fence: what it saw present under that epoch
        # needs no request (assets.Presence); a deletion phase since fences the commit.
        # Through local tiers each rank writes to its own tier, another store with its own
        # gc epoch: under that one (rank 0's would be another table's number).
        tier.make_room()  # a tier's budget holds for collective puts too (TierFull: aborted everywhere)
        wfence = part["fence"] = tier.write_fence(self.rank, self.fence, publisher)
        if plan.pack_size and publisher.assets.parts.first_look(self.args.ref):
            publisher.learn_parts(self.args.ref, self.rank)  # (a restarted job: its stored packs named, not written)
        publisher.write_blocks(plan, owns=self.owns, fence=wfence)
        new_nodes: list = []
        tree, part["payloads"] = publisher.write_nodes(plan.value, wfence, new_nodes)
        part["tree"] = tree
        from ..write.publish import plan_stats, replica_digests
        reps = replica_digests(plan)
        rep = None
        if reps:  # the full list only for rank 0 to read if the replicas disagree; one digest in done
            ch.set_mine("rep", msgpack.packb(reps))
            rep = hashlib.blake2b(msgpack.packb(reps), digest_size=16).digest()
        publisher.sync()  # this rank's objects are durable before rank 0 publishes
        # Its sums alone (O(1) whatever it wrote): a replicated block counts on its one
        # owner, and an object two ranks wrote at once (the same weights of DDP ranks) for
        # the one that named it in the store, so rank 0's sums count each object once.
        st = plan_stats(plan, new_nodes, publisher.assets)
        if self.rank != 0:
            # (through tiers its nodes stay in its own tier, as its blocks do: each tier walks a collective
            # snapshot through its own part, walk_commit(part=), and rank 0's uploader finds
            # the others' parts in the remote: nothing of a part goes through the c10d Store)
            tier.intend(tree, self.args)  # (a rank killed from here until the outcome still uploads its part)
        ch.arrive("done", msgpack.packb({"tree": tree, "rep": rep, "stats": [getattr(st, k) for k in STATS]}),
                  self.W)

    def revalidate_mine(self, new_fence: int) -> None:
        """After a fenced move: what this rank wrote or reused exists again under the new
        fence (it still holds the data, the plan, and its nodes)."""
        new_fence = self.tier.write_fence(self.rank, new_fence, self.publisher)  # (through tiers its own tier's: see write)
        self.publisher.revalidate_plan(self.plan, self.part["payloads"], None, new_fence, owns=self.owns)
        self.part["fence"] = new_fence


    # -- rank 0: the snapshot composed, claimed, published -------------------------------
    def compose(self) -> tuple[bytes, dict]:
        """Rank 0, once every rank is done: the replicas agree; the top (the rank tree and
        the chunk index cut by offset range) written -> (its address, the stats)."""
        ch, publisher, fence, W = self.ch, self.publisher, self.fence, self.W
        dones = [msgpack.unpackb(d) for d in ch.wait_all("done", "finish writing")]
        if len({d.get("rep") for d in dones}) > 1:
            why = _replica_disagreement(ch)
            ch.abort(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")
        # The rank tree and the range-cut chunk index (format/world.py): a rank's checkout
        # reads the few nodes its own region needs, whatever W (not O(W) or O(W x N)). The
        # index depends on the layout alone: built once per checked layout, then put again.
        from ..format.manifest import encode_node
        from ..format.world import write_index, write_world

        def putter(payloads: list):
            def put(value):  # one node, laid out by format/world.py (the node writer's walk costs ~15 us a piece)
                payloads.append(encode_node(value))
                return publisher.assets.put_node(payloads[-1], fence).digest
            return put

        def chunk_index():
            payloads: list = []
            return write_index(self.pieces_by_rank, putter(payloads)), payloads
        index, ix_payloads = _chunk_index(self.layouts, self.job_digest, publisher, fence, chunk_index)
        payloads: list = []
        put = putter(payloads)
        top = put(write_world([d["tree"] for d in dones], index, put))
        self.part["top"] = ix_payloads + payloads
        # What the other ranks' tiers adopt (rank_paths): the top node and each its own path
        # down the rank tree, never the chunk index (O(W x N)), which their own region reads not.
        self.part["top_sent"] = payloads
        # The ranks' sums (write(): each new object counted by one rank); the nodes written
        # here hold no tensor bytes.
        return top, _summed(dones)

    def claim(self, top: bytes) -> None:
        """Rank 0: the point of no return. From here no other rank may declare this
        snapshot aborted (their deadlines may pass while the ref moves); only this rank
        can, if the move fails."""
        ch = self.ch
        mine = b"commit:" + top.hex().encode()
        won = guard(ch, lambda: ch.claim(mine))
        if won == b"abort":  # another rank gave up first: its abort record follows
            guard(ch, lambda: ch.wait_key("abort", "the abort record of the rank that aborted"))
            raise SnapshotAborted("snapshot aborted by another rank")  # pragma: no cover - wait_key raised
        if won != mine:  # another call's claim under this call's keys: never take it for this one's
            why = (f"rank 0: the c10d Store already holds another call's commit claim under {ch.pfx} "
                   "(a collective call named like an earlier one); nothing was published")
            ch.abort(why, force=True)
            raise SnapshotAborted(f"snapshot aborted: {why}")

    def publish(self, top: bytes, stats: dict):
        """Rank 0: the commit and the fenced move of the ref (Publisher.commit), its
        heartbeat beating meanwhile; a fenced move re-validates every rank's part
        (revalidation_round) and moves again. A failure is every rank's outcome."""
        ch, tier, timing = self.ch, self.tier, self.job.timing
        beat = Heartbeat(ch)  # the others wait for the result as long as this rank shows it is alive
        try:
            return self.publisher.commit(
                top, self.args, stats=stats, fence=self.fence, meta_extra={"world": self.W, **tier.commit_meta(self.args.ref)},
                timing=timing() if timing else None,
                part0=tier.part0(self.part["tree"]),  # (through tiers rank 0's own part, in its tier: with the move)
                revalidate=self.revalidation_round)
        except OutcomeUnknown as e:
            # The ref may have moved (or may yet): every rank must say so, never "nothing published".
            beat.stop()
            ch.abort(str(e), "outcome_unknown", force=True, shared=True,
                     extra={"root": e.root.hex() if e.root else None, "ref": e.ref})
            raise
        except Exception as e:
            beat.stop()
            why = str(e) if isinstance(e, SnapshotAborted) else f"rank 0: {type(e).__name__}: {e}"
            ch.abort(why.removeprefix("snapshot aborted: "), force=True)
            if isinstance(e, TsckError):
                raise
            raise SnapshotAborted(f"snapshot aborted: {why}") from e
        finally:
            beat.stop()  # (also on a KeyboardInterrupt: a beat that outlived the commit would keep the others waiting)

    def announce(self, info):
        """Rank 0, published: the result posted to the others (through tiers, with the commit,
        the top node and their paths down the rank tree, which they adopt into their own
        tier first). -> what this rank returns."""
        ch, tier = self.ch, self.tier
        _published(ch, self.need, tier.own_tables)
        try:  # (through tiers, before the result: the others read them once they hold the root)
            tier.post_top(ch, bytes.fromhex(info.root), self.part["top_sent"], self.W)
        except Exception as e:  # noqa: BLE001 - the ref moved: this rank's outcome is a success
            warnings.warn(f"snapshot {info.root[:16]} was published locally, but its top nodes could not be "
                          f"handed to the other ranks: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        agree = tier.agrees_after(info)  # (a tier-only snapshot's copies: agreed after the others hold the result)
        if not agree:
            info = tier.published(info, self.part["tree"], True)
            ch.ack()  # (it holds the outcome and reads nothing of the call's after: the others' acks come after)
        try:
            ch.set(result_key(ch.round), info.root.encode())
        except Exception as e:  # noqa: BLE001 - the ref moved: this rank's outcome is a success
            warnings.warn(f"snapshot {info.root[:16]} was published, but the other ranks could not be told: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        if agree:
            info = tier.published(info, self.part["tree"], True, ch)
        return info

    def revalidation_round(self, body: bytes, fence: int) -> None:
        """Rank 0, called by Publisher.commit after its ref move was fenced by a gc deletion
        phase (the phase is over and rank 0 holds a gc hold, so no new one opens): every rank
        re-validates what it wrote or reused, re-uploading from the state it still holds
        whatever the phase deleted, under the new fence; then rank 0 re-writes the top
        nodes and the commit object, and commit() moves the ref. O(1) messages per rank:
        rank 0 posts "reval" = [round, fence] and wakes the others (REVAL in the key they
        block on for the outcome); each rank posts rdone/{rank}, adds to "rdone_n" and the
        last one posts "rdone_all.<round>" (or a rank writes "rfail" and wakes rank 0, which
        aborts)."""
        ch = self.ch
        self.rounds += 1
        n, others = self.rounds, ch.world - 1
        ch.round = n  # first: an abort from here on wakes the others on the next outcome key
        ch.extra += [result_key(n), f"rdone_all.{n}"]
        ch.set("reval", msgpack.packb([n, fence]))
        ch.set(result_key(n - 1), REVAL)
        self.revalidate_mine(fence)  # rank 0's own part, while the others do theirs
        until = time.monotonic() + ch.timeout
        while others and not ch.block([f"rdone_all.{n}"], until):
            if time.monotonic() >= until:
                late = [r for r in range(1, ch.world) if not ch.kv.check([ch.pfx + f"rdone/{r}"])
                        or msgpack.unpackb(ch.get(f"rdone/{r}")) < n]
                raise SnapshotAborted(f"snapshot aborted: a gc deletion phase overlapped this snapshot and ranks "
                                      f"{late} did not re-validate their part within {ch.timeout:g}s; nothing was "
                                      "published")
        if ch.kv.check([ch.pfx + "rfail"]):
            raise SnapshotAborted(f"snapshot aborted: a gc deletion phase overlapped this snapshot and "
                                  f"{ch.get('rfail').decode(errors='replace')}; nothing was published")
        self.publisher.rewrite(self.part["top"], body)

    # -- the other ranks: the outcome -----------------------------------------------------
    def follow(self):
        """A rank other than 0, its part written: wait for the outcome (result_of), then
        through tiers adopt rank 0's top nodes, or, when no outcome came, say what is known."""
        ch, tier, part, args = self.ch, self.tier, self.part, self.args

        def info_of(root: Digest):
            tier.adopt_posted(ch, bytes(root), part["tree"])  # (through tiers: rank 0's top into this rank's first)
            return self.publisher.info(root)
        try:
            info = self.await_result(info_of)
        except SnapshotAborted as e:
            if tier.own_tables and "tree" in part:
                if not ch.aborted:
                    # No abort was won or read here, only inferred (rank 0 silent after its
                    # commit claim, or the c10d Store gone, which often lives in rank 0's
                    # process). Rank 0 publishes in its own tier, which this rank cannot ask:
                    # it may have published, and its uploader would wait for this part.
                    raise OutcomeUnknown(
                        f"rank {self.rank}: rank 0 did not tell this rank the outcome of its put to {args.ref!r} "
                        f"({e}); through local tiers this rank cannot ask rank 0's tier whether it published. This "
                        "rank's part stays queued for upload (the next open of its tier sends it); look at rank "
                        f"0's tier (store.log({args.ref!r})) before taking the snapshot again", ref=args.ref) from e
                tier.abandon(part["tree"])
            raise
        self.publisher.assets.presence.settle(part.get("fence", self.fence))  # published: what this rank wrote is there
        _published(ch, self.need, tier.own_tables)
        return tier.published(info, part["tree"], False, ch)

    def serve_revalidation(self, done: int) -> int:
        """A rank other than 0, woken by REVAL while waiting for the outcome: do the round
        rank 0 asked for and say so. -> the last round done. A failure is written to "rfail"
        (rank 0 then aborts, and cannot have moved the ref: it waits for every rank) and
        raised as RevalFailed(the error this rank raises)."""
        ch = self.ch
        n, fence = msgpack.unpackb(ch.get("reval"))
        if n <= done:
            return done
        try:
            self.revalidate_mine(fence)
        except Exception as e:  # noqa: BLE001 - every failure must reach rank 0
            why = f"rank {ch.rank} could not re-validate its part: {type(e).__name__}: {e}"
            try:
                ch.kv.compare_set(ch.pfx + "rfail", b"", why[:4000].encode())
                ch.kv.set(ch.pfx + f"rdone_all.{n}", b"rfail")  # wakes rank 0 (a compare_set would not)
            except Exception:  # noqa: BLE001 - the store is gone: rank 0 times out instead
                pass
            own = e if isinstance(e, TsckError) else SnapshotAborted(f"snapshot aborted: {why}")
            raise RevalFailed(own) from e
        ch.set_mine("rdone", msgpack.packb(n))
        if ch.add("rdone_n") == n * (ch.world - 1):
            ch.set(f"rdone_all.{n}", b"1")
        return n

    def await_result(self, info_of):
        """Block on the outcome, re-validating this rank's part whenever rank 0 asks (a gc
        deletion phase fenced the move). Once rank 0 has claimed "commit", this rank's
        deadline no longer aborts: it waits for the result as long as rank 0's heartbeat
        moves; if it stops for `timeout` (rank 0 dead or stopped) or the Store goes away,
        it asks the ref table whether the ref moved to the snapshot (through tiers its own
        tier's, which cannot know: follow() says OutcomeUnknown then)."""
        ch = self.ch
        done = [0]  # re-validation rounds done: the outcome's key is result_key(done[0])

        def outcome(v: bytes):
            """-> the root posted, or None: a re-validation round served (then wait on the next key)."""
            if v == REVAL:
                n = self.serve_revalidation(done[0])
                if n > done[0]:
                    done[0] = ch.round = n
                    ch.extra += [result_key(n), f"rdone_all.{n}"]
                return None
            return v

        try:
            try:
                while True:
                    root = outcome(guard(ch, lambda: ch.wait_key(result_key(done[0]), "rank 0 to publish",
                                                                 per_rank="done")))
                    if root is not None:
                        return info_of(Digest.parse(root.decode()))
            except CommitUnderWay:
                pass
            return self.await_result_alive(done, outcome, info_of)
        except RevalFailed as e:
            raise e.args[0] from e.__cause__

    def await_result_alive(self, done: list, outcome, info_of):
        """await_result, past this rank's deadline once rank 0 claimed "commit": as long as
        rank 0's heartbeat moves; then the ref table says whether the ref moved."""
        ch, args = self.ch, self.args
        try:
            last, seen = None, time.monotonic()
            while True:
                # One slice of blocking, then one look at rank 0's heartbeat: two requests per slice.
                key = result_key(done[0])
                if ch.block([key], time.monotonic() + ch.slice):
                    v = ch.get(key)
                    if v == WOKEN:  # rank 0's own commit failed: it wrote the abort record
                        ch.check_abort()
                    root = outcome(v)
                    if root is not None:
                        return info_of(Digest.parse(root.decode()))
                    continue
                beat, now = ch.add("beat", 0), time.monotonic()
                if beat != last:
                    last, seen = beat, now
                elif now - seen > ch.timeout:
                    break
        except (SnapshotAborted, OutcomeUnknown, RevalFailed):
            raise
        except Exception:  # noqa: BLE001 - the store went away
            pass
        decided = b""
        try:
            decided = ch.kv.get(ch.pfx + "decided")
        except Exception:  # noqa: BLE001
            pass
        top = bytes.fromhex(decided.decode()[len("commit:"):]) if decided.startswith(b"commit:") else None
        info = None if top is None else self.publisher.find_published(args.ref, top, ch.t_start - CLOCK_SKEW)
        if info is not None:
            return info
        raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: rank 0 began publishing, then showed no sign of "
                              f"life for {ch.timeout:g}s (dead or stopped), and {args.ref!r} has not moved to the "
                              "snapshot")


def _summed(dones: list) -> dict:
    """Rank 0: the stats of the ranks' parts (each done's STATS), added up; a rank's
    values are checked (they come from a c10d Store)."""
    out = dict.fromkeys(STATS, 0)
    for r, d in enumerate(dones):
        v = d.get("stats")
        if not (isinstance(v, list) and len(v) == len(STATS) and all(type(x) is int and x >= 0 for x in v)):
            raise SnapshotAborted(f"snapshot aborted: rank {r} sent undecodable stats (another version of "
                                  "tensorstore_ck?)")
        for k, x in zip(STATS, v):
            out[k] += x
    return out


def _owner(path: str, i: int, world: int) -> int:
    h = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little")
    return (h + i) % world


def _replica_disagreement(ch: Channel) -> str:
    """Rank 0, when the ranks' replica digests differ: which Replicated tensors differ
    between which ranks (each rank's manifest would name its own replica's blocks,
    but each block is written by one rank only: the snapshot would be broken)."""
    per_rank = []
    for r in range(ch.world):
        try:
            per_rank.append(dict(msgpack.unpackb(ch.get(f"rep/{r}"))) if ch.kv.check([ch.pfx + f"rep/{r}"]) else {})
        except Exception:  # noqa: BLE001
            per_rank.append({})
    paths = list(dict.fromkeys(p for d in per_rank for p in d))
    found = []
    for p in paths:
        groups: dict = {}
        for r, d in enumerate(per_rank):
            groups.setdefault(d.get(p), []).append(r)
        if len(groups) == 1:
            continue
        missing = groups.pop(None, [])
        ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs))
        parts = []
        if len(ordered) > 1:
            odd = [r for rs in ordered[1:] for r in rs]
            parts.append(f"{ranks_named(odd)} {'disagrees' if len(odd) == 1 else 'disagree'} with "
                         f"{ranks_named(ordered[0])}")
        if missing:
            parts.append(f"{ranks_named(missing)} {'does' if len(missing) == 1 else 'do'} not hold it as Replicated")
        found.append(f"the Replicated tensor at {p} differs between ranks: {'; '.join(parts)}")
        if len(found) == 3:
            break
    if not found:
        found = ["the ranks' Replicated tensors differ"]
    return ("; ".join(found) + " (a Replicated tensor must be identical on every rank; nothing was published)")


def _published(ch: Channel, need: list, tier: bool = False) -> None:
    """Published, so nobody aborted (the claim): the call's shared keys are these (the last
    rank to ack deletes them)."""
    ch.used = ["hello_n", "hello_all", "need", "done_n", "done_all", "decided", "result", "beat", "acked",
               "ack_all"] + (["reval", "rdone_n"] if ch.round else []) + (["pieces_n", "pieces_all", "go"] if need
                                                                          else []) + (["tier"] if tier else [])


def rank_paths(payloads: list, W: int) -> dict:
    """Rank 0, through tiers: {g: the path down the rank tree of ranks g*FAN..(g+1)*FAN-1}
    (they share their leaf node, so their path), for every group with a rank but 0: the
    encoded nodes (msgpack list, root first) those ranks need above their own trees, of
    `payloads` (the rank tree's nodes, then the top node, as gather wrote them). A rank
    reads only its own group's (ceil(log_FAN W) nodes, not the O(W) tree); rank 0 posts
    W/FAN of them."""
    from ..core.assets import Assets
    from ..format import tree
    from ..format.manifest import decode_node
    from ..format.world import rank_path
    by_digest = {Assets.node_address(p): p for p in payloads}
    decoded: dict = {}

    def read(d):
        if d not in decoded:
            decoded[d] = tree.decode_node_value(decode_node(by_digest[d]))
        return decoded[d]
    w = tree.decode_node_value(decode_node(payloads[-1]), world=True)
    fan = w.fan  # (format.world.FAN, which the others group by: write_world wrote it)
    return {g: msgpack.packb([by_digest[d] for d in rank_path(w, max(1, g * fan), read)])
            for g in range(-(-W // fan)) if W > 1}


def _chunk_index(layouts: Layouts, job: bytes, publisher, fence: int, build):
    """The chunk index of a whole-job layout: built (O(W x N)) once per layout, then the
    same nodes again, put under this snapshot's fence (a deletion phase may have removed
    them: put_node checks, as for any node). -> (its address, its payloads)."""
    got = layouts.index(job)
    if got is None:
        got = build()
        layouts.set_index(job, got)
        return got
    for payload in got[1]:
        publisher.assets.put_node(payload, fence)
    return got
