"""Files written for other tools (`tsck checkout`'s DEST, `tsck du --plot`'s image): whole
or not at all. Not the store's own objects (those go through storage/)."""

from __future__ import annotations

import os
import shutil
import uuid

from .errors import InvalidArgument

__all__ = ["write_atomic", "write_dir", "umask", "sync_dir"]


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


def write_atomic(dest: str, write, *, force: bool) -> None:
    """write(tmp) writes the file under a temporary name beside `dest`; it is synced,
    then takes its name (exclusively unless force): DEST is the whole file or untouched."""
    d = os.path.dirname(dest) or "."
    tmp = os.path.join(d, f".{os.path.basename(dest)}.{uuid.uuid4().hex[:12]}.partial")
    try:
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
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def write_dir(dest: str, fill, *, force: bool, stale=None) -> list[str]:
    """fill(tmp) writes files into an empty temporary directory and returns their names;
    they are synced and moved into DEST. A DEST that does not exist appears whole (the
    directory is renamed into place); in an existing one each file takes its name
    atomically, an existing file only with force (checked before any is moved), and
    then the files stale(name) says an earlier write left (an older export's shards)
    are removed, so DEST never mixes the two. -> the names written."""
    dest = os.path.abspath(dest)
    parent = os.path.dirname(dest)
    exists = os.path.isdir(dest)
    where = dest if exists else parent
    tmp = os.path.join(where, f".{os.path.basename(dest)}.{uuid.uuid4().hex[:12]}.partial")
    os.mkdir(tmp)
    try:
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
