"""Shared pieces of the fuzz targets (no atheris needed to import this).

- instrument(): atheris' import instrumentation when a target runs as a script
  under atheris, a no-op otherwise (pytest imports the targets plainly).
- real_states() / build_real_store(): the deterministic "training job" store
  that make_corpus.py snapshots and that the targets re-create in memory, so
  the block and node addresses in seed node payloads resolve to real objects.
- same(): strict structural and bitwise equality of two state trees.
- deadline(): a watchdog (real-time signal) that turns a hang into a contract violation
  (by CPU time: a loaded machine slows a body down, it does not make it hang).
- ByteStream: reads typed values out of fuzzer bytes (never raises, pads with 0).

Contract of every target's TestOneInput(data): it returns normally when the
code under test returned a valid value or raised a TsckError subclass; any
other exception (including ContractViolation, Hang) is a finding.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import struct
import sys
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path

# torch warns on every quantized tensor it builds; the seeds and the reader build many.
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")

FUZZ_DIR = Path(__file__).resolve().parent
CORPUS_DIR = FUZZ_DIR / "corpus"
REPO = FUZZ_DIR.parent
if str(REPO) not in sys.path:  # running a target from a checkout without `pip install -e`
    sys.path.insert(0, str(REPO))


def instrument(enabled: bool):
    """Context manager: instrument tensorstore_ck's bytecode for coverage feedback
    when a target runs as a script (enabled=__name__ == "__main__") and atheris
    is installed; a no-op under pytest. TSCK_FUZZ_INSTRUMENT=0 switches it off."""
    if enabled and os.environ.get("TSCK_FUZZ_INSTRUMENT", "1") != "0":
        import atheris
        return atheris.instrument_imports(include=["tensorstore_ck"])
    return contextlib.nullcontext()


# Problems already reported (fuzz/README.md, "Findings"), as "Type@file:function" of the
# innermost tensorstore_ck frame (KNOWN), or a part of a ContractViolation's message
# (KNOWN_VIOLATIONS). With
# TSCK_FUZZ_IGNORE_KNOWN=1 a target run under atheris swallows these, so a long
# run keeps looking for new problems instead of stopping at a known one.
KNOWN: set[str] = set()  # every problem found so far is fixed and kept as a regression test
# Contract violations already reported, as substrings of their message.
KNOWN_VIOLATIONS: list[str] = []


def attempt(fn, *args, **kw):
    """fn(*args) -> its value, or None when it raised a TsckError (allowed by every target)."""
    from tensorstore_ck.errors import TsckError
    try:
        return fn(*args, **kw)
    except TsckError:
        return None


def signature(e: BaseException) -> str:
    """'Type@file:function' of the innermost tensorstore_ck frame (or the innermost frame)."""
    import traceback
    if isinstance(e, ContractViolation) and not isinstance(e, Hang):
        return f"ContractViolation:{e}"
    tb = traceback.extract_tb(e.__traceback__)
    if isinstance(e, Hang):  # where the alarm lands inside a loop varies: name the loop
        loop = next((f for f in tb if f.name == "revalidate_plan" and f.filename.endswith("publish.py")), None)
        if loop is not None:
            return "Hang@publish.py:revalidate_plan"
    f = next((f for f in reversed(tb) if "tensorstore_ck" in f.filename), tb[-1] if tb else None)
    where = f"{Path(f.filename).name}:{f.name}" if f else "?"
    return f"{type(e).__name__}@{where}"


def is_known(e: BaseException) -> bool:
    sig = signature(e)
    if sig.startswith("ContractViolation:"):
        return any(k in sig for k in KNOWN_VIOLATIONS)
    return sig in KNOWN


def _ignoring_known(fn):
    def wrapped(data):
        try:
            fn(data)
        except Exception as e:  # noqa: BLE001
            if not is_known(e):
                raise
    return wrapped


def atheris_main(test_one_input, default_args=(), custom_mutator=None) -> None:
    """Entry point of every target script: `python fuzz/fuzz_X.py [libFuzzer flags] [corpus dirs]`."""
    import atheris
    if os.environ.get("TSCK_FUZZ_IGNORE_KNOWN") == "1":
        test_one_input = _ignoring_known(test_one_input)
    args = list(sys.argv)
    for a in ("-timeout=30", *default_args):  # the targets' own deadlines are shorter
        if not any(x.startswith(a.split("=", 1)[0] + "=") for x in args[1:]):
            args.insert(1, a)
    if custom_mutator is not None:
        atheris.Setup(args, test_one_input, custom_mutator=custom_mutator)
    else:
        atheris.Setup(args, test_one_input)
    atheris.Fuzz()


class ContractViolation(AssertionError):
    """The code under test returned something it must not (wrong value, wrong size, ...)."""


class Hang(ContractViolation):
    """The code under test ran past its deadline."""


_DEADLINE_SIGNAL = (signal.SIGRTMIN + 3) if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill") \
    else None


def _ignore_signal(_sig, _frame):
    pass


# A body that waits without working (a lock never released) is a hang too: past this many
# times its CPU budget in wall time, whatever the load.
WALL_FACTOR = 10
_POLL = 0.02  # seconds between the watchdog's looks at the CPU clock


@contextlib.contextmanager
def deadline(seconds: float, what: str = "call"):
    """Raise Hang in the main thread once the body has used more than `seconds` of this
    process's CPU time (a loop that does not end), or run WALL_FACTOR times that in wall
    time (a wait that does not end). CPU time, not wall time: a machine busy with other
    work slows the body down without making it a hang.

    A watchdog thread sends a real-time signal (not SIGALRM, which libFuzzer's
    -timeout owns) to the main thread, whose handler raises Hang at the next
    bytecode. A no-op outside the main thread or without real-time signals."""
    if _DEADLINE_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(_sig, _frame):
        raise Hang(f"{what} ran past its deadline ({seconds:.1f} CPU-s, or {WALL_FACTOR * seconds:.0f} s)")

    done = threading.Event()
    main = threading.main_thread().ident
    cpu0, wall0 = time.process_time(), time.monotonic()

    def watchdog():
        while not done.wait(_POLL):
            if time.process_time() - cpu0 > seconds or time.monotonic() - wall0 > WALL_FACTOR * seconds:
                signal.pthread_kill(main, _DEADLINE_SIGNAL)
                return

    old = signal.signal(_DEADLINE_SIGNAL, on_signal)
    th = threading.Thread(target=watchdog, name="tsck-fuzz-deadline", daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()
        # never back to SIG_DFL (it would kill the process if a late signal lands)
        signal.signal(_DEADLINE_SIGNAL, old if callable(old) else _ignore_signal)


def corpus_files(target: str) -> list[Path]:
    d = CORPUS_DIR / target
    return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []


def corpus(target: str) -> list[bytes]:
    return [p.read_bytes() for p in corpus_files(target)]


# --------------------------------------------------------------------------- byte stream
class ByteStream:
    """Typed reads from fuzzer bytes; past the end every read returns zeros."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return max(0, len(self.data) - self.pos)

    def take(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b + b"\0" * (n - len(b))

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def i64(self) -> int:
        return struct.unpack("<q", self.take(8))[0]

    def f64(self) -> float:
        return struct.unpack("<d", self.take(8))[0]

    def pick(self, seq):
        return seq[self.u8() % len(seq)]

    def blob(self, cap: int = 64) -> bytes:
        return self.take(self.u8() % (cap + 1))


# --------------------------------------------------------------------------- equality
def tensor_bytes(t) -> bytes:
    import torch
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a, b, path: str = "state") -> None:
    """Strict equality: same types, key order, dtypes, shapes, flags and bits."""
    import numpy as np
    import torch

    from tensorstore_ck.write.shard import Sharded

    def bad(msg):
        raise ContractViolation(f"round trip differs at {path}: {msg}")

    if type(a) is not type(b):
        bad(f"type {type(a).__name__} became {type(b).__name__}")
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            bad(f"{a.dtype} {tuple(a.shape)} became {b.dtype} {tuple(b.shape)}")
        if a.requires_grad != b.requires_grad:
            bad("requires_grad differs")
        if a.is_quantized:
            if a.qscheme() != b.qscheme():
                bad("qscheme differs")
            if a.qscheme() == torch.per_tensor_affine:
                if struct.pack("<d", a.q_scale()) != struct.pack("<d", b.q_scale()) \
                        or a.q_zero_point() != b.q_zero_point():
                    bad("quantization parameters differ")
            else:
                if not torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales()) or \
                        not torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points()) or \
                        a.q_per_channel_axis() != b.q_per_channel_axis():
                    bad("per-channel quantization parameters differ")
        if tensor_bytes(a) != tensor_bytes(b):
            bad("tensor bytes differ")
    elif isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.dtype.descr != b.dtype.descr or a.shape != b.shape:
            bad(f"{a.dtype!r} {a.shape} became {b.dtype!r} {b.shape}")
        if a.flags.f_contiguous and not a.flags.c_contiguous and not b.flags.f_contiguous:
            bad("Fortran order lost")
        if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            bad("array bytes differ")
    elif isinstance(a, np.generic):
        if a.dtype != b.dtype or a.tobytes() != b.tobytes():
            bad(f"scalar {a.dtype!r} became {b.dtype!r} or its bytes differ")
    elif isinstance(a, Sharded):
        if a.global_shape != b.global_shape or a.offsets != b.offsets:
            bad("sharded piece moved")
        same(a.local, b.local, path + ".local")
    elif isinstance(a, dict):
        ka, kb = list(a), list(b)
        if [(type(k), k) for k in ka] != [(type(k), k) for k in kb]:
            bad(f"keys {ka[:8]!r} became {kb[:8]!r}")
        for k in ka:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            bad(f"length {len(a)} became {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            bad(f"float {a!r} became {b!r}")
    elif isinstance(a, (type(None), bool, int, str, bytes)):
        if a != b:
            bad(f"{a!r:.60} became {b!r:.60}")
    else:  # a pickled object: compare what pickle says about it
        if pickle.dumps(a) != pickle.dumps(b) and a != b:
            bad(f"pickled {type(a).__name__} differs")


# Types the Reader may hand back without allow_pickle.
def check_state_types(v, depth: int = 0) -> None:
    import numpy as np
    import torch

    from tensorstore_ck.write.shard import Sharded
    if depth > 1000:
        raise ContractViolation("returned state deeper than 1000 levels")
    t = type(v)
    if v is None or t in (bool, int, float, str, bytes):
        return
    if t in (dict, OrderedDict):
        for k, x in v.items():
            if type(k) not in (str, int):
                raise ContractViolation(f"dict key of type {type(k).__name__} in a decoded state")
            check_state_types(x, depth + 1)
        return
    if t in (list, tuple):
        for x in v:
            check_state_types(x, depth + 1)
        return
    if t in (torch.Tensor, torch.nn.Parameter, np.ndarray, Sharded) or isinstance(v, np.generic):
        if isinstance(v, np.ndarray) and v.dtype.hasobject:
            raise ContractViolation("decoded a numpy array holding Python objects")
        if isinstance(v, np.generic) and v.dtype.hasobject:
            raise ContractViolation("decoded a numpy object scalar")
        return
    raise ContractViolation(f"decoded a {t.__module__}.{t.__qualname__} without allow_pickle")


# --------------------------------------------------------------------------- real store
BLOCK_SIZE = 4096        # the smallest allowed: real tensors of a few KiB become several blocks
INLINE_THRESHOLD = 256   # and small ones stay inline, so seeds hold both kinds of leaf


def real_states() -> list[dict]:
    """A small but realistic training job: weights of several dtypes, AdamW state,
    RNG streams, data-loader position and plain values. Deterministic."""
    import numpy as np
    import torch

    import tensorstore_ck as tsck

    g = torch.Generator().manual_seed(1234)
    rs = np.random.RandomState(1234)

    def rnd(shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(dtype)

    emb = rnd((64, 32))
    model = OrderedDict([
        ("emb.weight", emb),
        ("ln.weight", rnd((32,), torch.bfloat16)),
        ("ln.bias", torch.zeros(32, dtype=torch.bfloat16)),
        ("head.weight", torch.nn.Parameter(rnd((16, 32)), requires_grad=True)),
        ("mask", torch.rand((8, 8), generator=g) > 0.5),
        ("fp8", rnd((128,)).to(torch.float8_e4m3fn)),
        ("cplx", torch.complex(rnd((4,)), rnd((4,)))),
        ("idx", torch.arange(100, dtype=torch.int64)),
        ("q", torch.quantize_per_tensor(rnd((8,)), 0.05, 3, torch.qint8)),
        ("qc", torch.quantize_per_channel(rnd((4, 3)), torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64),
                                          torch.tensor([0, 1, 2, 3]), 0, torch.quint8)),
        ("empty", torch.empty((0, 5))),
        ("scalar", torch.tensor(3.5)),
        ("t_view", rnd((6, 4)).t()),
    ])
    optim = {
        "state": {i: {"step": torch.tensor(float(3 + i)), "exp_avg": torch.zeros(16, 32) if i == 0 else rnd((32,)),
                      "exp_avg_sq": torch.full((32,), 1e-8)} for i in range(3)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                          "amsgrad": False, "params": [0, 1, 2]}],
    }
    rng = {
        "python": random.Random(7).getstate(),
        "numpy": np.random.RandomState(7).get_state(),
        "torch": torch.Generator().manual_seed(7).get_state(),
    }
    struct_dt = np.dtype([("id", "<i4"), ("w", "<f4", (2,)), ("tag", "S3")])
    data = {
        "epoch": 1, "pos": 123, "perm": rs.permutation(300).astype(np.int64),
        "f_order": np.asfortranarray(rs.rand(5, 7)), "big_endian": np.arange(6, dtype=">i4"),
        "records": np.zeros(4, dtype=struct_dt), "when": np.datetime64("2024-05-01T12:00"),
        "lr_scale": np.float32(0.5), "flag": np.bool_(True),
    }
    misc = {
        "big": 2**100 + 7, "neg_big": -(2**70), "u64": 2**64 - 1, "nan": float("nan"), "ninf": float("-inf"),
        "negz": -0.0, "text": "héllo ✓", "raw": b"\x00\xffbytes", "none": None, "ok": True,
        "tuple": (1, "a", (2.5, None)), 7: "int key", -3: [1, 2],
        "od": OrderedDict([("z", 1), ("a", 2)]),
        # > 4 KiB of small containers: a node of its own, shared by every snapshot
        "table": {f"k{i:03d}": [i, float(i) / 3, f"v{i}"] for i in range(200)},
        "sharded": tsck.Sharded(rnd((4, 8)), (8, 8), (4, 0)),
    }
    s1 = {"model": model, "optim": optim, "rng": rng, "data": data, "misc": misc, "step": 10}
    # step 20: one row of the embedding changed (one new block), the rest shared
    model2 = OrderedDict(model)
    e2 = emb.clone()
    e2[3] += 1.0
    model2["emb.weight"] = e2
    s2 = {**s1, "model": model2, "step": 20, "data": {**data, "pos": 456}}
    s3 = {"model": {"emb.weight": emb, "adapter": rnd((8, 8))}, "step": 5, "note": "fine-tune"}
    return [s1, s2, s3]


