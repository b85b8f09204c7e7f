"""Files outside the store's objects: those written for other tools (`tsck checkout`'s
DEST, `tsck du --plot`'s image), whole or not at all; and the rule for every file the
package reads, the store's own included: only a regular file is read (open_regular).

A library that writes a file (torch.save, safetensors) reports a full disk in its own
type (RuntimeError, SafetensorError); write_atomic and write_dir turn that into the
StorageError the rest of the package raises for a full disk (errors.no_space).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import uuid

from ..errors import InvalidArgument, StorageError, TsckError, no_space, storage_error

__all__ = ["write_atomic", "write_dir", "umask", "sync_dir", "open_regular", "NotRegularFile", "reopen_path",
           "MEMORY_FS", "fs_type", "in_memory"]

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """Something other than a regular file (a folder, a FIFO, a device, a socket) where a
    file was to be read. errno EINVAL (EISDIR for a folder, which is also an
    IsADirectoryError): not worth retrying, reading it again changes nothing."""


class _NotRegularDir(NotRegularFile, IsADirectoryError):
    pass


MEMORY_FS = ("tmpfs", "ramfs")  # file systems whose files are host memory


def existing_ancestor(path: str) -> str:
    """`path` resolved, or its nearest ancestor that exists (a directory not made yet)."""
    p = os.path.realpath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def fs_type(path: str) -> str | None:
    """The file system type of the mount holding `path` (its nearest existing ancestor),
    from /proc/self/mountinfo; None where that cannot be read (not Linux)."""
    p = existing_ancestor(path)
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _sep, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                if (p == point or p.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return None
    return kind


def in_memory(path: str) -> bool:
    """Whether `path` is on a file system whose files are host memory (MEMORY_FS)."""
    return fs_type(path) in MEMORY_FS


def not_regular(path: str, mode: int, note: str = "") -> NotRegularFile:
    what = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
    text = f"{path} is {what}, not a regular file" + (f" ({note})" if note else "")
    if stat.S_ISDIR(mode):
        return _NotRegularDir(errno.EISDIR, text)
    return NotRegularFile(errno.EINVAL, text)


def open_regular(path: str, note: str = "") -> int:
    """A descriptor of the regular file at `path`, opened for reading; NotRegularFile
    for anything else. O_NONBLOCK: opening a FIFO would otherwise wait for a writer
    forever. The type is checked on the open file (fstat), not on the name, so nothing
    swapped in after a check is read; a device (a link to /dev/zero) would otherwise be
    read without end. `note` ends the error's text (what the file was for)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode, note)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen_path(fd: int, path: str) -> str:
    """A name that opens the very file `fd` is open on, for libraries that take a path
    (torch.load(mmap=True), safetensors): /proc/self/fd/N where there is one, so a file
    swapped in at `path` after open_regular checked it (a FIFO) is never opened; else
    `path` itself."""
    p = f"/proc/self/fd/{fd}"
    try:
        if os.path.samestat(os.stat(p), os.fstat(fd)):
            return p
    except OSError:
        pass
    return path


def _os_error(e: BaseException) -> OSError | None:
    """The system error behind a library's failure to write a file: an OSError in its
    chain (a Python file object's write), or the errno in its text (safetensors says
    "... (os error 28)"); None when there is none."""
    seen = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, OSError) and x.errno:
            return x
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    m = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", str(e))
    if m:
        n = int(m.group(1) or m.group(2))
        return OSError(n, os.strerror(n))
    return None


def write_error(e: BaseException, dest: str, needed: int | None = None) -> StorageError:
    """What failed while writing `dest` as the StorageError callers see: a full disk says
    so (errors.no_space, with about how many bytes the file needed), any other failure
    names DEST and the cause, in one line."""
    if isinstance(e, StorageError):
        return e
    cause = e if isinstance(e, OSError) else _os_error(e)
    if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space(f"writing {dest}", os.path.dirname(dest) or ".", cause=os.strerror(cause.errno),
                        needed=None if needed is None else f"about {needed} bytes",
                        outcome=f"{dest} is untouched")
    if cause is None:
        text = (str(e).strip().splitlines() or [""])[0][:300]
        cause = OSError(errno.EIO, f"{type(e).__name__}: {text}" if text else type(e).__name__)
    return storage_error(cause, f"writing {dest}")


