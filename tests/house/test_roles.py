"""The roles of tensorstore_ck/core/roles.py are played by the classes that play them: every
member of each Protocol exists on each concrete class with a signature that accepts
every call the Protocol allows, so renaming a call on either side fails here."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Protocol

import pytest

from tensorstore_ck.core import roles
from tensorstore_ck.refs import RefTable

TABLES = ("tensorstore_ck.refs.lmdb.LmdbRefTable", "tensorstore_ck.refs.memory.MemoryRefTable",
          "tensorstore_ck.refs.postgres.PostgresRefTable")

# role -> the classes (dotted names) that play it; a "Class.method" plays a callable role.
PLAYERS = {
    roles.ObjectReader: ("tensorstore_ck.core.assets.Assets", "tensorstore_ck.tier.reads.ReadChain"),
    roles.WalkReader: ("tensorstore_ck.core.assets.Assets", "tensorstore_ck.tier.reads.ReadChain"),
    roles.WrittenListener: ("tensorstore_ck.tier.uploader.Uploader.tee",),
    roles.TierRows: ("tensorstore_ck.refs.tiertable.TierTable",),
    roles.Executor: ("tensorstore_ck.write.executor.Threads", "tensorstore_ck.write.saver.SaverExecutor"),
    "tensorstore_ck.tier.holds.Uploads": ("tensorstore_ck.tier.uploader.Uploader",),
    **{role: TABLES for role in (roles.CatalogReader, roles.RefPublisher, roles.RefNaming, roles.GcTable,
                                 roles.Rebuild, roles.UploadQueue, roles.TableBinding)},
}

# RefTable's calls that no module of the package makes (the tests and the harness do):
# they belong to no role.
OUTSIDE_ROLES = {"catalog_put", "publication_order"}


def _load(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _members(role: type) -> dict[str, object]:
    """The role's members, its Protocol bases' included: name -> function, or None for
    a data member."""
    out: dict[str, object] = {}
    for c in reversed(role.__mro__):
        if c in (object, Protocol) or Protocol not in c.__mro__ or c.__module__ == "typing":
            continue
        for name in c.__dict__.get("__annotations__", {}):
            out[name] = None
        for name, v in vars(c).items():
            if isinstance(v, property):  # a data member read through a property
                out[name] = None
        for name, v in vars(c).items():
            if inspect.isfunction(v) and (not name.startswith("_") or name == "__call__"):
                out[name] = v
    return out


def _params(fn, bound: bool) -> list[inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    return ps[1:] if bound else ps


def _impl(owner, name: str):
    """(function, whether its first parameter is the instance) of `name` on `owner`."""
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return raw.__func__, False
    if isinstance(raw, classmethod):
        return raw.__func__, True
    return raw, True


def incompatible(want, have, have_bound: bool = True) -> str | None:
    """Why `have` cannot take every call `want` (a Protocol member) allows, or None."""
    wp, hp = _params(want, True), _params(have, have_bound)
    K = inspect.Parameter
    var_pos = any(p.kind is K.VAR_POSITIONAL for p in hp)
    var_kw = any(p.kind is K.VAR_KEYWORD for p in hp)
    positional = [p for p in hp if p.kind in (K.POSITIONAL_ONLY, K.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in hp if p.kind in (K.POSITIONAL_OR_KEYWORD, K.KEYWORD_ONLY)}
    used = set()
    for i, p in enumerate(wp):
        if p.kind is K.VAR_KEYWORD:
            if not var_kw:
                return "takes no **keywords"
            continue
        if p.kind is K.VAR_POSITIONAL:
            if not var_pos:
                return "takes no *arguments"
            continue
        if p.kind is K.POSITIONAL_OR_KEYWORD:
            got = positional[i] if i < len(positional) else None
            if got is None and not (var_pos and var_kw):
                return f"has no positional parameter {p.name!r} at {i}"
            if got is not None and got.name != p.name:
                return f"names its parameter {i} {got.name!r}, not {p.name!r}"
        else:  # keyword-only
            got = by_name.get(p.name)
            if got is None and not var_kw:
                return f"takes no keyword {p.name!r}"
        if got is not None:
            used.add(got.name)
            if p.default is not K.empty and got.default is K.empty:
                return f"requires {p.name!r}, which the role lets callers leave out"
    for p in hp:
        if p.name not in used and p.default is K.empty and p.kind not in (K.VAR_POSITIONAL, K.VAR_KEYWORD):
            return f"requires {p.name!r}, which the role does not pass"
    return None


CASES = [(role, player) for role, players in PLAYERS.items() for player in players]


def _set_in_init(owner, name: str) -> bool:
    """A data member the class sets on each instance in its __init__ (self.name = ...)."""
    init = getattr(owner, "__init__", None)
    try:
        src = inspect.getsource(init)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{name}\b[^=\n]*=", src) is not None


@pytest.mark.parametrize("role,player", CASES, ids=[f"{_load(r).__name__ if isinstance(r, str) else r.__name__}-"
                                                    f"{p.rsplit('.', 1)[-1]}" for r, p in CASES])
def test_player_has_every_member_of_its_role(role, player):
    role = _load(role) if isinstance(role, str) else role
    owner = _load(player)
    members = _members(role)
    assert members, role
    if inspect.isfunction(owner):  # a method that plays a callable role
        assert set(members) == {"__call__"}
        why = incompatible(members["__call__"], owner)
        assert why is None, f"{player} {why} ({role.__name__}.__call__)"
        return
    for name, want in members.items():
        if want is None:
            assert hasattr(owner, name) or _set_in_init(owner, name), f"{player} lacks {name!r} ({role.__name__})"
            continue
        assert hasattr(owner, name), f"{player} lacks {name!r} ({role.__name__})"
        have, bound = _impl(owner, name)
        assert callable(have), f"{player}.{name} is not callable ({role.__name__})"
        why = incompatible(want, have, bound)
        assert why is None, f"{player}.{name} {why} ({role.__name__}.{name})"


def test_every_reftable_call_the_package_makes_belongs_to_a_role():
    in_roles = set()
    for role in PLAYERS:
        if not isinstance(role, str):
            in_roles |= set(_members(role))
    public = {n for n in dir(RefTable) if not n.startswith("_") and callable(getattr(RefTable, n))}
    assert public - in_roles == OUTSIDE_ROLES
    assert not (OUTSIDE_ROLES & in_roles)


def test_the_checker_refuses_what_a_role_cannot_call():
    class Role(Protocol):
        def f(self, a: int, *, b: int = 0) -> None: ...

    def renamed(self, x, *, b=0): ...

    def keyword_missing(self, a): ...

    def default_dropped(self, a, *, b): ...

    def requires_more(self, a, c, *, b=0): ...

    def fine(self, a, *, b=1, c=None, **kw): ...

    want = Role.f
    assert "names its parameter 0" in incompatible(want, renamed)
    assert "takes no keyword 'b'" in incompatible(want, keyword_missing)
    assert "lets callers leave out" in incompatible(want, default_dropped)
    assert "requires 'c'" in incompatible(want, requires_more)
    assert incompatible(want, fine) is None


PKG = Path(__file__).resolve().parents[2] / "tensorstore_ck"
ROLE_NAMES = [n for n in roles.__all__]


def _role_sites(pkg: Path) -> tuple[list[str], dict[str, int]]:
    """(roles annotated on a name inside a body, `x: Role = ...`; how many signatures name
    each role, `Role` or `Core[Role]` in a def's parameters)."""
    inside, named = [], dict.fromkeys(ROLE_NAMES, 0)
    body = re.compile(rf"^\s+\w+: (?:{'|'.join(ROLE_NAMES)}) = ", re.M)
    sig = re.compile(r"^\s*def \w+\((.*?)\)\s*(?:->[^:]*)?:", re.M | re.S)
    for p in sorted(pkg.rglob("*.py")):
        if p.name == "roles.py":
            continue
        src = p.read_text()
        rel = p.relative_to(pkg).as_posix()
        inside += [f"{rel}:{src[:m.start()].count(chr(10)) + 1}" for m in body.finditer(src)]
        for m in sig.finditer(src):
            for n in ROLE_NAMES:
                if re.search(rf"\b{n}\b", m.group(1)):
                    named[n] += 1
    return inside, named


def test_each_role_is_named_in_the_signatures_that_use_it_not_inside_bodies():
    """A function says what part of a table or store it plays against where a reader looks
    first, its signature (`refs: GcTable`, `core: Core[GcTable]`), not in a re-annotation
    inside its body; and every role of roles.py is so named somewhere."""
    inside, named = _role_sites(PKG)
    assert inside == []
    # A role reached through another role's member is named there (CatalogReader.tier_rows
    # -> TierRows): its users hold the role that hands it out.
    through = {n for n in ROLE_NAMES if re.search(rf"-> \"?{n}\b", (PKG / "core" / "roles.py").read_text())}
    assert [n for n, k in named.items() if k == 0 and n not in through] == []


def test_a_role_annotated_inside_a_body_is_found(tmp_path):
    pkg = tmp_path / "tensorstore_ck"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(core):\n    refs: GcTable = core.refs\n    return refs\n")
    inside, named = _role_sites(pkg)
    assert inside == ["m.py:2"] and named["GcTable"] == 0
