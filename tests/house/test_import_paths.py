"""Every import path a user is shown still works: the names README.md, docs/ and
examples/ import (`from tensorstore_ck.X import Y`, `tsck.Y`), and the global that version-2
Lightning pointer files pickle (docs/FORMAT.md), which must stay at its path for as long as
such files are read. The package's folders are its own business; these are the promise."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FROM = re.compile(r"^\s*from (tensorstore_ck(?:\.\w+)*) import \(?([\w, ]+)\)?\s*(?:#.*)?$", re.MULTILINE)
ATTR = re.compile(r"\btsck\.([A-Za-z_]\w*)\b(?!\s*=)")
# What version-2 pointer files name: unpickling one with weights_only=False imports it.
PICKLED = [("tensorstore_ck.ckpt_pointer", "load_with_tensorstore_ck_lightning_load_checkpoint")]


def _shown() -> list[Path]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return docs + sorted((REPO / "examples").glob("*.py"))


def _imports() -> set[tuple[str, str]]:
    got = set()
    for p in _shown():
        for module, names in FROM.findall(p.read_text()):
            got |= {(module, n.strip().split(" as ")[0]) for n in names.split(",") if n.strip()}
    return got


def _attributes() -> set[str]:
    # (tsck.json is the store's marker file, not a name)
    return {a for p in _shown() for a in ATTR.findall(p.read_text())} - {"json"}


def test_the_docs_show_imports_to_check():
    imports, attrs = _imports(), _attributes()
    assert {m for m, _ in imports} >= {"tensorstore_ck.dcp", "tensorstore_ck.lightning", "tensorstore_ck.metrics",
                                      "tensorstore_ck.testing", "tensorstore_ck.storage"}, imports
    assert {"open_store", "CheckpointManager", "TrainState"} <= attrs, attrs


@pytest.mark.parametrize("module,name", sorted(_imports()) + PICKLED)
def test_an_import_the_docs_show_works(module, name):
    if module == "tensorstore_ck.lightning":
        pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    if module == "tensorstore_ck.hf" or name == "hf":
        pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    mod = importlib.import_module(module)
    assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None, (module, name)


def test_every_tsck_name_the_docs_use_is_there():
    import tensorstore_ck as tsck
    missing = sorted(a for a in _attributes() if not hasattr(tsck, a))
    assert not missing, f"tsck.<name> shown in the docs but not in the package: {missing}"
