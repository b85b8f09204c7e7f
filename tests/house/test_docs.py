"""The docs and the code say what is and why, and the docs' links lead somewhere.

- No tracker numbers (the word "issue" and a number) in the package, the docs or the
  tests, and no history narrated in the docs and tests ("the old code", "before the
  fix"): a reader of a docstring or a design note should learn what the code does and
  why, not which ticket it came from (history belongs to CHANGELOG.md and git).
- Every relative link in a Markdown file under docs/ (and the READMEs beside the code)
  names a file or folder that exists, so moving a design note cannot strand a link.
- Every Markdown file, and every Python file named with its folder, that the docs' prose
  or a test docstring names is in the repository (not a contract kept outside it).

Fast: reads text files only.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACKER = re.compile(r"\bissue [0-9]", re.IGNORECASE)
HISTORY = re.compile(r"since issue|\bolder code\b|\bthe old code\b|before the fix|before the [A-Za-z0-9 ]*redesign",
                     re.IGNORECASE)
# [text](target) with a target that is not a URL or a bare anchor; an optional #anchor is cut.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".yml", ".yaml"}


def _grep(top: str, pattern: re.Pattern) -> list[str]:
    """`grep -rn PATTERN TOP` over the text files below TOP (this file aside)."""
    hits = []
    for path in sorted((REPO / top).rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
            continue
        if path.resolve() == Path(__file__).resolve():
            continue  # this file names the pattern it looks for
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    return hits


@pytest.mark.parametrize("top", ["docs", "tests", "tensorstore_ck"])
def test_no_tracker_numbers(top):
    hits = _grep(top, TRACKER)
    assert not hits, f"{len(hits)} line(s) cite a tracker item instead of saying what is and why:\n" + \
        "\n".join(hits[:40])


@pytest.mark.parametrize("top", ["docs", "tests"])
def test_no_history_wording(top):
    """Docs and tests describe the code as it is: "the old code did X" says nothing about
    what this code does (a comparison names the commit it measured against instead)."""
    hits = _grep(top, HISTORY)
    assert not hits, f"{len(hits)} line(s) narrate history:\n" + "\n".join(hits[:40])


def _markdown_files() -> list[Path]:
    files = sorted((REPO / "docs").rglob("*.md"))
    files += [p for p in (REPO / "tests" / "README.md", REPO / "benches" / "README.md", REPO / "README.md")
              if p.exists()]
    return files


def test_the_readme_is_read_in_one_pass():
    """The front door: what it is, the two commands, the quick start, links; the rest is
    in docs/ (INSTALL.md, the guides)."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"


def test_there_are_docs_to_check():
    """The link check below must not pass by finding nothing."""
    names = {p.relative_to(REPO).as_posix() for p in _markdown_files()}
    assert {"docs/ARCHITECTURE.md", "docs/FORMAT.md", "docs/design/gc.md"} <= names


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    in_code = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor in this file
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(REPO)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


# A path a reader would look up: a Markdown file, or a Python file named with its folder.
NAMED_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md|(?:[\w.-]+/)+[\w.-]+\.py)\b")


def _named_paths_missing(where: Path, text: str) -> list[str]:
    """The paths TEXT names that exist neither beside WHERE nor from the repository root,
    docs/, docs/design/ or the package (a design note says `FORMAT.md`, a module map
    `tier/holds.py`); a path that leaves the repository (`../x.md`) is not in it."""
    bases = (where.parent, REPO, REPO / "docs", REPO / "docs" / "design", PKG)

    def found(name: str) -> bool:
        return any((b / name).exists() and (b / name).resolve().is_relative_to(REPO) for b in bases)
    return sorted({m for m in NAMED_PATH.findall(text) if not found(m)})


