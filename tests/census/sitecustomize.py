"""Where the suite's CPU goes, by process: with this folder on PYTHONPATH and
PYCENSUS_LOG=FILE, every Python interpreter the suite starts (pytest, its xdist
workers, each helper script, CLI call and harness worker; not the ranks they fork)
appends a START line, and at a normal exit its wall time, CPU time (user + sys, its
own), whether it imported torch, and its command line. Measurement only: nothing in
the suite reads it. tests/census/report.py sums it up (docs/TESTING.md, "Where the
suite's time goes")."""

import os

_LOG = os.environ.get("PYCENSUS_LOG")
if _LOG:
    import atexit
    import sys
    import time

    _T0 = time.time()

    def _line(*fields) -> None:
        try:
            with open(_LOG, "a") as f:
                f.write("\t".join(str(x).replace("\t", " ").replace("\n", " ") for x in fields) + "\n")
        except OSError:
            pass

    def _done() -> None:
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF)
        _line(os.getpid(), f"{time.time() - _T0:.2f}", f"{ru.ru_utime + ru.ru_stime:.2f}", int("torch" in sys.modules),
              " ".join(sys.argv)[:300])

    atexit.register(_done)
    _line("START", os.getpid(), " ".join(sys.argv)[:300])