def _fsync_path(p: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(p, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(d: str) -> None:
    """Make the entries of folder `d` durable (a rename, a link, a removal), where the file
    system can."""
    try:
        _fsync_path(d, getattr(os, "O_DIRECTORY", 0) | os.O_RDONLY)
    except OSError:
        pass  # not every file system syncs a directory


def umask() -> int:
    """The process's umask, read without setting it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_atomic(dest: str, write, *, force: bool, needed: int | None = None) -> None:
    """write(tmp) writes the file under a temporary name beside `dest`; it is synced,
    then takes its name (exclusively unless force): DEST is the whole file or untouched.
    A failure to write is a StorageError (write_error), raised once the temporary file
    is gone, so the free space it names is what is really there; `needed`: about how
    many bytes the file takes, for that error."""
    d = os.path.dirname(dest) or "."
    tmp = os.path.join(d, f".{os.path.basename(dest)}.{uuid.uuid4().hex[:12]}.partial")
    failed = None
    try:
        _write_atomic(dest, tmp, d, write, force)
    except TsckError:
        raise
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise their own types for an I/O error
        failed = e
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    if failed is not None:
        raise write_error(failed, dest, needed) from failed


def _write_atomic(dest: str, tmp: str, d: str, write, force: bool) -> None:
    write(tmp)
    os.chmod(tmp, 0o666 & ~umask())  # safetensors makes its files 0600; DEST is for other tools
    _fsync_path(tmp)
    if force:
        os.replace(tmp, dest)
    else:
        try:
            os.link(tmp, dest)  # fails if DEST appeared meanwhile: never clobbered
        except FileExistsError:
            raise InvalidArgument(f"{dest} exists (pass --force to replace it)") from None
        except OSError:  # a file system without hard links
            if os.path.lexists(dest):
                raise InvalidArgument(f"{dest} exists (pass --force to replace it)") from None
            os.replace(tmp, dest)
    sync_dir(d)  # the file itself is synced


def write_dir(dest: str, fill, *, force: bool, stale=None, needed: int | None = None) -> list[str]:
    """fill(tmp) writes files into an empty temporary directory and returns their names;
    they are synced and moved into DEST. A DEST that does not exist appears whole (the
    directory is renamed into place); in an existing one each file takes its name
    atomically, an existing file only with force (checked before any is moved), and
    then the files stale(name) says an earlier write left (an older export's shards)
    are removed, so DEST never mixes the two. A failure is a StorageError, as for
    write_atomic. -> the names written."""
    dest = os.path.abspath(dest)
    parent = os.path.dirname(dest)
    exists = os.path.isdir(dest)
    where = dest if exists else parent
    tmp = os.path.join(where, f".{os.path.basename(dest)}.{uuid.uuid4().hex[:12]}.partial")
    failed = None
    try:
        os.mkdir(tmp)
        return _write_dir(dest, tmp, parent, exists, fill, force, stale)
    except TsckError:
        raise
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise their own types for an I/O error
        failed = e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raise write_error(failed, dest, needed) from failed


def _write_dir(dest: str, tmp: str, parent: str, exists: bool, fill, force: bool, stale) -> list[str]:
    names = list(fill(tmp))
    mode = 0o666 & ~umask()
    for n in names:
        os.chmod(os.path.join(tmp, n), mode)  # safetensors makes its files 0600
        _fsync_path(os.path.join(tmp, n))
    if not exists:
        if os.path.lexists(dest):  # appeared meanwhile: never clobbered
            raise InvalidArgument(f"{dest} exists (pass --force to write into it)")
        os.chmod(tmp, 0o777 & ~umask())
        os.rename(tmp, dest)
        sync_dir(parent)
        return names
    if not force:
        there = [n for n in names if os.path.lexists(os.path.join(dest, n))]
        if there:
            raise InvalidArgument(f"{os.path.join(dest, there[0])} exists (pass --force to replace it)")
    for n in names:
        os.replace(os.path.join(tmp, n), os.path.join(dest, n))
    if stale is not None:
        keep = set(names)
        for n in sorted(os.listdir(dest)):
            if n not in keep and stale(n) and os.path.isfile(os.path.join(dest, n)):
                os.unlink(os.path.join(dest, n))
    sync_dir(dest)
    return names
