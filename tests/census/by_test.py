"""Sum up a per-test CPU log ($TESTS_CPU_LOG; tests/_zygote.py's cpu_log):

    TESTS_CPU_LOG=/tmp/cpu.tsv .venv/bin/python -m pytest -q -n 3 --dist loadscope
    python tests/census/by_test.py /tmp/cpu.tsv [--top N] [--by file|test]

prints the suite's CPU-seconds by test file (or test), heaviest first: the test's pytest
worker, the plain processes it waited for, and the zygote's forks it asked for (each with
the descendants it waited for). A module's shared fixtures count toward its first test."""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by", choices=("file", "test"), default="file")
    a = ap.parse_args()
    by = collections.defaultdict(lambda: collections.Counter())
    with open(a.file) as f:
        for line in f:
            cpu, what, test = line.rstrip("\n").split("\t")
            key = (test.split("::")[0] if a.by == "file" else test) or "(no test)"
            by[key][what] += float(cpu)
    total = sum(sum(c.values()) for c in by.values())
    print(f"{total:.0f} CPU-s in all")
    for k, c in sorted(by.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]:
        parts = ", ".join(f"{w} {v:.0f}" for w, v in sorted(c.items()))
        print(f"{sum(c.values()):8.1f} CPU-s  {k}  ({parts})")


if __name__ == "__main__":
    main()
