"""CI runs what a developer runs: .ci/run's last command is the README's test command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_exactly_the_readme_test_command():
    readme = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()]
    test_cmd = next(ln for ln in readme if ln.startswith("python3 -m venv") and "pytest" in ln)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [ln for ln in ci if ln and not ln.startswith("#")][-1] == test_cmd
    # the S3 tests' server (moto) comes with it, and torch stays the pinned build
    assert "'moto[server]'" in test_cmd and "'torch==2.13.0'" in test_cmd
    # pip compiles nothing: the suite's processes compile what they import, and keep it
    assert "pip install -q --no-compile " in test_cmd


def test_the_suites_processes_keep_their_bytecode(tmp_path):
    """Even where PYTHONDONTWRITEBYTECODE is set (tests/conftest.py lifts it, with caches in a
    folder of their own): a fresh interpreter the suite starts writes what it compiles."""
    import subprocess
    import sys
    mod = tmp_path / "probe_mod.py"
    mod.write_text("X = 1\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import probe_mod, importlib.util; " \
           "print(sys.dont_write_bytecode, importlib.util.cache_from_source(probe_mod.__file__))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    dont, cache = out.stdout.split()
    assert dont == "False" and Path(cache).is_file(), out.stdout


def test_package_states_a_torch_range_and_the_commands_pin_the_build():
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.replace(" ", "").startswith("torch"))
    # a library states the range it supports: users keep the torch they train with
    assert "==" not in torch_dep and ">=" in torch_dep, torch_dep
    readme = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()]
    cmds = [ln for ln in readme if ln.startswith("python3 -m venv")]
    assert len(cmds) == 2
    for cmd in cmds:
        # a current pip: the one a venv is born with backtracks for minutes through boto3's releases
        assert cmd.startswith("python3 -m venv --upgrade-deps .venv &&"), cmd
        # the pin rides in the same pip invocation as the package, so pip never resolves the range
        first_pip = cmd.split("&&")[1]
        assert "-e '.[test]'" in first_pip and "'torch==2.13.0'" in first_pip, cmd
