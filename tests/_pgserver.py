"""A real PostgreSQL server on 127.0.0.1 in a temporary directory (initdb, pg_ctl),
for the session fixture `pg_dsn` and for tests that stop or restart their own."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a server's, a rendezvous')."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pg_bindir() -> str | None:
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(bins[-1]) if bins else None


class PgServer:
    """initdb + pg_ctl start on a free port; stop(), start(), restart(), remove()."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.tmp = tempfile.mkdtemp(prefix="tsck-pg-")
        self.as_user = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            shutil.chown(self.tmp, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        self.data = os.path.join(self.tmp, "data")
        subprocess.run(self.as_user + [f"{bindir}/initdb", "-D", self.data, "-U", "postgres", "-A", "trust",
                                       "-E", "UTF8", "--no-sync"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.start()

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _ctl(self, *args, check=True):
        subprocess.run(self.as_user + [f"{self.bindir}/pg_ctl", "-D", self.data, *args], check=check,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self._ctl("-l", f"{self.tmp}/log", "-w", "-t", "30", "-o",
                  f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.tmp} -c fsync=off", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")

    def restart(self) -> None:
        self._ctl("-m", "fast", "-w", "-t", "30", "-l", f"{self.tmp}/log", "restart")

    def remove(self) -> None:
        self._ctl("-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)