def _texts_naming_paths() -> list[tuple[Path, str]]:
    """Each doc's prose (a command's output file in a code block is not there yet) and the
    docstrings of each shared module and test file in tests/."""
    import ast
    out = [(doc, _prose(doc.read_text())) for doc in _markdown_files()]
    for path in sorted(TESTS.glob("*.py")) + sorted(TESTS.glob("*/test_*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file's docstrings name made-up paths as examples
        nodes = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        out.append((path, "\n".join(ast.get_docstring(n) or "" for n in nodes)))
    return out


def test_every_file_a_doc_or_test_names_exists():
    """A reference leads to a file of this repository: a doc or a test docstring that
    cites a contract kept elsewhere sends its reader nowhere."""
    texts = _texts_naming_paths()
    assert sum(len(NAMED_PATH.findall(t)) for _p, t in texts) > 100, "the check found nothing to check"
    missing = [f"{p.relative_to(REPO)}: {name}" for p, t in texts for name in _named_paths_missing(p, t)]
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_a_named_path_outside_the_repository_is_caught():
    """The check above sees a Markdown name and a module path that do not exist."""
    doc = REPO / "docs" / "design" / "gc.md"
    text = "see DESIGN.md, ../../../shared/DESIGN.md and `tier/gone.py`; FORMAT.md, `tier/holds.py`"
    assert _named_paths_missing(doc, text) == ["../../../shared/DESIGN.md", "DESIGN.md", "tier/gone.py"]


# -- The maps: every module and test file named once; the docs a reference, not a notebook ----

PKG = REPO / "tensorstore_ck"
TESTS = REPO / "tests"


def _modules() -> list[str]:
    """Every module of the package as the maps name it, from the file tree: `store.py`,
    a package as `tier/`, its modules as `tier/local.py` (the package's own __init__.py aside)."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if "__pycache__" in rel or rel == "__init__.py":
            continue
        out.append(rel[: -len("__init__.py")] if rel.endswith("/__init__.py") else rel)
    return out


def _map_entries(init: Path) -> list[tuple[list[str], str]]:
    """The map in a package's docstring (`init`, its __init__.py) as entries: (the names an
    entry gives, its text). An entry is a line indented 4 whose first words name modules
    or folders (`a.py`, `b/`; `a.py, b.py` names two, and a list ending in a comma goes on
    on the next line); the lines indented deeper that follow are its text."""
    import ast
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
    entries: list[tuple[list[str], str]] = []
    listing, open_ = False, False  # listing: the names ended with a comma; open_: text may follow
    for line in doc.splitlines():
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if indent == 4 and words:
            names = []
            for w in words:
                n = w.rstrip(",")
                if not re.fullmatch(r"\w+(\.py|/)", n):
                    break
                names.append(n)
                if not w.endswith(","):
                    break
            if names:
                rest = line.split(names[-1], 1)[1].lstrip(",")
                if listing:
                    entries[-1] = (entries[-1][0] + names, entries[-1][1] + " " + rest)
                else:
                    entries.append((names, rest))
                listing, open_ = words[len(names) - 1].endswith(","), True
                continue
            open_ = listing = False
        elif indent > 4 and open_ and entries:
            if listing:  # the names go on
                more = [w.rstrip(",") for w in line.split()[:1] if re.fullmatch(r"\w+(\.py|/)", w.rstrip(","))]
                if more:
                    entries[-1] = (entries[-1][0] + more, entries[-1][1] + " " + line.split(more[0], 1)[1])
                    listing = line.split()[0].endswith(",")
                    continue
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
        elif line.strip():
            open_ = listing = False
    return entries


def _folders(pkg: Path = PKG) -> list[Path]:
    return sorted(p.parent for p in pkg.rglob("__init__.py") if p.parent != pkg and "__pycache__" not in p.parts)


def _docstring_entries() -> list[tuple[list[str], str]]:
    """Every map entry, by the module's path under the package: the package docstring's
    (top-level modules and folders) and each folder's own (`tier/local.py`)."""
    out = list(_map_entries(PKG / "__init__.py"))
    for folder in _folders():
        rel = folder.relative_to(PKG).as_posix() + "/"
        out += [([rel + n for n in names], text) for names, text in _map_entries(folder / "__init__.py")]
    return out


def _expected_in(folder: Path) -> list[str]:
    """What a package's map names: its own modules and its folders (`x.py`, `y/`)."""
    out = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
    return out + [p.name + "/" for p in sorted(folder.iterdir()) if (p / "__init__.py").exists()]


def _map_faults(pkg: Path) -> list[str]:
    """Per package of `pkg` (itself and each folder): what its map does not name, names
    more than once, or names that is not there."""
    from collections import Counter
    faults = []
    for folder in [pkg] + _folders(pkg):
        init = folder / "__init__.py"
        expect = _expected_in(folder)
        mentions = Counter(n for names, _t in _map_entries(init) for n in names)
        missing = [m for m in expect if mentions[m] == 0]
        twice = sorted(m for m, n in mentions.items() if n > 1)
        unknown = sorted(m for m in mentions if m not in expect)
        if missing or twice or unknown:
            faults.append(f"{init.relative_to(pkg.parent)}: not named {missing}; named more than once {twice}; "
                          f"no such module {unknown}")
    return faults


def test_the_package_docstring_names_every_folder_and_module_once(tmp_path):
    """The maps a newcomer reads first: the package docstring names each top-level module
    and folder on exactly one line, and each folder's __init__ names each of its modules
    once, so a module added, moved or renamed fails here until it has its line. Modules
    planted in a copy of the package show the check bites."""
    import shutil
    assert _map_faults(PKG) == []
    shutil.copytree(PKG, tmp_path / "tensorstore_ck", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tensorstore_ck" / "planted.py").write_text('"""A module nobody wrote a line for."""\n')
    (tmp_path / "tensorstore_ck" / "format" / "planted.py").write_text('"""The same, inside a package."""\n')
    faults = _map_faults(tmp_path / "tensorstore_ck")
    assert len(faults) == 2 and "not named ['planted.py']" in faults[0] and "format/__init__.py" in faults[1], faults


def test_the_package_docstring_is_a_short_table():
    """The package's map names folders and the modules users import, not every room: at
    most 12 modules at the top of the package (the facade, the errors and the front ends
    users import: hf, accelerate, lightning, torchtitan, metrics), and its docstring under
    80 lines."""
    import ast
    top = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= 12, f"{len(top)} modules at the top of the package: {sorted(top)}"
    doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text()), clean=False)
    assert len(doc.splitlines()) < 80, len(doc.splitlines())


MODULE_LINES = 650  # past this a module is split, or its map entry says the one job it does


def test_a_long_module_holds_one_job():
    """A module over MODULE_LINES lines is split, or its line in the package docstring's
    map says which one job it does ("one job"): a long file of several jobs is a house
    without walls."""
    said = {n: " ".join(text.split()) for names, text in _docstring_entries() for n in names}
    long = {m: n for m in _modules() if m.endswith(".py")
            for n in [len((PKG / m).read_text().splitlines())] if n > MODULE_LINES}
    unsaid = {m: n for m, n in long.items() if "one job" not in said.get(m, "")}
    assert not unsaid, f"modules over {MODULE_LINES} lines whose map entry names no one job: {unsaid}"


def _section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next heading of the same level."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"no '## {heading}' section"
    return m.group(1)


def test_architecture_says_where_every_module_lives():
    """docs/ARCHITECTURE.md's "Where things live" names every module (a package's modules
    by their path, `tier/local.py`), and every module its headings name exists."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    where = _section(text, "Where things live")
    modules = _modules()
    missing = [m for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}", where)]
    assert not missing, f"ARCHITECTURE.md 'Where things live' does not name: {missing}"
    bad = []
    for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", heading):
            stem = name.rstrip("/")
            if not ((PKG / f"{stem}.py").exists() or (PKG / stem).is_dir()):
                bad.append(f"{heading!r}: `{name}`")
    assert not bad, "ARCHITECTURE.md headings name modules that do not exist:\n" + "\n".join(bad)


def _readme_map() -> list[str]:
    """What tests/README.md's tables map, one entry per mention: the files and folders
    named (in backquotes) in a table row's first cell."""
    named = []
    for line in (TESTS / "README.md").read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        first = line.split("|")[1]
        named += re.findall(r"`([\w./]+)`", first)
    return named


def _test_files() -> list[str]:
    """Every file and folder of tests/ a reader may wonder about: each test file by its path
    in tests/ (`read/test_dtensor.py`), the shared modules beside the test folders, and the
    folders of anything else (helpers/, sim/, data/)."""
    out = [p.name for p in sorted(TESTS.glob("*.py")) if p.name != "__init__.py"]
    out += [p.relative_to(TESTS).as_posix() for p in sorted(TESTS.glob("*/test_*.py"))]
    out += [p.name + "/" for p in sorted(TESTS.iterdir())
            if p.is_dir() and not p.name.startswith((".", "__")) and not any(p.glob("test_*.py"))]
    return out



def test_tests_readme_maps_every_test_file_once():
    """Each test file (and each shared module or folder) has exactly one row in
    tests/README.md saying what it guards, so a new file fails here until it has one. A test
    file lives in the folder named after the part of the package it aims at (a folder of
    tensorstore_ck/ or a module at its top); house/ holds the checks of the whole project,
    stateful/ the hypothesis state machines."""
    from collections import Counter
    mentions = Counter(_readme_map())
    files = _test_files()
    folders = sorted({f.split("/")[0] for f in files if "/test_" in f})
    assert len(folders) > 10 and not any(f.startswith("test_") for f in files), folders
    odd = [f for f in folders if not ((PKG / f).is_dir() or (PKG / f"{f}.py").exists() or f in ("house", "stateful"))]
    assert not odd, f"test folders named after no part of tensorstore_ck/: {odd}"
    missing = [f for f in files if mentions[f] == 0]
    twice = sorted(f for f, n in mentions.items() if n > 1)
    unknown = sorted(f for f in mentions if f not in files)
    assert not (missing or twice or unknown), \
        f"tests/README.md: no row for {missing}; more than one row for {twice}; no such file {unknown}"


def _test_module_imports(tests: Path) -> list[str]:
    """Lines of tests/ (child scripts in strings included) that import a test module."""
    names = {p.stem for p in tests.rglob("test_*.py")}
    found = []
    for p in sorted(tests.rglob("*.py")):
        src = p.read_text()
        for m in re.finditer(r"^\s*(?:from|import)\s+([\w.]+)", src, re.M):
            if m.group(1).split(".")[-1] in names:
                found.append(f"{p.relative_to(tests).as_posix()}:{src[:m.start()].count(chr(10)) + 1}")
    return found


def test_no_test_module_imports_another():
    """What tests share lives in the shared modules beside the folders (_util.py, _backends.py,
    ...), never in a test module another imports (or a child script imports by name): a test
    module can then move, split or go without breaking a stranger."""
    assert _test_module_imports(TESTS) == []


def test_a_test_module_imported_is_found(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "test_x.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "test_y.py").write_text('CHILD = """\nfrom test_x import test_x\n"""\n')
    assert _test_module_imports(tmp_path) == ["test_y.py:2"]


# A lab notebook's words: a comparison with an old commit, or a change that never landed.
NOTEBOOK = re.compile(r"A/B against|not landed", re.IGNORECASE)
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commit_hashes(words: set[str]) -> set[str]:
    """Those of `words` that name a commit of this checkout (one `git cat-file` for all);
    None when this is not a git checkout."""
    import subprocess
    import _zygote as zygote
    words = sorted(w for w in words if re.search(r"[0-9]", w))  # a hash has digits; "deadbeef"-like words aside
    try:
        out = zygote.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], check=True,
                         input="".join(f"{w}^{{commit}}\n" for w in words),
                         capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {w for w, line in zip(words, out) if line.endswith(" commit")}


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_docs_state_what_is(doc):
    """The docs are a reference: today's figures and behaviour. A/B tables against old
    commits, experiments not landed and commit hashes are history: CHANGELOG.md and git."""
    text = doc.read_text()
    notebook = [f"{doc.relative_to(REPO)}:{n}: {line.strip()}"
                for n, line in enumerate(text.splitlines(), 1) if NOTEBOOK.search(line)]
    assert not notebook, "history in a reference doc:\n" + "\n".join(notebook)
    hashes = _commit_hashes(set(HEX_WORD.findall(text)))
    if hashes is None:
        pytest.skip("not a git checkout: commit hashes cannot be told from hex words")
    assert not hashes, f"{doc.relative_to(REPO)} names commits {sorted(hashes)}: history belongs to CHANGELOG.md"


RESULT = re.compile(r"benches/results/([A-Za-z0-9_.-]*[A-Za-z0-9_-])")


def _prose(text: str) -> str:
    """A Markdown text without its code blocks (fenced, or indented 4): a command's output
    file is what it will write, not a figure cited."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append(line)
    return "\n".join(out)


def test_bench_results_are_the_ones_cited():
    """benches/results/ holds what the docs cite and nothing else, and every file the
    docs cite is there."""
    docs = _markdown_files() + [REPO / "CHANGELOG.md"]
    cited: dict[str, list[str]] = {}
    for doc in docs:
        for name in RESULT.findall(_prose(doc.read_text())):
            cited.setdefault(name, []).append(doc.relative_to(REPO).as_posix())
    results = REPO / "benches" / "results"
    stored = {p.name for p in results.iterdir() if p.is_file()}
    assert cited, "no doc cites benches/results: the check found nothing to check"
    absent = sorted(f"{name} (cited by {', '.join(sorted(set(by)))})" for name, by in cited.items()
                    if name not in stored)
    uncited = sorted(stored - set(cited))
    assert not absent and not uncited, \
        f"cited but not in benches/results: {absent}; in benches/results but cited by no doc: {uncited}"
