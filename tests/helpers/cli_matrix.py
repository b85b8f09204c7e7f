"""Run many `tsck` command lines, each in a process of its own, without paying the
~2 s import of torch for each: this process imports tensorstore_ck and torch once (the
CLI itself loads torch only for the commands that need it), then forks
one child per command line. The child runs tensorstore_ck.cli.main(argv) exactly
as `python -m tensorstore_ck` does (an exception that escapes it is printed as
Python prints it, "Traceback ..."), with stdout/stderr in files; a child still
running after the timeout is killed and reported as timed out.

    python tests/helpers/cli_matrix.py SPEC.json OUT.json
    SPEC: {"timeout": s, "runs": [{"id": str, "argv": [...], "env": {...}}, ...]}
    OUT:  [{"id", "argv", "rc", "stdout", "stderr", "timed_out", "seconds"}, ...]
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

import torch  # noqa: F401 - loaded once here, so the children that need it (checkout, import) inherit it

from tensorstore_ck.cli import main


def _child(argv, env, out_path, err_path) -> None:
    rc = 1
    try:
        os.environ.update(env)
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        sys.stdin = open(os.devnull)
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print
            traceback.print_exc()
            rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


def run(spec: dict) -> list:
    out = []
    timeout = float(spec.get("timeout", 30))
    with tempfile.TemporaryDirectory(prefix="tsck-cli-matrix-") as tmp:
        for i, r in enumerate(spec["runs"]):
            o, e = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(r["argv"], r.get("env") or {}, o, e)
            timed_out = False
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() - t0 > timeout:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    timed_out, status = True, 0
                    break
                time.sleep(0.01)
            rc = None if timed_out else (os.waitstatus_to_exitcode(status))

            def text(p):
                try:
                    with open(p, errors="replace") as f:
                        return f.read()
                except FileNotFoundError:
                    return ""
            out.append({"id": r["id"], "argv": r["argv"], "rc": rc, "stdout": text(o), "stderr": text(e),
                        "timed_out": timed_out, "seconds": time.monotonic() - t0})
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    res = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
