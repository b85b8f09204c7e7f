"""The memory tier in the harness: rounds of a job of 2 ranks a node on 2 or 3 simulated
nodes, each rank's tier in host memory (/dev/shm), replicas=1, durable_every 2 or 3,
killed at seeded moments and restarted, as a node loss does to a job, on the same nodes
or on fewer or more, numbered anew each round (as torchrun's rendezvous may).

    python -m tests.sim.memtier --seed 7 --rounds 8

A round: real gloo ranks (forked, the c10d Store hosted here), two on each of the
round's nodes (TSCK_NODE; 2 or 3 of the nodes a, b, c, or only a and b with --same-nodes,
in a seeded order: the node that is rank 0's changes), each with a CheckpointManager over
open_store(remote, memory=<the node's tier of its local rank>, replicas=1,
durable_every=N) on a file remote and an LMDB ref table. Each rank restores the newest
snapshot (restore_latest), checks its part bit for bit against the step it names (its
own part, or rank 0's for a rank past the world that put it), then takes a snapshot at
each of a few steps (blocking or not, seeded). Seeded per round, then:
  - nothing: the ranks finish (close() waits for the uploads);
  - ranks: every rank SIGKILLed at a moment of the puts (their tmpfs stays: a job's
    restart);
  - node: the ranks of one of the round's nodes SIGKILLed at a moment of the puts, then
    the others, and that node's memory erased (a lost node: a new machine of that name
    comes back, empty);
  - liar: one rank's peer server serves every block with a byte flipped (a peer that
    lies), beside any of the above.
Each rank journals (an fsynced line each) what it restored and checked, each snapshot
committed (on_commit: its step, whether it is tier-only) and each warning that a part
lacked its copy (the ranks' agreement: tier/collective.py).

Invariants, judged after each round and at the end:
  M1 every rank of a round restores the same step and its part is that step's, bit for
     bit (never a mix of steps, never bytes of another): its own part, or rank 0's for
     the ranks past the world that put it, which are the ranks from some number up;
  M2 a committed memory snapshot survives the loss of k=1 node: the step restored is at
     least the newest tier-only step committed on some rank of the previous round (no
     rank reporting a copy missing), when at most one of that round's nodes is away
     from this one (its memory lost, or the node not in the job), and no peer lies in
     this one. After a loss of
     node a, rank 0's new tier knows nothing: the snapshots the other ranks' tiers hold
     are named by their tips, and where the newest of them cannot be read whole (its
     copies were in flight), restore_latest tries the older ones they posted before the
     remote's newest.
  M3 no liar's bytes are used: the checks of M1 hold in liar rounds too;
  M4 durable snapshots never depend on memory: at the end the remote store alone passes
     a full fsck, and every snapshot it lists that is marked tier_only was named by a
     warning that its copies were missing (the ranks then uploaded it in their place).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch

PER_NODE = 2  # ranks a node
REF, JOB = "mk/main", "mk"
N = 12 * 1024  # float32 elements of a rank's part: 48 KiB, three 16 KiB blocks
BLOCK = 16 * 1024
ROUND_LIMIT = 120.0  # seconds a round may take before its ranks are killed and it is judged


def content(rank: int, step: int) -> torch.Tensor:
    """A rank's part at `step`: its first block the same at every step (what dedup
    keeps), the rest the step's own."""
    t = torch.empty(N)
    t[:N // 3] = torch.arange(N // 3, dtype=torch.float32) + 1000.0 * rank
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    t[N // 3:] = torch.randn(N - N // 3, generator=g)
    return t


class Part:
    """The rank's state: one tensor, a DCP Stateful."""

    def __init__(self):
        self.t = torch.zeros(N)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])


