"""Every `tsck` command against every planted fault: each ends in
bounded time with exit 0, 1 or 2, never a Python traceback; a nonzero exit says why
in one `tsck: ...` line on stderr (exit 2) or in a report (fsck's findings, exit 1).

One pristine local store is built once and copied per fault; the faults are planted
in the files (missing, corrupt or truncated objects, a stray name, a FIFO, a folder
or a link to /dev/zero in place of a block, node, commit, tag object or tsck.json,
a lost or corrupt ref table, ...). Each command line runs in a process of its own,
forked from a driver that imported tensorstore_ck once (tests/helpers/cli_matrix.py:
the child runs cli.main as `python -m tensorstore_ck` does), under a timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.core.walk import walk_commit

import _zygote as zygote
from _util import nested_state, plant_special

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 4096
TIMEOUT = 30

# The read-only commands first: each fault's store is shared by all of them, in this order.
COMMANDS = [
    ["refs"], ["log", "j/main"], ["show", "golden", "--json"], ["du"], ["diff", "j/main@1", "j/main"],
    ["fsck"], ["fsck", "--quick", "--json"], ["gc", "--dry-run"], ["tag", "t2", "j/main"], ["pin", "j/main"],
    ["unpin", "j/main"], ["ls", "j/main"], ["checkout", "j/main", "{out}/w.safetensors"], ["retention", "j"],
    ["retention", "j", "--keep-last", "2"], ["forget", "j/main@1"], ["untag", "golden"], ["delete-ref", "j/exp"],
    ["fsck", "--repair"], ["gc"], ["recover"], ["import", "imp/main", "{out}/w.safetensors"], ["refs", "--json"],
]


def _rewrite(p: str, fn) -> None:
    with open(p, "rb") as f:
        data = f.read()
    with open(p, "wb") as f:
        f.write(fn(data))


def _huge(p: str) -> None:
    with open(p, "r+b") as f:
        f.truncate(1 << 40)  # sparse: 1 TB that costs no disk


# fault -> (plant(store path, keys), whether fsck must report findings: exit 1)
FAULTS = {
    "missing_block": (lambda p, k: os.unlink(os.path.join(p, k["block"])), True),
    "corrupt_block": (lambda p, k: _rewrite(os.path.join(p, k["block"]), lambda d: d[:-1] + bytes([d[-1] ^ 1])), True),
    "truncated_block": (lambda p, k: _rewrite(os.path.join(p, k["block"]), lambda d: d[: len(d) // 2]), True),
    "huge_block": (lambda p, k: _huge(os.path.join(p, k["block"])), True),
    "stray_under_blocks": (lambda p, k: _write(p, "blocks/00/backup-of-" + "0" * 54, b"x"), True),
    "fifo_block": (lambda p, k: plant_special(os.path.join(p, k["block"]), "fifo"), True),
    "dir_block": (lambda p, k: plant_special(os.path.join(p, k["block"]), "dir"), True),
    "zero_block": (lambda p, k: plant_special(os.path.join(p, k["block"]), "zero"), True),
    "fifo_node": (lambda p, k: plant_special(os.path.join(p, k["node"]), "fifo"), True),
    "dir_node": (lambda p, k: plant_special(os.path.join(p, k["node"]), "dir"), True),
    "huge_node": (lambda p, k: _huge(os.path.join(p, k["node"])), True),
    "truncated_commit": (lambda p, k: _rewrite(os.path.join(p, k["commit"]), lambda d: d[: len(d) // 2]), True),
    "fifo_commit": (lambda p, k: plant_special(os.path.join(p, k["commit"]), "fifo"), True),
    "dir_commit": (lambda p, k: plant_special(os.path.join(p, k["commit"]), "dir"), True),
    "zero_commit": (lambda p, k: plant_special(os.path.join(p, k["commit"]), "zero"), True),
    "zero_tag": (lambda p, k: plant_special(os.path.join(p, k["tag"]), "zero"), False),
    "fifo_tag": (lambda p, k: plant_special(os.path.join(p, k["tag"]), "fifo"), False),
    "corrupt_tag": (lambda p, k: _write(p, k["tag"], b"\xff{not a tag"), False),
    "corrupt_marker": (lambda p, k: _write(p, "tsck.json", b"{not json"), None),
    "missing_marker": (lambda p, k: os.unlink(os.path.join(p, "tsck.json")), None),
    "fifo_marker": (lambda p, k: plant_special(os.path.join(p, "tsck.json"), "fifo"), None),
    "zero_marker": (lambda p, k: plant_special(os.path.join(p, "tsck.json"), "zero"), None),
    "dir_marker": (lambda p, k: plant_special(os.path.join(p, "tsck.json"), "dir"), None),
    "huge_marker": (lambda p, k: _huge(os.path.join(p, "tsck.json")), None),
    "missing_ref_table": (lambda p, k: shutil.rmtree(os.path.join(p, "refs.lmdb")), None),
    "corrupt_lmdb": (lambda p, k: _rewrite(os.path.join(p, "refs.lmdb", "data.mdb"),
                                           lambda d: d[:4096] + bytes(b ^ 0x5A for b in d[4096:])), None),
    "truncated_lmdb": (lambda p, k: _rewrite(os.path.join(p, "refs.lmdb", "data.mdb"), lambda d: d[:100]), None),
    "fifo_lmdb": (lambda p, k: plant_special(os.path.join(p, "refs.lmdb", "data.mdb"), "fifo"), None),
    "tmp_is_a_file": (lambda p, k: (shutil.rmtree(os.path.join(p, "tmp"), ignore_errors=True),
                                    _write(p, "tmp", b"not a folder")), False),
}


def _write(p: str, key: str, data: bytes) -> None:
    path = os.path.join(p, key)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    # Only the faults whose tests were selected (-k): one driver run serves them all.
    wanted = {it.callspec.params["fault"] for it in request.session.items
              if it.module is request.module and hasattr(it, "callspec")}
    base = tmp_path_factory.mktemp("cli-faults")
    pristine = str(base / "pristine")
    with tsck.open_store(pristine, block_size=BLOCK, inline_threshold=256) as s:
        roots = [s.put_snapshot(nested_state(i, BLOCK), "j/main", step=i).root for i in (1, 2, 3)]
        s.put_snapshot(nested_state(10, BLOCK), "j/exp", step=10)
        s.tag("golden", "j/main@2")
        s.set_retention("j", tsck.Retention(keep_last=1))
        tip = list(walk_commit(s.assets, bytes.fromhex(roots[-1])))
        key = lambda o: s.assets.object_key(o.kind + "s", o.digest)  # noqa: E731
        keys = {"commit": key(tip[0]),
                "node": next(key(o) for o in tip if o.kind == "node" and o.path == "['sub']"),
                "block": next(key(o) for o in tip if o.kind == "block" and o.path == "['own']"),
                "tag": "tags/" + b"golden".hex()}
    runs = []
    for fault, (plant, _finds) in FAULTS.items():
        if fault not in wanted:
            continue
        where = str(base / fault)
        shutil.copytree(pristine, where, symlinks=True)
        plant(where, keys)
        out = base / (fault + "-out")  # where checkout writes (and import reads) a file
        out.mkdir()
        for i, cmd in enumerate(COMMANDS):
            runs.append({"id": f"{fault}:{i}", "argv": [cmd[0], where, *(a.replace("{out}", str(out))
                                                                           for a in cmd[1:])]})
    spec, out = base / "spec.json", base / "out.json"
    spec.write_text(json.dumps({"timeout": TIMEOUT, "runs": runs}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # this process's tensorstore_ck
    zygote.run([sys.executable, os.path.join(HERE, "helpers", "cli_matrix.py"), str(spec), str(out)],
               check=True, timeout=len(runs) * (TIMEOUT + 5), env=env)
    got: dict = {}
    for r in json.loads(out.read_text()):
        got.setdefault(r["id"].split(":")[0], []).append(r)
    yield got
    for fault in wanted:  # sparse 1 TB files and FIFOs: gone with the test, not left in /tmp
        shutil.rmtree(base / fault, ignore_errors=True)
        shutil.rmtree(base / (fault + "-out"), ignore_errors=True)


def _problem(r: dict) -> str | None:
    """What is wrong with one command's outcome, or None."""
    cmd = " ".join(r["argv"][:1] + r["argv"][2:])
    if r["timed_out"]:
        return f"`tsck {cmd}` still ran after {TIMEOUT} s"
    if r["rc"] not in (0, 1, 2):
        return f"`tsck {cmd}` exit {r['rc']}: {r['stderr'][-2000:]}"
    if "Traceback" in r["stderr"]:
        return f"`tsck {cmd}` printed a traceback:\n{r['stderr'][-3000:]}"
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    if r["rc"] == 2 and (len(lines) != 1 or not lines[0].startswith("tsck: error: ")):
        return f"`tsck {cmd}` exit 2 without one `tsck: error:` line: {r['stderr'][-2000:]!r}"
    if r["rc"] == 1:
        if any(not ln.startswith("tsck: ") for ln in lines):
            return f"`tsck {cmd}` exit 1 with stray stderr: {r['stderr'][-2000:]!r}"
        if not lines and not r["stdout"].strip():
            return f"`tsck {cmd}` exit 1 and said nothing"
    return None


@pytest.mark.slow  # ~0.3 s per command line: a few minutes in all
@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_command_against_a_planted_fault(results, fault):
    runs = results[fault]
    assert len(runs) == len(COMMANDS)
    problems = [p for p in map(_problem, runs) if p]
    assert not problems, "\n\n".join(problems)
    finds = FAULTS[fault][1]
    fsck = {" ".join(r["argv"][2:] or ["(full)"]): r["rc"] for r in runs if r["argv"][0] == "fsck"}
    if finds is True:  # damaged objects are findings of the first full fsck (exit 1), not an error
        assert fsck["(full)"] == 1, (fault, runs[COMMANDS.index(["fsck"])])
    elif finds is None:  # a store that cannot be opened: one error line, every command alike (recover
        #                  rebuilds a lost ref table, so what follows it may work again)
        before = runs[:COMMANDS.index(["recover"])]
        # exit 2 for what is not a store (NotAStore), 1 for what cannot be read (StorageError)
        assert len({r["rc"] for r in before}) == 1 and before[0]["rc"] in (1, 2), \
            [(r["argv"][0], r["rc"], r["stderr"]) for r in before]
