"""python -m tests.sim: run the interleaving harness (see driver.py for what it checks).

    python -m tests.sim --backend file --seed 7 --rounds 6           # one store, 6 rounds
    python -m tests.sim --backend file --seconds 1800 --seed 7       # by hand: a long run

With --seconds, the run goes on store after store (--rounds each, seeds N, N+1, ...)
until the time is spent; every store's seed is printed, so a failure replays with
`--seed <that seed> --rounds <its round + 1>`. Exit status 1 on the first violation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .backends import KINDS
from .driver import FLAVORS, Harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=KINDS, default="file")
    ap.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per store (default 6; 12 with --seconds)")
    ap.add_argument("--seconds", type=float, default=None, help="keep going, store after store, this long")
    ap.add_argument("--focus", choices=sorted(FLAVORS), default=None,
                    help="one flavor of round for every round (default: a seeded mix)")
    ap.add_argument("--stale-skew", dest="stale_skew", action="store_true", default=True,
                    help="gcs declare different leases and writers open with their own gc_lease "
                         "(default: a writer's setting must not decide a gc is dead)")
    ap.add_argument("--no-stale-skew", dest="stale_skew", action="store_false",
                    help="one gc lease per round, no writer setting")
    ap.add_argument("--round-seconds", type=float, default=5.0, help="how long workers run per round")
    ap.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN"),
                    help="PostgreSQL for pg/s3 (default $TEST_PG_DSN, else a server of our own)")
    ap.add_argument("--dir", default=None, help="where journals go (default: a temp dir, removed if all pass)")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory even if all pass")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    if a.seconds is None:
        return Harness(seed, a.backend, rounds=a.rounds or 6, focus=a.focus, stale_skew=a.stale_skew,
                       round_seconds=a.round_seconds, pg_dsn=a.pg_dsn, run_dir=a.dir, keep=a.keep).run()
    stop_at = time.time() + a.seconds
    n = 0
    while time.time() < stop_at:
        run_dir = None if a.dir is None else os.path.join(a.dir, str(seed + n))
        rc = Harness(seed + n, a.backend, rounds=a.rounds or 12, focus=a.focus, stale_skew=a.stale_skew,
                     round_seconds=a.round_seconds, pg_dsn=a.pg_dsn, run_dir=run_dir, keep=a.keep).run(stop_at)
        if rc:
            return rc
        n += 1
    print(f"HARNESS done: {n} store(s), seeds {seed}..{seed + n - 1}, no violation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