def build_real_store(url: str | None = None, **open_kw):
    """The real store every seed comes from: returns (store, info) where info
    names the snapshots, refs and tags. Several refs and jobs, a tag, a pin, a
    retention rule, a pickled value (allow_pickle) and a sharded tensor."""
    import tensorstore_ck as tsck
    url = url or f"memory://tsck-fuzz-{uuid.uuid4().hex}"
    store = tsck.open_store(url, block_size=BLOCK_SIZE, inline_threshold=INLINE_THRESHOLD, **open_kw)
    s1, s2, s3 = real_states()
    a1 = store.put_snapshot(s1, ref="jobA/main", step=10, metrics={"val_loss": 2.5}, meta={"note": "first"})
    a2 = store.put_snapshot(s2, ref="jobA/main", step=20, metrics={"val_loss": 2.1})
    d1 = store.put_snapshot(s2, ref="jobA/dev", step=20, metrics={"val_loss": 2.2})
    b1 = store.put_snapshot(s3, ref="jobB/main", step=5, metrics={"val_loss": 3.0, "acc": 0.5})
    p1 = store.put_snapshot({"obj": {1, 2, 3}, "frac": complex(1, 2)}, ref="jobB/pickled", step=1,
                            allow_pickle=True)
    store.tag("golden", "jobA/main@10")
    store.pin("jobB/main")
    store.set_retention("jobA", tsck.Retention(keep_last=5, keep_best=1, metric="val_loss"))
    info = {"snapshots": [a1, a2, d1, b1, p1], "refs": ["jobA/main", "jobA/dev", "jobB/main", "jobB/pickled"],
            "tags": ["golden"]}
    return store, info


