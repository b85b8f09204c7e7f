"""Every definition in tensorstore_ck/ is used: by the package, or by someone named in
tests/dead_code_whitelist.py (the public API's users, torch, transformers, Lightning,
pickle, the tests).

vulture lists the functions, methods, classes, attributes, variables and imports that no
code names, and the code it cannot reach; grep cannot keep up with that as the package
grows. At confidence 60 (vulture's lowest: every finding) a new finding fails here with
its file and line: remove the definition, or add its name to the whitelist with who
uses it. An entry of the whitelist that answers no finding any more fails too, so the
list does not keep a name alive after its definition went.

Fast: parses the package's source, imports nothing of it.
"""
from __future__ import annotations

import ast
from pathlib import Path

from vulture import Vulture

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tensorstore_ck"
WHITELIST = Path(__file__).resolve().parents[1] / "dead_code_whitelist.py"
MIN_CONFIDENCE = 60


def _unused(*paths: Path) -> list:
    v = Vulture()
    v.scavenge([str(p) for p in paths])
    return list(v.get_unused_code(min_confidence=MIN_CONFIDENCE))


def _whitelisted() -> set[str]:
    """The names the whitelist uses (each entry is `_.name`)."""
    tree = ast.parse(WHITELIST.read_text())
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "_"}


def _where(item) -> str:
    return f"{Path(item.filename).resolve().relative_to(REPO)}:{item.first_lineno}: {item.message} " \
           f"({item.confidence}% confidence)"


def test_no_unreferenced_definitions():
    found = _unused(PACKAGE, WHITELIST)
    assert not found, (
        f"{len(found)} definition(s) in tensorstore_ck/ that nothing uses: remove them, or name them in "
        f"tests/dead_code_whitelist.py with who uses them\n" + "\n".join(_where(i) for i in found))


def test_every_whitelist_entry_answers_a_finding():
    names = _whitelisted()
    assert len(names) > 20  # the parse above found the entries
    found = {i.name for i in _unused(PACKAGE)}
    stale = sorted(names - found)
    assert not stale, ("tests/dead_code_whitelist.py names what the package uses itself, or defines no "
                       f"more (remove the entries): {stale}")


def test_the_check_finds_an_unused_definition(tmp_path):
    """The scan above must not pass by finding nothing: a module with an unused function,
    method and import is reported, whitelisted names aside."""
    mod = tmp_path / "mod.py"
    mod.write_text("import os\n\n\ndef used():\n    return 1\n\n\ndef dead():\n    return used()\n\n\n"
                   "class C:\n    def gone(self):\n        pass\n\n\nC()\n")
    assert sorted(i.name for i in _unused(mod)) == ["dead", "gone", "os"]
    wl = tmp_path / "wl.py"
    wl.write_text("_.gone  # called by name\n")
    assert sorted(i.name for i in _unused(mod, wl)) == ["dead", "os"]
