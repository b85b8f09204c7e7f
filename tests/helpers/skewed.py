"""Run a helper script on a host whose wall clock is off by SECONDS.

    python skewed.py SECONDS SCRIPT [ARGS...]

time.time() (and time_ns) of this process answer SECONDS away from the real
clock, as on a host with a wrong clock: what a shared store must not depend on.
The monotonic clocks are untouched (they are per host and never compared).
"""

from __future__ import annotations

import os
import runpy
import sys
import time


def main() -> None:
    skew, script = float(sys.argv[1]), sys.argv[2]
    real, real_ns = time.time, time.time_ns
    time.time = lambda: real() + skew
    time.time_ns = lambda: real_ns() + int(skew * 1e9)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, script), *sys.argv[3:]]
    sys.path[0] = here
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