def _journal(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _rank(rank: int, port: int, cfg: dict) -> None:
    world = len(cfg["nodes"])
    code = 1
    jpath = os.path.join(cfg["dir"], f"r{cfg['round']}_rank{rank}.jsonl")
    try:
        os.environ["TSCK_NODE"] = cfg["nodes"][rank]
        import logging

        import torch.distributed as dist

        import tensorstore_ck as tsck
        from tensorstore_ck.tier.stream import FileBlock
        torch.set_num_threads(1)
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))

        class Missing(logging.Handler):  # the agreement's word: a part lacked its copy
            def emit(self, record):
                msg = record.getMessage()
                if "lack a copy" in msg or "agreement on their copies failed" in msg:
                    _journal(jpath, {"copyfail": msg[:120]})
        logging.getLogger("tensorstore_ck.tier.collective").addHandler(Missing(logging.WARNING))
        # The node's tier of this local rank (as memory=True names them): a renumbered
        # job's rank opens the tier the node's rank of its place had.
        local = cfg["nodes"][:rank].count(cfg["nodes"][rank])
        store = tsck.open_store(cfg["remote"], refs=cfg["refs"],
                                memory=os.path.join(cfg["shm"], f"{cfg['nodes'][rank]}.{local}"),
                                replicas=1, durable_every=cfg["durable_every"], block_size=BLOCK)
        if rank == cfg.get("liar"):
            stored = store._tier.peers._stored_block

            def lying(d):
                got = stored(d)
                if got is None:
                    return None
                if isinstance(got, FileBlock):  # (a block sent from its file: read here, to be lied about)
                    with got.f:
                        got = got.f.read(got.nbytes)
                b = bytearray(got)
                b[-1] ^= 1
                return bytes(b)
            store._tier.peers._stored_block = lying
        part = Part()
        state = tsck.TrainState(part=part)

        def committed(ev):
            _journal(jpath, {"committed": ev.step, "root": ev.root, "tier_only": bool(ev.info.meta.get("tier_only"))})
        mgr = tsck.CheckpointManager(store, job=JOB, ref=REF, state=state, every_steps=1, async_=cfg["async"],
                                     on_commit=committed, timeout=30)
        try:
            step = mgr.restore_latest() or 0
            # (a rank past the world that put the step reads rank 0's part: judged across ranks)
            whose = (None if not step else rank if torch.equal(part.t, content(rank, step))
                     else 0 if torch.equal(part.t, content(0, step)) else None)
            _journal(jpath, {"restored": step, "whose": whose,
                             "exact": whose is not None if step else bool(torch.equal(part.t, torch.zeros(N)))})
        except tsck.IntegrityError as e:
            # No kept snapshot is whole anywhere (the newest lost with a node before its
            # copies or upload, and none older): every rank says so; the job goes on from
            # the next step, as an operator would start it.
            step = cfg["next_step"] - 1
            _journal(jpath, {"restored": None, "unrestorable": str(e)[:300], "exact": True})
        open(os.path.join(cfg["dir"], f"r{cfg['round']}_started{rank}"), "w").close()
        for s in range(step + 1, step + 1 + cfg["steps"]):
            part.t.copy_(content(rank, s))
            state.step = s
            mgr.step(s)
        mgr.close()
        store.close()
        _journal(jpath, {"end": True})
        dist.barrier()  # (no rank's peer server goes while another still reads from it)
        code = 0
    except BaseException:  # noqa: BLE001 - journaled for the judge
        _journal(jpath, {"error": traceback.format_exc()[-2000:]})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _draw(seed: int, i: int, same_nodes: bool) -> dict:
    rng = random.Random(seed * 1000 + i)
    kill = rng.choice(["nothing", "ranks", "node", "node"])
    d = {"durable_every": rng.choice([2, 3]), "steps": rng.randint(2, 6), "async": rng.random() < 0.5,
         "kill": kill, "victim": rng.choice("ab"), "kill_after": rng.uniform(0.0, 0.8),
         "liar": rng.randrange(2 * PER_NODE) if rng.random() < 0.25 else None}
    if same_nodes:  # (the draws above as they were before the nodes changed: a seed's rounds replay)
        d["letters"] = ["a", "b"]
        return d
    d["letters"] = rng.sample("abc", rng.choice([2, 3]))  # the round's nodes, in rank order
    d["victim"] = rng.choice(d["letters"])
    return d


