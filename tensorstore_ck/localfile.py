"""Files written for other tools (`tsck checkout`'s DEST, `tsck du --plot`'s image): whole
or not at all. Not the store's own objects (those go through storage/)."""

from __future__ import annotations

import os
import uuid

from .errors import InvalidArgument

__all__ = ["write_atomic", "umask", "sync_dir"]


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