def drop_memory_store(store) -> None:
    """Close a memory:// store and free its objects and ref table."""
    from tensorstore_ck.core.locate import forget_memory_refs
    url = store.url
    try:
        store.close()
    except Exception:
        pass
    if url.startswith("memory://"):
        try:
            fs = store.storage.fs
            root = store.storage.root
            if fs.exists(root):
                fs.rm(root, recursive=True)
        except Exception:
            pass
        forget_memory_refs(url)


# --------------------------------------------------------------------------- msgpack mutator
TOKENS = ["T", "A", "S", "G", "W", "r", "P", "d", "l", "t", "o", "i", "x", "dt", "sh", "n", "bs", "b", "q",
          "p", "rg", "dev", "fo", "chunks", "off", "ranks", "world", "rep", "v", "k", "commit", "tree",
          "parent", "stats", "metrics", "meta", "job", "ref", "step", "time", "epoch", "phase", "heartbeat",
          "owner", "new", "old", "keep_last", "bytes_total", "<U0", "|S0", "|V0", "<U1", "O", "|O", "<f4",
          ">f8", "<M8[ns]", "float32", "bfloat16", "qint8", "quint8", "quint4x2", "int4", "uint5", "bool",
          "complex64", "float8_e4m3fn", "cuda:0", "meta", "pt", "pc", "idle", "deleting", "marking", "../x"]
