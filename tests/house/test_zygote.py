"""The suite's fork server (tests/_zygote.py) runs a helper as a fresh interpreter would:
argv, environment, cwd, streams, exit status, signals, sessions, threads and atexit.
Every test here checks that the zygote, not a plain interpreter, ran the child
(`forked`, its parent's pid), so a silent fallback cannot pass for the real thing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import _zygote as zygote
import pytest

PY = sys.executable


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[2])


def _run(code: str, *args, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 120)
    return zygote.run([PY, "-c", code, *args], **kw)


@pytest.fixture(autouse=True)
def _needs_zygote():
    if os.environ.get(zygote.OFF):
        pytest.skip("TESTS_NO_ZYGOTE is set: every helper is a plain interpreter")
    assert os.environ.get(zygote.ENV), "conftest starts the zygote"


def test_a_child_is_a_fork_of_the_zygote_with_its_own_pid_argv_env_and_cwd(tmp_path):
    p = zygote.Popen([PY, "-c", "import os, sys, time; print(os.getpid(), sys.argv, os.getcwd(), "
                      "os.environ['X'], sys.path[0] == '', flush=True); sys.stdin.read()", "a b", "c"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                     env={**os.environ, "X": "y"})
    line = p.stdout.readline().split()
    assert p.forked and _parent_of(p.pid) not in (os.getpid(), 1)
    assert int(line[0]) == p.pid
    assert " ".join(line[1:]) == f"['-c', 'a b', 'c'] {tmp_path} y True"
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_exit_status_as_an_interpreter_gives_it():
    assert _run("import sys; sys.exit(3)").returncode == 3
    r = _run("import sys; sys.exit('gone wrong')")
    assert (r.returncode, r.stderr) == (1, "gone wrong\n")
    r = _run("def f():\n    raise ValueError('bad')\nf()")
    assert r.returncode == 1
    # the script's frames and nothing of the zygote's
    assert r.stderr.splitlines() == ["Traceback (most recent call last):", '  File "<string>", line 3, in <module>',
                                     '  File "<string>", line 2, in f', "ValueError: bad"]


def test_sigkill_and_a_session_of_its_own():
    p = zygote.Popen([PY, "-c", "import time; print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE,
                     start_new_session=True)
    assert p.stdout.readline() == b"up\n" and p.forked
    assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    p.stdout.close()
    q = zygote.Popen([PY, "-c", "import time; time.sleep(600)"])
    q.terminate()
    assert q.wait(timeout=60) == -signal.SIGTERM


def test_a_child_starts_in_its_parents_process_group_or_runs_plain():
    p = zygote.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert p.forked and os.getpgid(p.pid) == os.getpgrp()  # a killpg of this group reaches it
    p.stdin.close()
    assert p.wait(timeout=60) == 0
    # A parent in a session of its own: the zygote (in this session) cannot put a child in
    # that parent's group, so it runs plain; a child that asks for a session of its own
    # is forked.
    r = _run("import os, sys; os.setsid(); sys.path.insert(0, sys.argv[1]); import _zygote as z\n"
             "p = z.Popen([sys.executable, '-c', 'import os; print(os.getpgrp())'], stdout=-1, text=True)\n"
             "q = z.Popen([sys.executable, '-c', 'pass'], start_new_session=True)\n"
             "print(p.forked, int(p.communicate()[0]) == os.getpgrp(), q.forked, q.wait())",
             os.path.dirname(os.path.abspath(zygote.__file__)))
    assert (r.returncode, r.stdout) == (0, "False True True 0\n"), r.stderr


def test_threads_are_joined_and_atexit_runs_before_the_exit():
    r = _run("import atexit, threading, time\n"
             "atexit.register(lambda: print('atexit', flush=True))\n"
             "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()")
    assert (r.returncode, r.stdout) == (0, "thread\natexit\n")


def test_streams_pipes_files_devnull_and_stderr_to_stdout(tmp_path):
    r = _run("import sys; d = sys.stdin.read(); print(d.upper()); print('e', file=sys.stderr)", input="in")
    assert (r.stdout, r.stderr) == ("IN\n", "e\n")
    r = _run("import sys; print('o', flush=True); print('e', file=sys.stderr)", capture_output=False,
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.stdout == "o\ne\n" and r.stderr is None
    with open(tmp_path / "out", "w") as f:
        assert _run("print('to a file')", stdout=f, capture_output=False).returncode == 0
    assert (tmp_path / "out").read_text() == "to a file\n"
    assert _run("print('x')", stdout=subprocess.DEVNULL, capture_output=False).stdout is None


def test_unbuffered_output_arrives_before_the_child_ends():
    p = zygote.Popen([PY, "-u", "-c", "import sys; print('now'); sys.stdin.read()"], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "now\n" and p.forked  # no flush: -u as an interpreter reads it
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_script_and_module_runs(tmp_path):
    (tmp_path / "mod_here.py").write_text("import sys\nVALUE = 7\n")
    script = tmp_path / "s.py"
    script.write_text("import sys, mod_here\nprint(__name__, sys.argv, mod_here.VALUE)\n")
    r = zygote.run([PY, str(script), "x"], capture_output=True, text=True, timeout=120)
    assert r.stdout == f"__main__ {[str(script), 'x']} 7\n"
    r = zygote.run([PY, "-m", "mod_here"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = zygote.run([PY, str(tmp_path / "missing.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "can't open file" in r.stderr


def test_warnings_and_numpy_seeds_are_each_childs_own():
    code = "import warnings; warnings.warn('w', UserWarning); print('not raised')"
    assert _run(code, env={**os.environ, "PYTHONWARNINGS": "error"}).returncode == 1
    assert _run(code, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}).returncode == 0
    draws = {_run("import numpy as np; print(np.random.randint(1 << 30))").stdout for _ in range(3)}
    assert len(draws) == 3


def test_what_the_zygote_cannot_do_exactly_runs_as_a_plain_interpreter():
    me = os.getpid()
    for kw in ({"fresh": True}, {"env": {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1"}},
               {"preexec_fn": os.getpid}):
        p = zygote.Popen([PY, "-c", "import os; print(os.getppid())"], stdout=subprocess.PIPE, text=True, **kw)
        out, _ = p.communicate(timeout=120)
        assert not p.forked and int(out) == me and p.returncode == 0
    r = zygote.run(["sh", "-c", "exit 4"])
    assert r.returncode == 4


def test_run_times_out_and_kills_the_child():
    with pytest.raises(subprocess.TimeoutExpired):
        _run("import time; time.sleep(600)", timeout=1)


def test_a_child_told_so_starts_its_own_interpreter_children_as_forks_too():
    """TESTS_ZYGOTE_SUBPROCESS: subprocess.Popen/run in the child (and torch.distributed.elastic's
    handler, which binds Popen at its import) fork from the zygote, in a session of their own
    as torchrun asks, with torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING; without it, plainly."""
    code = ("import os, subprocess, sys\n"
            "from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as h\n"
            "env = dict(os.environ, TORCH_NCCL_ASYNC_ERROR_HANDLING='1')\n"
            "r = subprocess.run([sys.executable, '-c', 'import os; print(os.getppid(), os.getsid(0) == os.getpid())'],"
            " capture_output=True, text=True, env=env, start_new_session=True)\n"
            "print(os.getpid(), r.stdout.strip(), r.returncode, h.Popen.__module__ != 'subprocess')\n")
    for routed in (True, False):
        env = {**os.environ, zygote.SUBPROCESS: "1"} if routed else dict(os.environ)
        r = _run(code, env=env)
        child, parent, own_session, rc, handler_routed = r.stdout.split()
        assert r.returncode == 0 and rc == "0" and own_session == "True", r.stdout + r.stderr
        # forked by the zygote (its parent), or a plain child of the child
        assert (parent != child) == routed and handler_routed == str(routed), r.stdout
