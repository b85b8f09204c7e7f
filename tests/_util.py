"""Shared helpers of the test suite.

Nothing here touches tensorstore_ck internals: only the public API, the on-disk
directory names documented in docs/FORMAT.md (blocks/ nodes/ commits/) and its
object frame (recode_blocks, through tensorstore_ck.format.frame), and WrappedStore, the
base of what open_store(wrap_storage=) is given (CountingReads, HoldLookups).
assert_same / same_bits are the suite's one bit-exact comparison of state trees.
child_env, kill_left, load_helper, in_thread, at_once and run_worker_scenario are its one copy of the
subprocess and thread plumbing (a test that starts a process or loads a helper
script by path uses these, so a fix to one reaches every test).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import math
import os
import signal
import stat
import struct
import sys
import textwrap
import threading
import time
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

OBJECT_DIRS = ("blocks", "nodes", "commits")
REPO = Path(__file__).resolve().parent.parent
HELPERS = REPO / "tests" / "helpers"


# ---------------------------------------------------------------- processes and threads
def soak(n: int) -> int:
    """How many trials a kill or race loop runs: n in CI, n times $TSCK_SOAK for a longer
    run by hand (`TSCK_SOAK=10 pytest tests/write/test_crash.py`); the harness (tests/sim) is
    the long random search, these loops the fixed regression cases."""
    return max(1, round(n * float(os.environ.get("TSCK_SOAK") or 1)))


def kill_left(procs) -> None:
    """(process, its stderr file) pairs a test started: SIGKILL those still running,
    reap them, close every file (a test's finally, however it ended)."""
    for p, err in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        err.close()


def child_env(*, drop: tuple[str, ...] = (), cli: bool = False, **set_vars: str | None) -> dict:
    """The environment of a subprocess that must import this checkout's tensorstore_ck:
    os.environ with the repository first on PYTHONPATH.

    drop: prefixes of variables to leave out (("TSCK_",): a developer's $TSCK_REFS must
    not reach a CLI under test; ("AWS_", "TSCK_"): nor credentials a backend did not set).
    cli: what the CLI tests compare against: no PYTHONWARNINGS (a warning on stderr would
    be taken for the CLI's words) and COLUMNS=200 (argparse wraps at the terminal width).
    set_vars: further variables; None removes one."""
    env = {k: v for k, v in os.environ.items() if not (drop and k.startswith(tuple(drop)))}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cli:
        set_vars = {"PYTHONWARNINGS": None, "COLUMNS": "200", **set_vars}
    for k, v in set_vars.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def load_helper(path, *, name: str | None = None, sibling_imports: bool = False):
    """Import a script by its file path and return the module: tests/helpers/ and
    benches/ are not packages on sys.path. `path`: a path, or a bare name for
    tests/helpers/<name>.py. name: the module's name (default tsck_test_<stem>, so two
    loads of one file in a session are the same name). sibling_imports: the script
    imports modules beside it (dtensor_worker imports dist_worker): its folder is on
    sys.path while it loads, and only then."""
    path = Path(path) if os.sep in str(path) or str(path).endswith(".py") else HELPERS / f"{path}.py"
    spec = importlib.util.spec_from_file_location(name or f"tsck_test_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    if sibling_imports:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        if sibling_imports:
            sys.path.remove(str(path.parent))
    return mod


def line_from(proc, prefix: str, timeout: float) -> str:
    """The first line PROC (text=True, stdout and stderr piped) prints that starts with
    PREFIX; fails, with the end of its stderr, if it ends first, or once TIMEOUT seconds
    have passed when a line comes."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"no {prefix!r} line within {timeout} s"
        line = proc.stdout.readline()
        assert line, f"the process ended before its {prefix!r} line: {proc.stderr.read()[-2000:]}"
        if line.startswith(prefix):
            return line


def kill_and_close(proc) -> None:
    """SIGKILL PROC (a Popen with stdout and stderr piped), reap it and close its pipes."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def in_thread(fn):
    """Start fn() in a thread; -> (thread, out). After thread.join(), out holds "value"
    (what fn returned) or "error" (what it raised, BaseException included), for the test
    to judge: an exception in a bare thread would only be printed."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def at_once(n: int, fn) -> tuple[list, list[str]]:
    """fn() called by n threads released together by a barrier (every rank of a job
    opening a store at once) -> (what the calls returned, "Type: message" of each error)."""
    gate, got, errors = threading.Barrier(n), [], []

    def one():
        gate.wait()
        try:
            got.append(fn())
        except Exception as e:  # noqa: BLE001 - returned to the caller, which shows them
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, errors


def launcher_main(scenarios) -> None:
    """The __main__ of a launcher script (tests/helpers/dist_worker.py and the scripts that
    launch through it): `python SCRIPT SCENARIO OUT [ARG...]` makes OUT, asks
    scenarios(scenario, out, argv) for the launch infos of that scenario (None: no such
    scenario), prints them as one JSON line and exits 0. The ranks write their results
    under OUT, where the test reads them (run_worker_scenario)."""
    import json
    scenario, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    infos = scenarios(scenario, out, sys.argv)
    if infos is None:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(infos))
    sys.exit(0)


def rank_results(out, phase: str, world: int, *, ok: bool = True, dead=(), missing_ok: bool = False,
                 exit_zero: bool = False) -> list:
    """What each rank of one launch reported: OUT/<phase>_rank<r>.json for r < world, after
    checking the launcher's own record (OUT/<phase>_launcher.json) that no rank timed out.
    ok: each report says ok (else its error is the failure). dead: ranks that must have
    died without reporting (None in their place). missing_ok: a rank with no report is
    None instead of a failure. exit_zero: each reporting rank also exited 0."""
    import json
    out = Path(out)
    launcher = json.loads((out / f"{phase}_launcher.json").read_text())
    assert launcher["timed_out"] == [], f"{phase}: ranks {launcher['timed_out']} never finished"
    res = []
    for r in range(world):
        f = out / f"{phase}_rank{r}.json"
        if r in dead:
            assert not f.exists(), f"{phase}: rank {r} should have died, but it reported"
            res.append(None)
            continue
        if not f.exists():
            assert missing_ok, f"{phase}: rank {r} left no result (exit code {launcher['exitcodes'][r]})"
            res.append(None)
            continue
        d = json.loads(f.read_text())
        if ok:
            assert d["ok"], f"{phase}: rank {r} failed:\n{d.get('error')}"
        if exit_zero:
            assert launcher["exitcodes"][r] == 0
        res.append(d)
    return res

# ---------------------------------------------------------------- comparison
def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor's logical content (row-major), bit-exact."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path: str = "", *, loose_types: bool = False) -> None:
    """Strict structural + bitwise equality (a: expected, b: actual). loose_types: a dict
    subclass may stand for a dict and a Tensor subclass for a tensor (what dcp.load
    gives back), everything else still bit-exact."""
    where = path or "<root>"
    if loose_types and isinstance(a, dict) and isinstance(b, dict):
        pass
    elif loose_types and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().as_subclass(torch.Tensor), b.detach().as_subclass(torch.Tensor)
    else:
        assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
        if a.is_quantized:
            assert b.is_quantized and a.qscheme() == b.qscheme(), f"{where}: qscheme differs"
            if a.qscheme() == torch.per_tensor_affine:
                assert struct.pack("<d", a.q_scale()) == struct.pack("<d", b.q_scale()), f"{where}: q_scale"
                assert a.q_zero_point() == b.q_zero_point(), f"{where}: q_zero_point"
            else:
                assert a.q_per_channel_axis() == b.q_per_channel_axis(), f"{where}: q_per_channel_axis"
                assert_same(a.q_per_channel_scales(), b.q_per_channel_scales(), f"{path}.q_per_channel_scales")
                assert_same(a.q_per_channel_zero_points(), b.q_per_channel_zero_points(),
                            f"{path}.q_per_channel_zero_points")
            a, b = a.int_repr(), b.int_repr()
        assert tensor_bytes(a) == tensor_bytes(b), f"{where}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype!r} != {b.dtype!r}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:  # stored in Fortran order
            assert b.flags.f_contiguous, f"{where}: Fortran order lost"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):  # tsck.Sharded, tsck.Replicated
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype!r} != {b.dtype!r}"
        assert a.tobytes() == b.tobytes(), f"{where}: scalar bytes differ"
    elif isinstance(a, dict):
        ka, kb = list(a.keys()), list(b.keys())
        assert [(type(k), k) for k in ka] == [(type(k), k) for k in kb], (
            f"{where}: keys/order differ: {ka!r} != {kb!r}")
        for k in ka:
            assert_same(a[k], b[k], f"{path}[{k!r}]", loose_types=loose_types)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", loose_types=loose_types)
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: float bits {a!r} != {b!r}"
    else:  # None, bool, int, str, bytes, picklable objects
        assert a == b, f"{where}: {a!r} != {b!r}"


def same_bits(a, b) -> bool:
    """assert_same as a predicate."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


# ---------------------------------------------------------------- tensors
def rand_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """A dense CPU tensor of `dtype` filled with random bytes (NaN payloads etc.)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = math.prod(shape) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # keep bools canonical
    return raw.view(dtype).reshape(tuple(shape))


def blank_like(x, plain=lambda v: v):
    """X's structure (dicts, lists, tuples) with its tensors zeroed and every other value as
    PLAIN makes it: a load target that holds none of X's tensors."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: blank_like(v, plain) for k, v in x.items()}
    if isinstance(x, list):
        return [blank_like(v, plain) for v in x]
    if isinstance(x, tuple):
        return tuple(blank_like(v, plain) for v in x)
    return plain(x)


def all_torch_dtypes():
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


# ---------------------------------------------------------------- store listing
def plant_special(p: str, what: str) -> None:
    """Put a special file where a stored object (or directory) is: "fifo" (a read would
    block), "dir", or "zero" (a link to /dev/zero: endless bytes)."""
    if os.path.isdir(p) and not os.path.islink(p):
        import shutil
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)
    if what == "fifo":
        os.mkfifo(p)
    elif what == "dir":
        os.mkdir(p)
    elif what == "zero":
        os.symlink("/dev/zero", p)
    else:
        raise ValueError(what)


def object_listing(store_path) -> dict:
    """{relative path: size} for every file under blocks/ nodes/ commits/
    (`store_path` may be a tests/_backends.Backend: then on any backend)."""
    if hasattr(store_path, "objects"):
        return store_path.objects()
    out = {}
    for d in OBJECT_DIRS:
        base = os.path.join(str(store_path), d)
        for root, _dirs, files in os.walk(base):
            for f in files:
                full = os.path.join(root, f)
                out[os.path.relpath(full, str(store_path))] = os.path.getsize(full)
    return out


def recode_blocks(store_path, *, shuffle_itemsize: int) -> list[Path]:
    """Rewrite each block file of a local store with the byte-shuffle codec (2) where it
    shrinks the block: a store as a writer of that codec left it (no store writes it now;
    every reader reads it). An address is the BLAKE3 of the raw bytes, so it stays. ->
    the files now in codec 2."""
    from tensorstore_ck.format import frame
    recoded = []
    for p in sorted(Path(store_path, "blocks").rglob("*")):
        if not p.is_file():
            continue
        old = p.read_bytes()
        hdr = frame.decode_header(old[:frame.HEADER_SIZE])
        raw = bytes(frame.decode_payload(hdr, memoryview(old)[frame.HEADER_SIZE:]))
        new = b"".join(bytes(b) for b in frame.encode_payload(raw, frame.KIND_BLOCK,
                                                              shuffle_itemsize=shuffle_itemsize))
        if frame.decode_header(new[:frame.HEADER_SIZE]).codec != frame.CODEC_SHUFFLE_LZ4:
            continue
        tmp = p.with_name(p.name + ".recode")
        tmp.write_bytes(new)
        os.replace(tmp, p)
        recoded.append(p)
    return recoded


def refs_snapshot(store) -> dict:
    return {name: info.root for name, info in store.refs().items()}


def tags_snapshot(store) -> dict:
    return {name: info.root for name, info in store.tags().items()}


def run_worker_scenario(worker, tmp_path, scenario: str, *args, limit: float) -> "os.PathLike":
    """Run `python WORKER SCENARIO OUT ARGS...` (a launcher that forks real gloo ranks) with
    the repository on PYTHONPATH; -> OUT. Past `limit` seconds the launcher and every rank
    it forked are killed and the test fails with the launcher's stderr."""
    import signal
    import subprocess
    import _zygote as zygote

    import pytest
    out = tmp_path / scenario
    env = child_env(TORCH_CPP_LOG_LEVEL="ERROR")
    proc = zygote.Popen([sys.executable, str(worker), scenario, str(out), *map(str, args)], cwd=REPO, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _o, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it forked
        _o, err = proc.communicate()
        pytest.fail(f"scenario {scenario} {args} ran past {limit}s:\n{err.decode(errors='replace')[-4000:]}")
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    return out


# -- storage wrappers that watch or hold a store's requests ----------------------------
class Watched(WrappedStore):
    """A storage wrapper that sees each object request before it goes on: on_read(key)
    before every read (get, open_read), on_write(key) before every write (put_if_absent,
    put_addressed). A subclass counts, records or holds there."""

    def on_read(self, key: str) -> None:
        pass

    def on_write(self, key: str) -> None:
        pass

    def get(self, key, max_bytes=None):
        self.on_read(key)
        return self.inner.get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        self.on_read(key)
        return self.inner.open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        self.on_write(key)
        return self.inner.put_if_absent(key, bufs)

    def put_addressed(self, key, bufs):
        self.on_write(key)
        return self.inner.put_addressed(key, bufs)


class CountingReads(Watched):
    """Counts the reads of each block object (get and open_read), and keeps their order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reads = collections.Counter()
        self.order = []

    def on_read(self, key):
        if key.startswith("blocks/"):
            self.reads[key.rsplit("/", 1)[1]] += 1
            self.order.append(key.rsplit("/", 1)[1])


class HoldLookups(WrappedStore):
    """Holds the first question about an object (the uploader's HEAD) until `gate` is set."""

    def __init__(self, inner, deadline: float = 120.0):
        super().__init__(inner)
        self.gate = threading.Event()
        self.deadline = deadline

    def size_of(self, key):
        assert self.gate.wait(self.deadline)
        return self.inner.size_of(key)


# ---------------------------------------------------------------- the CLI without torch
# Runs the CLI's main() with torch made unimportable: any import of it fails the command
# (tests/cli/test_cli_no_torch.py, tests/dcp/test_dcp_cli.py).
NO_TORCH_CLI = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch imported by a command that must not need it")
    sys.meta_path.insert(0, _Block())
    from tensorstore_ck.cli import main
    sys.exit(main(sys.argv[1:]))
""")


# ---------------------------------------------------------------- calls that may hang
def unblock_fifos(path) -> None:
    """Release a reader stuck opening the FIFOs under `path` (so a reader that does open one cannot hang the suite)."""
    for d, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.path.isfile(p) or not os.path.exists(p):
                    continue
                if stat.S_ISFIFO(os.stat(p).st_mode):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def bounded(fn, *, timeout: float = 30.0, unblock=None):
    """fn() in a thread; a call still running after `timeout` fails the test instead of hanging it."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        # Release it (it may wait on one FIFO after another) so the store can close.
        for _ in range(100):
            if unblock is None or not t.is_alive():
                break
            unblock_fifos(unblock)
            t.join(0.1)
        pytest.fail(f"still running after {timeout} s: hangs")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---------------------------------------------------------------- a tiny Trainer run
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16):
        self.x = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(123))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    # bos/eos inside the tiny vocabulary (GPT-2's 50256 is not)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def hf_trainer(out, callbacks, steps: int, *, trainer_kw: dict | None = None, **kw):
    """The suite's Hugging Face run, the same every time: seed 0, dropout on (the RNG streams
    matter), 16 steps an epoch (a resume at step 10 is mid-epoch, 20 steps cross into the
    second), a save every 5 steps. KW: more TrainingArguments; TRAINER_KW: more of the
    Trainer's own."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    set_seed(0)
    args = TrainingArguments(str(out), max_steps=steps, save_steps=5, logging_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True, **kw)
    t = Trainer(model=tiny_model(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8), callbacks=callbacks,
                **(trainer_kw or {}))
    t.remove_callback(PrinterCallback)
    return t


# ---------------------------------------------------------------- `tsck du`'s three jobs
DU_BS = 64 * 1024  # (tests/interchange/test_plot.py, tests/maintain/test_du_holds.py)
DU_N = DU_BS // 4  # float32 elements per block: 1-D tensors are cut at exact multiples of DU_BS


def vec(seed: int, blocks: int) -> torch.Tensor:
    return rand_tensor(torch.float32, (DU_N * blocks,), seed=seed)


def block_digests(t: torch.Tensor) -> set[bytes]:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return {blake3.blake3(raw[i:i + DU_BS]).digest() for i in range(0, len(raw), DU_BS)}


def block_sizes_on_disk(path) -> dict[bytes, int]:
    out = {}
    for root, _dirs, files in os.walk(os.path.join(path, "blocks")):
        for f in files:
            out[bytes.fromhex(f)] = os.path.getsize(os.path.join(root, f))
    return out


def fill(path):
    """Three jobs: a base model shared by two fine-tunes, each with heads of its own
    (and one head shared by the two), and a job sharing nothing. -> job -> its states."""
    base, shared_head = vec(1, 6), vec(2, 2)
    states = {
        "ft-a": [{"base": base, "head": vec(10 + s, 3), "shared": shared_head} for s in range(3)],
        "ft-b": [{"base": base, "head": vec(20 + s, 1), "zeros": torch.zeros(DU_N * 4)} for s in range(2)]
        + [{"base": base, "shared": shared_head}],
        "solo": [{"w": vec(30, 5)}],
    }
    with tsck.open_store(path, block_size=DU_BS, inline_threshold=1024) as s:
        for job, seq in states.items():
            for step, st in enumerate(seq):
                s.put_snapshot(st, ref=f"{job}/main", step=step)
    return states


def expected_numbers(path, states):
    """held / only bytes per job, from the tensors' block digests and the sizes on disk."""
    sizes = block_sizes_on_disk(path)
    sets = {job: set().union(*(block_digests(t) for st in seq for t in st.values())) for job, seq in states.items()}
    out = {}
    for job, mine in sets.items():
        others = set().union(*(v for k, v in sets.items() if k != job))
        out[job] = (sum(sizes[d] for d in mine), sum(sizes[d] for d in mine - others))
    return out, sizes


# ---------------------------------------------------------------- a store through a local tier
# ---------------------------------------------------------------- state builders
# The states the test files put, one builder per kind; a test's expectations (block counts,
# bytes stored) follow from the shapes and seeds, so a builder's defaults never change.

def tier_state(seed: int, n: int = 64, *, cols: int = 256, bias: bool = True, step: bool = False) -> dict:
    """Random floats from one generator seeded SEED (stored raw: lz4 does not shrink them),
    so each seed's put writes new blocks: "w" (N x COLS), "b" (300, with BIAS) and "step"
    (the seed as a tensor, with STEP)."""
    g = torch.Generator().manual_seed(seed)
    out = {"w": torch.randn(n, cols, generator=g)}
    if bias:
        out["b"] = torch.randn(300, generator=g)
    if step:
        out["step"] = torch.tensor(seed)
    return out


def edit_state(seed: int = 0) -> dict:
    """16 tensors of 256 KiB of random float32s (no codec shrinks them: stored bytes ~ raw
    bytes): a state whose one-tensor edits the dedup promises measure."""
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:02d}": torch.randn(64 * 1024, generator=g) for i in range(16)}


