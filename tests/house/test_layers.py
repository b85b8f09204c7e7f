"""The package's structure, checked: import-linter's layer contracts (pyproject.toml,
[tool.importlinter]) and the rules a module graph cannot express (AST checks): no
torch.distributed at import time, keys only in assets.py, no module below the
Store facade receiving a Store (they are given a Core: tensorstore_ck/core/core.py), and no
module reaching for another's private names."""
from __future__ import annotations

import ast
import functools
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _zygote as zygote

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tensorstore_ck"
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.skip(f"import-linter is not installed beside {sys.executable} (it is in the test extras)")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return zygote.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    r = _lint(ROOT, ROOT)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("module, planted", [
    ("format/tree.py", "from .. import cli  # planted\n"),             # an import of the CLI
    ("storage/base.py", "from ..format import tree  # planted\n"),     # storage knowing manifests
    ("core/assets.py", "from .. import store  # planted\n"),                 # an upward import
])
def test_a_broken_contract_fails(tmp_path, module, planted):
    """The contracts bite: the same check on a copy with one forbidden import fails."""
    shutil.copytree(PKG, tmp_path / "tensorstore_ck", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "tensorstore_ck" / module
    src = target.read_text()
    i = src.index("\nfrom __future__ import annotations\n") + len("\nfrom __future__ import annotations\n")
    target.write_text(src[:i] + planted + src[i:])
    r = _lint(tmp_path, tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout[-3000:]


def _modules():
    for p in sorted(PKG.rglob("*.py")):
        yield p.relative_to(PKG).as_posix(), ast.parse(p.read_text(), filename=str(p))


def _module_level_imports(tree: ast.Module):
    """Imports executed when the module is imported (not those inside functions)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ClassDef):
            todo.extend(node.body)


def test_the_core_does_not_import_torch_distributed_at_import_time():
    """Only the DCP adapter (dcp/) may; dist/ imports it when a collective runs."""
    bad = []
    for name, tree in _modules():
        if name.startswith("dcp/"):
            continue
        for node in _module_level_imports(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                bad.append(f"{name}:{node.lineno}")
    assert not bad, bad


def test_only_assets_knows_the_object_keys():
    """Nothing outside assets.py (and the storage backends it drives) imports a key helper."""
    helpers = {"block_key", "node_key", "commit_key", "tag_key", "KIND_PREFIX"}
    bad = []
    for name, tree in _modules():
        if name == "core/assets.py" or name.startswith("storage/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and helpers & {a.name for a in node.names}:
                bad.append(f"{name}:{node.lineno}")
    assert not bad, bad


def _below_the_facade(root: Path) -> list[Path]:
    """The files of the modules in the layers under "store" in pyproject.toml's layer contract."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, where installed (pip's own vendored copy is not public)
        tomllib = pytest.importorskip("tomli")
    layers = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    files = []
    for layer in layers[layers.index("store") + 1:]:
        for name in (m.strip() for m in re.split(r"[|:]", layer)):
            p = root / "tensorstore_ck" / name
            files += sorted(p.rglob("*.py")) if p.is_dir() else [p.with_suffix(".py")]
    return files


def _store_receivers(root: Path) -> list[str]:
    """Where a module below the facade takes a Store: a parameter named `store` or annotated
    with Store, or an import of the name Store (under TYPE_CHECKING too, which a graph of
    run-time imports may not weigh). Passing the Store down would let a lower layer reach
    back up into it at run time while its imports look clean."""
    bad = []
    for f in _below_the_facade(root):
        assert f.exists(), f"{f}: named in the layer contract, not found"
        where = f.relative_to(root / "tensorstore_ck").as_posix()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                    ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg == "store" or re.search(r"\bStore\b", ann):
                        bad.append(f"{where}:{node.lineno}: parameter {arg.arg}{': ' + ann if ann else ''}")
            elif isinstance(node, ast.ImportFrom) and "Store" in {a.name for a in node.names}:
                bad.append(f"{where}:{node.lineno}: imports Store")
    return bad


def test_no_module_below_the_facade_receives_a_store():
    """gc, fsck, recover, usage, listing, dist, publish ... are given a Core (and what
    else they need as explicit arguments), never the Store."""
    assert not _store_receivers(ROOT), _store_receivers(ROOT)


@pytest.mark.parametrize("module, planted", [
    ("maintain/gc.py", "def planted(store, n: int) -> int:\n    return n\n"),                  # named store
    ("maintain/fsck.py", "def planted(x: \"Store\") -> None:\n    pass\n"),                    # annotated Store
    ("read/listing.py", "planted = lambda *, store=None: store\n"),                         # a keyword lambda
    ("storage/base.py", "if False:\n    from ..store import Store  # noqa: F401\n"),  # an import of it
])
def test_a_store_received_below_the_facade_fails(tmp_path, module, planted):
    """The check bites: a copy of the package with one planted receiver fails it."""
    shutil.copytree(PKG, tmp_path / "tensorstore_ck", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "tensorstore_ck" / module
    target.write_text(target.read_text() + "\n\n" + planted)
    bad = _store_receivers(tmp_path)
    assert len(bad) == 1 and bad[0].startswith(module + ":"), bad


# The object namespaces of a store (assets.py's keys). tmp/ is storage's own (BlockStore.TEMP_PREFIX).
_NAMESPACES = ("blocks", "nodes", "commits", "tags", "quarantine")


def _literal_parts(node) -> list | None:
    """The pieces of a string expression in order: text for a literal piece, None for a
    computed one; None if `node` is not a string literal, f-string or + of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def _fans_out(node: ast.JoinedStr) -> bool:
    """An f-string with a '/'-separated `x[:2]` piece: a key's two-digit fan-out directory."""
    vals = node.values
    for i, v in enumerate(vals):
        if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Subscript):
            sl = v.value.slice
            if isinstance(sl, ast.Slice) and sl.lower is None and isinstance(sl.upper, ast.Constant) \
                    and sl.upper.value == 2:
                after = vals[i + 1] if i + 1 < len(vals) else None
                if isinstance(after, ast.Constant) and after.value.startswith("/"):
                    return True
    return False


# The contract suites (tensorstore_ck/testing/) are tests shipped in the package: they make
# keys as test data and look at a table's transactions, as the tests in tests/ do.
TESTING = "testing/"


def _key_constructions(pkg: Path) -> list[str]:
    """Where a module other than assets.py writes an object key: a string that begins with
    an object namespace and a '/' ("blocks/...", f"tags/{...}", "nodes/" + ...), or an
    f-string with a key's fan-out directory (f"{kind}/{h[:2]}/{h}"). Docstrings aside."""
    bad = []
    for p in sorted(pkg.rglob("*.py")):
        name = p.relative_to(pkg).as_posix()
        if name != "core/assets.py" and not name.startswith(TESTING):
            bad += _file_key_constructions(name, p.read_text())
    return sorted(set(bad))


# Per file and its text: the planted copies of the package re-read only the file planted in.
@functools.lru_cache(maxsize=None)
def _file_key_constructions(name: str, source: str) -> tuple[str, ...]:
    tree = ast.parse(source, filename=name)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    bad = []
    for node in ast.walk(tree):
        if id(node) in docs:
            continue
        parts = _literal_parts(node)
        if parts is None:
            continue
        text = "".join("\0" if x is None else x for x in parts)  # \0: a computed piece
        if "/" in text and text.partition("/")[0] in _NAMESPACES:
            bad.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.JoinedStr) and _fans_out(node):
            bad.append(f"{name}:{node.lineno}")
    return tuple(bad)


