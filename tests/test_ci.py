"""CI runs what a developer runs: .ci/run's last command is the README's test command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    readme = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()]
    test_cmd = next(ln for ln in readme if ln.startswith("python3 -m venv") and "pytest" in ln)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [ln for ln in ci if ln and not ln.startswith("#")][-1] == test_cmd
    # the S3 tests' server (moto) comes with it, and torch stays the pinned build
    assert "'moto[server]'" in test_cmd and "'torch==2.13.0'" in test_cmd