def peft_state(base_seed: int = 0, adapter_seed: int = 1, n: int = 120) -> dict:
    """As peft lays a fine-tune out: a frozen base tensor (64 KiB), then its small adapter
    (8 KiB), repeated N times; random float32s, from a generator each."""
    gb, ga = torch.Generator().manual_seed(base_seed), torch.Generator().manual_seed(adapter_seed)
    out = {}
    for i in range(n):
        out[f"layers.{i}.base.weight"] = torch.randn(16 * 1024, generator=gb)
        out[f"layers.{i}.lora_A.weight"] = torch.randn(2 * 1024, generator=ga)
    return out


def mlp_and_adamw(width: int, hidden: int) -> tuple:
    """An MLP (WIDTH -> HIDDEN -> 2, seed 0) and its AdamW after one step: the tensors,
    step counts and hyperparameters a model's and an optimizer's state_dict()s hold."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model, opt


def counter_state(i: int, n: int = 64) -> dict:
    """A small numpy state told apart by I: "w" (N float32s counting up from I) and "step"."""
    return {"w": np.arange(n, dtype=np.float32) + i, "step": i}


def nested_state(i: int, block: int) -> dict:
    """A state with a manifest node of its own ("sub") and a tensor every seed shares
    ("shared"); BLOCK: the store's block size, two blocks each for "shared" and "own"."""
    g = torch.Generator().manual_seed(i)
    sub = {"x": torch.randn(block // 4, generator=g), **{f"b{k}": torch.full((8,), float(k)) for k in range(100)}}
    return {"shared": torch.ones(2 * block // 4), "own": torch.randn(2 * block // 4, generator=g),
            "sub": sub, "i": i}


def open_tiered(tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=16 * 1024,
                           inline_threshold=256, **kw)


# ---------------------------------------------------------------- the CLI
def run_cli(*args, timeout=120, env=None) -> "subprocess.CompletedProcess":
    """`tsck ARGS` in a process of its own (forked by the zygote), as a user runs it: the
    environment child_env(cli=True) makes, plus ENV. A Backend among ARGS stands for its
    store URL, and its --refs and storage options travel in the environment (TSCK_REFS,
    TSCK_STORAGE_OPTIONS)."""
    import _zygote as zygote
    full = child_env(cli=True)
    argv = []
    for a in args:
        if hasattr(a, "cli_env"):
            full.update(a.cli_env())
            a = a.url
        argv.append(str(a))
    full.update(env or {})
    return zygote.run([sys.executable, "-m", "tensorstore_ck", *argv],
                      capture_output=True, text=True, timeout=timeout, env=full, cwd=str(REPO))


def run_clis(*arglists, timeout=120) -> list:
    """Several CLI runs at once (each imports torch: ~1.5 s)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(arglists)) as ex:
        return list(ex.map(lambda a: run_cli(*a, timeout=timeout), arglists))


def cli_here(capsys, *argv) -> tuple[int, str, str]:
    """`tsck ARGV` in this process (tensorstore_ck.cli.main): its exit status and what it
    printed, nothing printed before it."""
    from tensorstore_ck.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- a training loop the manager tests drive

def manager_state(seed: int = 0) -> tsck.TrainState:
    """A model, Adam (moments and a step count), a scheduler and a numpy Generator."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return tsck.TrainState(model=model, optimizer=opt, scheduler=sched,
                           numpy_generators={"aug": np.random.default_rng(seed)})


def train_step(ts: tsck.TrainState, scale: float = 1.0) -> None:
    """One step that draws from every RNG stream the state captures."""
    model, opt = ts.components["model"], ts.components["optimizer"]
    x = torch.randn(8, 4) * scale + float(ts.numpy_generators["aug"].standard_normal())
    loss = model(x).pow(2).mean() + float(np.random.rand()) * 0
    opt.zero_grad()
    loss.backward()
    opt.step()
    ts.components["scheduler"].step()


def pruning_manager(store, model, keep: int, *, async_: bool = False) -> tsck.CheckpointManager:
    """A manager of job "run" that snapshots MODEL at every step and prunes the job to its
    KEEP newest snapshots."""
    return tsck.CheckpointManager(store, job="run", state=tsck.TrainState(model=model), every_steps=1,
                                  retention=tsck.Retention(keep_last=keep), async_=async_)


def frozen_state(ts: tsck.TrainState) -> dict:
    """A copy of everything the state would snapshot (state_dict() returns live tensors)."""
    return copy.deepcopy(ts.state_dict())


def run_steps(mgr, ts, steps, *, scale: float = 1.0, record: dict | None = None) -> None:
    """Train STEPS under the manager; RECORD: the state frozen at each step it snapshots."""
    for n in steps:
        train_step(ts, scale)
        mgr.step(n)
        if record is not None and mgr.every_steps and n % mgr.every_steps == 0:
            record[n] = frozen_state(ts)