def test_no_module_but_assets_builds_an_object_key():
    """Keys are made in assets.py alone; a backend places the keys it is given under its
    URL (storage/s3.py: S3BlockStore._s3_key) and builds none of its own."""
    assert _key_constructions(PKG) == []


@pytest.mark.parametrize("module, planted", [
    ("storage/s3.py", 'def _block(d):\n    return f"blocks/{d.hex()[:2]}/{d.hex()}"  # planted\n'),
    ("storage/s3.py", 'TAGS = "tags/"  # planted\n'),
    ("maintain/gc.py", 'def _key(kind, h):\n    return f"{kind}/{h[:2]}/{h}"  # planted\n'),
    ("refs/base.py", 'def _tag(name):\n    return "tags/" + name.encode().hex()  # planted\n'),
])
def test_a_key_built_outside_assets_fails(tmp_path, module, planted):
    """The check bites: the same check on a copy with one key built elsewhere fails."""
    shutil.copytree(PKG, tmp_path / "tensorstore_ck", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "tensorstore_ck" / module
    target.write_text(target.read_text() + "\n\n" + planted)
    line = next(i for i, text in enumerate(target.read_text().splitlines(), 1) if "# planted" in text)
    assert _key_constructions(tmp_path / "tensorstore_ck") == [f"{module}:{line}"]


# -- private names stay in their module ------------------------------------------------
# A module uses another's calls through its public names (and its roles: roles.py); a
# `_name` is its own module's business. Other libraries' private names a module reaches
# for, by the expression before the dot:
FOREIGN_PRIVATE = {
    ("cli/parser.py", "parser"), ("cli/parser.py", "sub"),  # argparse's _actions: the subcommands' own options
    ("lightning.py", "sys"), ("store.py", "sys"), ("train/outcomes.py", "sys"), ("tier/outage.py", "sys"),  # sys._getframe
    ("write/saver.py", "os"),  # os._exit: the saver ends at once when its training process is gone
    ("train/preempt.py", "os"),  # os._exit: from the watchdog thread, the end the signal's default action would give
    ("lightning.py", "fs"),  # fsspec's _parent
    ("read/read.py", "torch"),  # torch's quantized tensor constructors
    ("write/plancache.py", "torch"),  # torch._foreach_copy_: many tensors copied in one call (torch.optim's foreach path)
    ("collective/channel.py", "dist.distributed_c10d"),  # the default c10d store
    ("storage/wrappers.py", "self._sem"),  # threading.Semaphore's _initial_value
    # the Accelerator's _models, _optimizers, _schedulers, _dataloaders, _custom_objects: what its
    # save_state reads (accelerate has no public list of the objects it prepared or registered)
    ("accelerate.py", "acc"), ("accelerate.py", "accelerator"),
}
# A reach-in across the package's own modules that stands (none today).
KNOWN_REACH_INS: set = set()


def _is_package_import(node: ast.ImportFrom) -> bool:
    return bool(node.level) or (node.module or "").split(".")[0] == "tensorstore_ck"


def _private_reach_ins(pkg: Path) -> list[str]:
    """`from X import _name` of a module of the package, and `obj._name` where `_name` is
    not one this module defines (a function, class, or an attribute or name it assigns):
    another module's private name, or a private attribute of an object made elsewhere."""
    bad = []
    for p in sorted(pkg.rglob("*.py")):
        if not p.relative_to(pkg).as_posix().startswith(TESTING):
            bad += _file_reach_ins(p.relative_to(pkg).as_posix(), p.read_text())
    return sorted(bad)


@functools.lru_cache(maxsize=None)
def _file_reach_ins(name: str, source: str) -> tuple[str, ...]:
    bad = []
    tree = ast.parse(source, filename=name)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_package_import(node):
            bad += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base in ("self", "cls", "super()") or node.attr in own or (name, base) in FOREIGN_PRIVATE \
                    or (name, f"{base}.{node.attr}") in KNOWN_REACH_INS:
                continue
            bad.append(f"{name}:{node.lineno}: {base}.{node.attr}")
    return tuple(bad)


def test_no_module_reaches_for_another_modules_private_names():
    assert _private_reach_ins(PKG) == []


@pytest.mark.parametrize("module, planted, found", [
    ("refs/base.py", "from .gcstate import _gc_state  # planted\n", "import _gc_state"),
    ("maintain/gc.py", "from ..refs.gcstate import _gc_state  # planted\n", "import _gc_state"),
    ("maintain/fsck.py", "def planted(core):\n    return core.refs._read  # planted\n", "core.refs._read"),
])
def test_a_private_reach_in_fails(tmp_path, module, planted, found):
    """The check bites: the same check on a copy with one reach-in fails."""
    shutil.copytree(PKG, tmp_path / "tensorstore_ck", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "tensorstore_ck" / module
    target.write_text(target.read_text() + "\n\n" + planted)
    line = next(i for i, text in enumerate(target.read_text().splitlines(), 1) if "# planted" in text)
    assert _private_reach_ins(tmp_path / "tensorstore_ck") == [f"{module}:{line}: {found}"]


def test_the_store_asks_its_tier_not_whether_it_has_one():
    """The Store holds a tier always (a LocalTier, or tier/none.py's NoTier): the package
    asks it, never `tier is None`, which is how calls came to answer differently with a
    tier and without; the collective put holds a CollectiveTier or a NoCollective alike,
    and open_store's options are a _Tier or a _NoTier. Outside tier/ no site is left."""
    sites = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith("tier/"):
            continue
        n = len(re.findall(r"\btier is (?:not )?None\b", p.read_text()))
        if n:
            sites[rel] = n
    assert sites == {}


def _proxies(pkg: Path) -> list[str]:
    """Classes that pass what they do not define on to another object by __getattr__."""
    return [f"{p.relative_to(pkg).as_posix()}:{source[:m.start()].count(chr(10)) + 1}"
            for p in sorted(pkg.rglob("*.py")) for source in [p.read_text()]
            for m in re.finditer(r"^\s+def __getattr__\(self\b", source, re.M)]


def test_no_class_forwards_what_it_does_not_define():
    """One seam per mechanism: a tier's reads are one chain of sources (tier/reads.py's
    ReadChain), the lazily opened remote storage forwards the BlockStore calls by name, and
    no class hands unknown attributes on by __getattr__ (what let a proxy answer for an
    object it was not). Module-level __getattr__ (lazy imports) is not a proxy."""
    assert _proxies(PKG) == []


def test_a_forwarding_class_is_found(tmp_path):
    planted = tmp_path / "tensorstore_ck"
    planted.mkdir()
    (planted / "m.py").write_text("class P:\n    def __getattr__(self, name):\n        return 1\n")
    assert _proxies(planted) == ["m.py:2"]
