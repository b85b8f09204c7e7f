#!/usr/bin/env python
"""PostgreSQL ref table: latency of one compare-and-swap and one read, on a server this
script starts on 127.0.0.1 (initdb/pg_ctl, like the tests' fixture).

    PYTHONPATH=. python benches/bench_pg_reftable.py [N]

N operations of each kind per round (default 300), 3 rounds; prints the median round
and every round (ms per operation). What it measures: the pool's hand-off and check,
and the idempotency token each write transaction writes (docs/design/reftable.md, "The
PostgreSQL ref table across a lost connection").
"""

import os
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _pgserver import PgServer, pg_bindir  # noqa: E402

from tensorstore_ck.refs.postgres import PostgresRefTable  # noqa: E402


def main(n: int = 300) -> None:
    if pg_bindir() is None:
        sys.exit("PostgreSQL server binaries are not installed")
    srv = PgServer(pg_bindir())
    try:
        t = PostgresRefTable(srv.dsn, namespace=uuid.uuid4().hex)
        cur = None
        for _ in range(50):  # warm up: connections, prepared statements
            new = os.urandom(32)
            t.compare_and_swap("r", cur, new, message="w")
            cur = new
        res: dict[str, list[float]] = {"cas": [], "read": []}
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                new = os.urandom(32)
                t.compare_and_swap("r", cur, new, message="w")
                cur = new
            res["cas"].append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n):
                t.get_or_none("r")
            res["read"].append((time.perf_counter() - t0) / n)
        t.close()
        for k, v in res.items():
            print(f"{k:5} {sorted(v)[1] * 1e3:.2f} ms (rounds: {', '.join(f'{x * 1e3:.2f}' for x in v)})")
    finally:
        srv.remove()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