def _read(path: str) -> list:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # (a line cut short by the kill)
                pass
    return out


class Run:
    def __init__(self, seed: int, rounds: int, work: str, shm: str, same_nodes: bool = False):
        self.seed, self.rounds, self.work, self.shm = seed, rounds, work, shm
        self.same_nodes = same_nodes
        self.gen = {"a": 0, "b": 0, "c": 0}
        self.violations: list[str] = []
        self.copyfail_roots: set = set()
        self.prev: dict | None = None  # what the last round committed, and how it ended
        self.next_step = 1  # past every step a rank began
        self.summary: list[str] = []
        self.worlds: set = set()  # the world sizes the job has had (whose parts a snapshot may hold)

    def round(self, i: int) -> None:
        d = _draw(self.seed, i, self.same_nodes)
        nodes = [f"{x}{self.gen[x]}" for x in d["letters"] for _ in range(PER_NODE)]
        world = len(nodes)
        cfg = dict(d, round=i, next_step=self.next_step, dir=self.work, shm=self.shm, nodes=nodes,
                   remote=os.path.join(self.work, "remote"), refs=os.path.join(self.work, "refs.lmdb"))
        from torch.distributed import TCPStore
        port = _free_port()
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, port, cfg)) for r in range(world)]
        for p in procs:
            p.start()
        master = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
        deadline = time.monotonic() + ROUND_LIMIT
        killed = None
        if d["kill"] != "nothing":
            started = [os.path.join(self.work, f"r{i}_started{r}") for r in range(world)]
            while (not all(map(os.path.exists, started)) and time.monotonic() < deadline
                   and all(p.is_alive() for p in procs)):
                time.sleep(0.01)
            time.sleep(d["kill_after"])
            lost = f"{d['victim']}{self.gen[d['victim']]}"
            victims = range(world) if d["kill"] == "ranks" else [r for r in range(world) if nodes[r] == lost]
            for r in victims:
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGKILL)
            time.sleep(0.2)  # the others meet the loss mid-protocol, then the job is taken down
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            killed = d["kill"] if d["kill"] == "ranks" else f"node {d['victim']}"
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        del master
        if d["kill"] == "node":  # the node's memory is gone; a new machine takes its name
            for local in range(PER_NODE):
                shutil.rmtree(os.path.join(self.shm, f"{d['victim']}{self.gen[d['victim']]}.{local}"),
                              ignore_errors=True)
            self.gen[d["victim"]] += 1
        self.judge(i, d, killed, [p.exitcode for p in procs])

    def judge(self, i: int, d: dict, killed, codes: list) -> None:
        world = len(d["letters"]) * PER_NODE
        js = [_read(os.path.join(self.work, f"r{i}_rank{r}.jsonl")) for r in range(world)]
        where = f"seed {self.seed} round {i} ({d})"
        restored = [next((e for e in j if "restored" in e), None) for j in js]
        if not killed:
            for r, j in enumerate(js):
                err = next((e["error"] for e in j if "error" in e), None)
                if err is not None or codes[r] != 0:
                    self.violations.append(f"{where}: rank {r} failed without a kill: {err}")
        if all(x is not None for x in restored):
            steps = {x["restored"] or 0 for x in restored}
            if len({x["restored"] is None for x in restored}) > 1:
                self.violations.append(f"M1 {where}: some ranks restored, others found nothing whole: {restored}")
            if len(steps) != 1:
                self.violations.append(f"M1 {where}: the ranks restored different steps {sorted(steps)}")
            bad = [r for r, x in enumerate(restored) if not x["exact"]]
            if bad:
                self.violations.append(f"M1/M3 {where}: ranks {bad} restored a part that is not step "
                                       f"{restored[0]['restored']}'s bit for bit")
            whose = [x.get("whose") for x in restored]
            past = [r for r, w in enumerate(whose) if w is not None and w != r]  # (rank 0's part: past the world)
            if past and (past != list(range(past[0], world)) or past[0] not in self.worlds):
                self.violations.append(f"M1 {where}: ranks {past} restored rank 0's part, not their own: not the "
                                       f"ranks past a world the job had ({sorted(self.worlds)})")
            got = min(steps)
            # The previous round's nodes away now: its lost one's memory, those not in this job.
            away = (set(self.prev["letters"]) - set(d["letters"])) | self.prev["lost"] if self.prev else set()
            if (self.prev is not None and d["liar"] is None and len(away) <= 1
                    and got < self.prev["committed"]):
                self.violations.append(f"M2 {where}: restored step {got}, but step {self.prev['committed']} was "
                                       f"committed in memory in round {i - 1} (ended: {self.prev['killed']}; "
                                       f"nodes away now: {sorted(away) or 'none'})")
        elif not killed:
            self.violations.append(f"{where}: a rank journaled no restore")
        fails = [e for j in js for e in j if "copyfail" in e]
        commits = [e for j in js for e in j if "committed" in e]
        if fails:
            self.copyfail_roots |= {e["root"] for e in commits}  # (which snapshot a warning named: any of the round's)
        # (a durable-scheduled snapshot is safe once uploaded, which nothing here waits for)
        ok_steps = [e["committed"] for e in commits if e["tier_only"] and not fails]
        base = max([e["committed"] for e in commits] + [x["restored"] or 0 for x in restored if x] + [0])
        self.next_step = max(self.next_step, base + d["steps"] + 1)
        self.prev = {"committed": max(ok_steps) if ok_steps else 0, "killed": killed or "nothing",
                     "letters": d["letters"], "lost": {d["victim"]} if d["kill"] == "node" else set()}
        self.worlds.add(world)
        self.summary.append(f"round {i}: nodes {''.join(d['letters'])}, restored "
                            f"{restored[0]['restored'] if restored[0] else '-'}, committed up to {base}, ended "
                            f"{killed or 'cleanly'}"
                            + ("" if d["liar"] is None else f", liar {d['liar']}"))

    def finish(self) -> None:
        import tensorstore_ck as tsck
        with tsck.open_store(os.path.join(self.work, "remote"), refs=os.path.join(self.work, "refs.lmdb"),
                             create=False) as remote:
            found = [str(f) for f in remote.fsck(full=True).findings]
            if found:
                self.violations.append(f"M4 seed {self.seed}: the remote store alone fails fsck: {found[:3]}")
            for h in (remote.log(REF) if REF in remote.refs() else []):
                if h.meta.get("tier_only") and h.root not in self.copyfail_roots:
                    self.violations.append(f"M4 seed {self.seed}: the remote lists tier-only step {h.step} "
                                           f"({h.root[:16]}) though no rank said its copies were missing")

    def run(self) -> int:
        print(f"HARNESS memtier seed={self.seed} rounds={self.rounds}", flush=True)
        for i in range(self.rounds):
            self.round(i)
            print(self.summary[-1], flush=True)
        self.finish()
        for v in self.violations:
            print("VIOLATION", v, flush=True)
        if self.violations:
            print(f"replay: python -m tests.sim.memtier --seed {self.seed} --rounds {self.rounds}"
                  + (" --same-nodes" if self.same_nodes else ""), flush=True)
            return 1
        print(f"memtier: {self.rounds} rounds OK", flush=True)
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim.memtier", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--same-nodes", action="store_true",
                    help="every round on nodes a and b, in that order (the rounds before the nodes changed)")
    ap.add_argument("--dir", default=None, help="where the journals go (default: a temp dir, removed if all pass)")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    work = a.dir or tempfile.mkdtemp(prefix="tsck-memtier-")
    os.makedirs(work, exist_ok=True)
    shm = os.path.join("/dev/shm", f"tsck-memtier-{os.getpid()}")
    os.makedirs(shm, exist_ok=True)
    try:
        rc = Run(seed, a.rounds, work, shm, a.same_nodes).run()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if rc == 0 and a.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    elif rc:
        print(f"journals kept in {work}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
