"""Subprocess plumbing shared by tests/maintain/test_gc_race.py and tests/maintain/test_gc_crash.py.

Loaded by file path from the tests (not a test helper script itself): starts a
helper script with the repository on PYTHONPATH and collects its stdout lines,
timestamped, in a reader thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _zygote as zygote
from _util import child_env as _child_env
from _util import load_helper

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parent.parent


load = load_helper  # tests/helpers/<name>.py by path (the test process has no helpers on sys.path)


def child_env() -> dict:
    # PYTHONFAULTHANDLER: a crash of a child (not our SIGKILL) leaves its traceback in its stderr
    return _child_env(drop=("AWS_", "TSCK_"), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")


class Proc:
    """A helper script; stdout lines are kept as (monotonic time, line)."""

    def __init__(self, script: str, args: list, errlog: Path):
        self.errlog = errlog
        self._err = open(errlog, "wb")
        self.proc = zygote.Popen(
            [sys.executable, str(HELPERS / script), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=child_env(), cwd=str(REPO))
        self.lines: list[tuple[float, str]] = []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cv:
                self.lines.append((time.monotonic(), line))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_line(self, prefix: str, timeout: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for t, line in self.lines:
                    if line.startswith(prefix):
                        return t, line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._t.is_alive()):
                    raise AssertionError(f"no {prefix!r} line from {self.proc.args[1]} "
                                         f"(rc={self.proc.poll()}): {self.stderr()[-3000:]}")
                self._cv.wait(min(left, 0.5))

    def wait_count(self, prefix: str, n: int, timeout: float, since: float = 0.0) -> None:
        """Until n lines starting with prefix came at or after `since` (time.monotonic())."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while sum(1 for t, line in self.lines if t >= since and line.startswith(prefix)) < n:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._t.is_alive()):
                    raise AssertionError(f"fewer than {n} {prefix!r} lines from {self.proc.args[1]} "
                                         f"(rc={self.proc.poll()}): {self.stderr()[-3000:]}")
                self._cv.wait(min(left, 0.5))

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._t.join(10)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._t.join(10)
        return rc

    def stderr(self) -> str:
        self._err.flush()
        try:
            return self.errlog.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._t.join(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._err.close()

    def found(self, prefix: str) -> list[tuple[float, str]]:
        with self._cv:
            return [(t, line) for t, line in self.lines if line.startswith(prefix)]