EXTREME_INTS = [0, 1, -1, 2, 3, 7, 255, 256, 4096, 2**31 - 1, 2**31, 2**32, 2**40, 2**47, 2**48, 2**62,
                2**63 - 1, -(2**63), 2**64 - 1, 10**6]


def _paths(obj, out, depth=0):
    """(container, key) of every slot in a decoded msgpack tree."""
    if depth > 60 or len(out) > 5000:
        return
    if isinstance(obj, dict):
        for k in list(obj):
            out.append((obj, k))
            _paths(obj[k], out, depth + 1)
    elif isinstance(obj, list):
        for i in range(len(obj)):
            out.append((obj, i))
            _paths(obj[i], out, depth + 1)


def _new_value(rng: random.Random, pool: list):
    k = rng.randrange(12)
    if k == 0:
        return rng.choice(EXTREME_INTS) * rng.choice([1, 1, 1, -1])
    if k == 1:
        return rng.choice([float("nan"), float("inf"), -0.0, 1e308, 0.5])
    if k == 2:
        return rng.choice(TOKENS)
    if k == 3:
        return rng.choice([b"", b"\0" * 32, bytes(rng.randrange(256) for _ in range(32)), b"\x01" * 31])
    if k == 4:
        return rng.choice([None, True, False, [], {}])
    if k == 5 and pool:
        return pool[rng.randrange(len(pool))][0]  # a whole container from elsewhere in the tree
    if k == 6:
        return {rng.choice(TOKENS): _new_value(rng, pool)}
    if k == 7:
        return [_new_value(rng, pool) for _ in range(rng.randrange(3))]
    if k == 8:
        return [rng.randrange(0, 2**48) for _ in range(rng.randrange(1, 65))]
    if k == 9:
        return rng.choice([2**47, 2**40, 0, 1]) if rng.randrange(2) else rng.randrange(2**64)
    if k == 10 and pool:
        c, key = pool[rng.randrange(len(pool))]
        return c[key]
    return rng.randrange(-(2**63), 2**64)


