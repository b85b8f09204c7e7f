"""Real filesystems for hostile-environment tests: a small tmpfs (to fill), a read-only
mount. Mounting needs root (CAP_SYS_ADMIN); where it fails the test is skipped with the
reason, never faked with a mock."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

__all__ = ["tmpfs", "fill", "remount"]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(path, size: str = "8m"):
    """A tmpfs of `size` mounted at `path` (created), unmounted afterwards."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    try:
        r = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)
    except FileNotFoundError:
        pytest.skip("no mount(8) here: cannot make a small filesystem to fill")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        remount(path, "rw")  # a read-only test may leave it ro; umount works either way
        if _run("umount", path).returncode != 0:
            _run("umount", "-l", path)  # busy (a child still holds a file): detach it


def remount(path, mode: str) -> None:
    """Remount `path` "ro" or "rw" (the data stays)."""
    r = _run("mount", "-o", f"remount,{mode}", str(path))
    if r.returncode != 0 and mode == "ro":
        pytest.skip(f"cannot remount {path} read-only here: {r.stderr.strip()}")


def fill(dirpath) -> list[str]:
    """Fill the filesystem of `dirpath` to the last byte with filler files; their paths
    (delete them to free the space)."""
    made = []
    for chunk in (1 << 20, 1 << 16, 4096, 512, 1):
        p = os.path.join(str(dirpath), f"filler-{chunk}")
        made.append(p)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            buf = b"\0" * chunk
            while True:
                try:
                    if os.write(fd, buf) < chunk:
                        break
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    break
        finally:
            os.close(fd)
    st = os.statvfs(str(dirpath))
    assert st.f_bavail == 0, f"could not fill {dirpath}: {st.f_bavail * st.f_frsize} bytes left"
    return made
