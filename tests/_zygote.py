"""A preloaded fork server for the suite's Python helper processes.

`import torch` costs 3-4 CPU-seconds on the test machine, and the suite starts some 400
Python processes that import it (helpers, CLI calls, harness workers, kill-loop
writers): a quarter of the whole run's CPU. The zygote imports torch, torch.distributed's
checkpoint package, s3fs, psycopg and every tensorstore_ck module once; a helper is then
a fork of it, ready in milliseconds.

A forked helper is still a real process of its own: its own pid (SIGKILL it), its own exit status (returncode, -9 when killed), its own stdin/stdout/stderr
(pipes, files, /dev/null as subprocess.Popen sets them), argv, environment, cwd and
session, and it ends the way a fresh interpreter does (non-daemon threads joined, atexit
handlers run, streams flushed; an uncaught exception prints its traceback and exits 1).
It starts in its parent's process group (or a session of its own), so a killpg reaches
it as it would reach a plain child. What differs: its parent is the zygote (which reaps
it at once: no zombie outlives it, and PR_SET_PDEATHSIG would name the zygote), and
modules are imported before its environment is set. The zygote refuses what it cannot
do exactly, and that runs as a plain interpreter: import-time variables that differ from
its own, a parent in another session (a group there is out of the zygote's reach),
another executable, preexec_fn, pass_fds, uid/gid/umask, unknown interpreter flags.

Use `Popen`, `run`, `check_output` and `check_call` from this module where a test
starts `[sys.executable, ...]` (fresh=True: a plain interpreter, for a test of what an
interpreter imports or of a process's own memory: a fork shares the zygote's). The
pytest process starts the zygote (`start()`, from conftest) and puts its address in
$TESTS_ZYGOTE, so helpers' own helpers use it too. TESTS_NO_ZYGOTE=1 turns it off (every helper a fresh interpreter).

    python tests/_zygote.py FD      # the server; FD: a listening unix socket
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

ENV = "TESTS_ZYGOTE"
OFF = "TESTS_NO_ZYGOTE"
# Variables read when a library is imported or initialised, not when it is used: a
# request that differs from the zygote's own in these runs as a plain interpreter.
IMPORT_TIME = ("PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE",
               "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUTF8", "LD_PRELOAD", "LD_LIBRARY_PATH",
               "MKL_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY", "CUDA_VISIBLE_DEVICES")
IMPORT_TIME_PREFIXES = ("TORCH_", "PYTORCH_", "TQDM_")  # tqdm reads its TQDM_* defaults at import
# ... except these, which the zygote pins (torch's C++ log level) or sets in the child.
PINNED = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
# ... and these, read when they are used (torchrun sets the first for its ranks; NCCL's
# process group reads it when one is made, never at import).
USE_TIME = ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)
# In a child whose environment sets this, subprocess.Popen is this module's Popen: its own
# `[sys.executable, ...]` children (torchrun's agent and ranks, Lightning's) are forks too.
SUBPROCESS = "TESTS_ZYGOTE_SUBPROCESS"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "fsspec", "s3fs",
           "psycopg", "psycopg_pool", "lmdb", "blake3", "lz4.frame", "msgpack", "safetensors.torch")
SKIP_PRELOAD = ("tensorstore_ck.lightning",)  # lightning's import is heavy and only a few helpers need it


# ------------------------------------------------------------------------------ client
_lock = threading.Lock()
_server: subprocess.Popen | None = None
_owner = 0
_address = ""
reaped_cpu = 0.0  # CPU of a zygote stop() reaped, all of it logged already (cpu_log)
# The import-time variables of this process when it started its zygote (the zygote's own):
# a request whose environment has other values runs as a plain interpreter.
started_with: dict | None = None


def start() -> None:
    """Start this process's zygote (the pytest process calls this once) unless one is
    already named in the environment or TESTS_NO_ZYGOTE is set. The preload runs in the
    background: a request that comes first waits for it."""
    global _server, _owner, _address, started_with
    with _lock:
        if _server is not None or os.environ.get(ENV) or os.environ.get(OFF):
            return
        path = os.path.join(tempfile.mkdtemp(prefix="tsck-zygote-"), "sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        lsock.listen(64)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(PINNED)
        _server = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(lsock.fileno())],
                                   pass_fds=(lsock.fileno(),), cwd=repo, env=env, stdin=subprocess.DEVNULL)
        lsock.close()
        _owner, _address = os.getpid(), path
        started_with = _import_time(os.environ)
        os.environ[ENV] = f"{os.getsid(0)}:{path}"  # its session (the zygote's) and its socket


def stop() -> None:
    """Stop this process's zygote (helpers it forked go on: they are processes of their own)."""
    global _server
    with _lock:
        if _server is not None and os.getpid() == _owner:
            if os.environ.get("TESTS_CPU_LOG"):  # its own CPU (the preload); its forks logged theirs
                global reaped_cpu
                with open(f"/proc/{_server.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu_log("(the zygote's preload)", (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                        "zygote itself")
                _server.kill()
                _pid, sts, use = os.wait4(_server.pid, 0)
                _server.returncode = os.waitstatus_to_exitcode(sts)
                reaped_cpu += use.ru_utime + use.ru_stime  # (the worker's hook leaves it out)
            _server.kill()
            _server.wait()
            os.environ.pop(ENV, None)
            try:
                os.unlink(_address)
            except OSError:
                pass
        _server = None


def _interpreter_args(args) -> list[str] | None:
    """argv after the interpreter, as the zygote runs it: ["-c", code, ...],
    ["-m", module, ...] or [script, ...]; None: not a plain run of this interpreter."""
    if isinstance(args, (str, bytes, os.PathLike)) or not args:
        return None
    args = [os.fspath(a) for a in args]
    if any(isinstance(a, bytes) for a in args) or args[0] != sys.executable:
        return None
    rest = args[1:]
    while rest and rest[0] in ("-u", "-X"):  # unbuffered; -X faulthandler (nothing else)
        if rest[0] == "-X" and (len(rest) < 2 or rest[1] != "faulthandler"):
            return None
        rest = rest[2:] if rest[0] == "-X" else rest[1:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-c", "-m")):
        return None
    if rest[0] in ("-c", "-m") and len(rest) < 2:
        return None
    return rest


def import_time_name(k: str) -> bool:
    """Whether variable `k` is one libraries read at import (PINNED and USE_TIME aside)."""
    return (k in IMPORT_TIME or k.startswith(IMPORT_TIME_PREFIXES)) and k not in PINNED and k not in USE_TIME


def _import_time(env) -> dict:
    """The variables of `env` that libraries read at import."""
    return {k: v for k, v in env.items() if import_time_name(k)}


def _recv_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        part = sock.recv(256)
        if not part:
            raise ConnectionError("the zygote closed the connection")
        buf += part
    return buf


class Popen(subprocess.Popen):
    """subprocess.Popen whose `[sys.executable, ...]` children are forks of the zygote."""

    _zy: socket.socket | None = None

    def __init__(self, *args, fresh: bool = False, **kwargs):
        """fresh: a plain interpreter even where the zygote could fork it (a test of what
        an interpreter imports, or of a process's own memory)."""
        self._fresh = fresh
        super().__init__(*args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        rest = None if (self._fresh or shell or executable or preexec_fn or pass_fds or not close_fds or gid is not None
                        or gids is not None or uid is not None or umask >= 0) else _interpreter_args(args)
        zsid, _, address = os.environ.get(ENV, "").partition(":")
        pgid = process_group if process_group is not None and process_group >= 0 else None
        if not start_new_session and pgid is None:
            # A child starts in its parent's process group (a killpg of the group reaches
            # it): the zygote's fork can join that group only within the zygote's session.
            pgid = os.getpgrp() if zsid == str(os.getsid(0)) else None
            if pgid is None:
                rest = None
        env_d = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
        cwd_s = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        conn = None
        if rest is not None and address and not os.environ.get(OFF) and os.path.isdir(cwd_s):
            flags = [a for a in list(args)[1:len(args) - len(rest)] if a in ("-u", "faulthandler")]
            req = json.dumps({"argv": rest, "env": env_d, "cwd": cwd_s, "setsid": bool(start_new_session),
                              "pgid": pgid, "unbuffered": "-u" in flags,
                              "faulthandler": "faulthandler" in flags}).encode()
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(address)
                socket.send_fds(conn, [struct.pack("!I", len(req))], fds)
                conn.sendall(req)
                conn.settimeout(300)  # the zygote may still be preloading on a loaded machine
                line = _recv_line(conn)
                if not line.startswith(b"P "):
                    raise ConnectionError(line.decode(errors="replace"))
                conn.settimeout(None)
                self.pid = int(line[2:])
            except OSError:
                if conn is not None:
                    conn.close()
                conn = None
        if conn is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                                          umask, start_new_session, process_group)
        self._zy = conn
        self._zy_buf = b""
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    @property
    def forked(self) -> bool:
        """True when the zygote forked this child (False: a plain interpreter)."""
        return self._zy is not None or getattr(self, "_zy_done", False)

    def _zy_status(self, block: bool) -> int | None:
        """The child's wait status from the zygote; None if it still runs (block=False)."""
        conn = self._zy
        conn.setblocking(block)
        try:
            while not self._zy_buf.endswith(b"\n"):
                part = conn.recv(64)
                if not part:  # the zygote is gone: wait for the child itself to go
                    while _alive(self.pid):
                        if not block:
                            return None
                        threading.Event().wait(0.05)
                    self._zy_buf = b"S %d\n" % (255 << 8)
                    break
                self._zy_buf += part
        except BlockingIOError:
            return None
        finally:
            if conn.fileno() != -1:
                conn.setblocking(True)
        conn.close()
        self._zy = None
        self._zy_done = True
        return int(self._zy_buf.split()[1])

    def _try_wait(self, wait_flags):
        if self._zy is None:
            return super()._try_wait(wait_flags)
        sts = self._zy_status(block=not (wait_flags & os.WNOHANG))
        return (0, 0) if sts is None else (self.pid, sts)

    def _internal_poll(self, _deadstate=None, **_kw):
        if self._zy is None:
            return super()._internal_poll(_deadstate=_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and self._zy is not None:
                    sts = self._zy_status(block=False)
                    if sts is not None:
                        self._handle_exitstatus(sts)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run through the zygote (same arguments, same results and errors)."""
    if input is not None:
        if kwargs.get("stdin") is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        if kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)


def check_output(*popenargs, timeout=None, **kwargs):
    return run(*popenargs, stdout=subprocess.PIPE, timeout=timeout, check=True, **kwargs).stdout


def check_call(*popenargs, **kwargs) -> int:
    run(*popenargs, check=True, **kwargs)
    return 0


# ------------------------------------------------------------------------------ server
def _serve(lfd: int) -> None:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with pytest
    listen = socket.socket(fileno=lfd)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    _preload()
    import warnings
    pristine_filters = list(warnings.filters)
    import torch
    threads = torch.get_num_threads()
    zygote_env = dict(os.environ)
    imported_with = _import_time(zygote_env)

    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    tests: dict[int, str] = {}  # the test that asked for each child ($PYTEST_CURRENT_TEST), for cpu_log
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(listen, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is wake_r:
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
            else:
                conn, _ = listen.accept()
                try:
                    req, fds = _read_request(conn)
                except (OSError, ValueError) as e:
                    _send(conn, b"E %s\n" % repr(e).encode())
                    conn.close()
                    continue
                if _import_time(req["env"]) != imported_with:  # the client runs a plain interpreter
                    _send(conn, b"E import-time environment differs\n")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    for s in (listen, wake_r, wake_w, conn, *children.values()):
                        s.close()
                    sel.close()
                    _child(req, fds, base_path, pristine_filters, threads, zygote_env)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                tests[pid] = req["env"].get("PYTEST_CURRENT_TEST", "")
                _send(conn, b"P %d\n" % pid)
        while children:
            try:
                pid, sts, use = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            cpu_log(tests.pop(pid, ""), use.ru_utime + use.ru_stime, "zygote child")
            conn = children.pop(pid, None)
            if conn is not None:
                _send(conn, b"S %d\n" % sts)
                conn.close()


def cpu_log(test: str, cpu: float, what: str) -> None:
    """Measurement only (tests/census/by_test.py): with $TESTS_CPU_LOG set, one line per
    forked child reaped here (its CPU and its waited-for descendants') and per test in each
    pytest worker (tests/conftest.py: its own CPU and its plain children's)."""
    path = os.environ.get("TESTS_CPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{cpu:.3f}\t{what}\t{test.rsplit(' (', 1)[0]}\n")


def _send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass  # the client went away: the child is reaped all the same


def _read_request(conn: socket.socket):
    conn.settimeout(30)
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    while len(head) < 4:
        more = conn.recv(4 - len(head))
        if not more:
            raise ValueError("short request")
        head += more
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        more = conn.recv(n - len(body))
        if not more:
            raise ValueError("short request")
        body += more
    conn.settimeout(None)
    if len(fds) != 3:
        raise ValueError(f"{len(fds)} file descriptors, not 3")
    return json.loads(body), fds


def _preload() -> None:
    import importlib
    import pkgutil
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import tensorstore_ck
    for m in pkgutil.walk_packages(tensorstore_ck.__path__, "tensorstore_ck."):
        if not m.name.endswith("__main__") and m.name not in SKIP_PRELOAD:
            importlib.import_module(m.name)


def _child(req, fds, base_path, pristine_filters, threads, zygote_env) -> None:
    """In the fork: become the requested interpreter, run it, exit as one does."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if req["setsid"]:
            os.setsid()
        elif req["pgid"] is not None and req["pgid"] >= 0:
            os.setpgid(0, req["pgid"])
        for i, fd in enumerate(fds):
            if fd != i:
                os.dup2(fd, i)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(req["cwd"])
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        _streams(env, unbuffered=req["unbuffered"] or bool(env.get("PYTHONUNBUFFERED")))
        if req["faulthandler"] or env.get("PYTHONFAULTHANDLER"):
            import faulthandler
            faulthandler.enable()
        import warnings
        warnings.filters[:] = pristine_filters
        sys.warnoptions[:] = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
        warnings._processoptions(sys.warnoptions)  # what a fresh interpreter does with $PYTHONWARNINGS
        warnings._filters_mutated()
        if env.get("OMP_NUM_THREADS") != zygote_env.get("OMP_NUM_THREADS"):
            import torch
            n = env.get("OMP_NUM_THREADS")
            torch.set_num_threads(int(n) if n and n.isdigit() and int(n) > 0 else threads)
        import numpy as np
        np.random.seed()  # a fresh interpreter's numpy draws its own seed
        if env.get(SUBPROCESS):
            _route_subprocess()
        argv = req["argv"]
        pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        code = _run(argv, pp, base_path)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        import runpy
        etype, e, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next  # the traceback a fresh interpreter prints: the script's frames
        sys.excepthook(etype, e.with_traceback(tb), tb)
        code = 1
    os._exit(_finish(code))


def _route_subprocess() -> None:
    """subprocess.Popen (and run, call, check_output, which use it) as this module's Popen,
    also where a module bound the name at its import (torch.distributed.elastic's handler)."""
    subprocess.Popen = Popen
    handler = sys.modules.get("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler")
    if handler is not None:
        handler.Popen = Popen


def _streams(env, *, unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, buffered as a fresh interpreter's would be."""
    import io
    enc = env.get("PYTHONIOENCODING", "").split(":")[0] or None

    def text(fd: int, errors: str | None, line: bool):
        if unbuffered:
            raw = io.FileIO(fd, "w", closefd=False)
            return io.TextIOWrapper(raw, encoding=enc, errors=errors, write_through=True, line_buffering=line)
        return open(fd, "w", encoding=enc, errors=errors, closefd=False, buffering=1 if line else -1)

    sys.stdin = sys.__stdin__ = open(0, "r", encoding=enc, closefd=False)
    sys.stdout = sys.__stdout__ = text(1, None, os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "backslashreplace", True)


def _run(argv, pythonpath, base_path) -> int:
    import runpy
    import types
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = ["", *pythonpath, *base_path]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
        runpy._run_module_as_main(argv[1])
    else:
        script = argv[0]
        if not os.path.exists(script):
            print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: "
                  f"[Errno 2] No such file or directory", file=sys.stderr)
            return 2
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *pythonpath, *base_path]
        runpy.run_path(script, run_name="__main__")
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What an interpreter does after __main__: join non-daemon threads, run atexit
    handlers, flush the standard streams."""
    import atexit
    try:
        threading._shutdown()
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            code = code or 120
    return code


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