def mutate_msgpack(data: bytes, rng: random.Random) -> bytes | None:
    """A structure-aware mutation of msgpack bytes (None if they do not decode):
    replace, delete, duplicate, wrap or splice one slot of the decoded tree."""
    import msgpack
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=1 << 24)
    except Exception:
        return None
    root = [obj]
    for _ in range(rng.randint(1, 3)):
        slots = [(root, 0)]
        _paths(root[0], slots)
        c, key = slots[rng.randrange(len(slots))]
        op = rng.randrange(6)
        try:
            if op <= 1:
                c[key] = _new_value(rng, slots)
            elif op == 2 and c is not root:
                if isinstance(c, dict):
                    del c[key]
                else:
                    c.pop(key)
            elif op == 3:
                c[key] = [c[key]] if rng.randrange(2) else {rng.choice(TOKENS): c[key]}
            elif op == 4 and isinstance(c, list):
                c.insert(key, c[key])
            elif op == 5 and isinstance(c, dict):
                c[rng.choice(TOKENS)] = _new_value(rng, slots)
        except Exception:
            pass
    try:
        return msgpack.packb(root[0], use_bin_type=True)
    except Exception:
        return None


def msgpack_custom_mutator(prefix_len: int = 0):
    """An atheris custom mutator: half structure-aware msgpack mutations (after
    `prefix_len` bytes kept as they are), half libFuzzer's own."""
    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        import atheris
        rng = random.Random(seed)
        if rng.randrange(2):
            out = mutate_msgpack(bytes(data[prefix_len:]), rng)
            if out is not None and len(out) + prefix_len <= max_size:
                return bytes(data[:prefix_len]) + out
        return atheris.Mutate(data, max_size)
    return mutator
