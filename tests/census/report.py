"""Sum up a census (tests/census/sitecustomize.py):

    python tests/census/report.py FILE [--top N]

prints how many interpreters started, how many ended normally (the rest were killed,
or forked away), their CPU time, the part in interpreters that imported torch, and
the heaviest kinds of process (script @ the test's temporary folder)."""

from __future__ import annotations

import argparse
import collections
import re


def kind(argv: str) -> str:
    """A process's kind: its script, and the test (its tmp_path's name) or harness run."""
    script = (argv.split() or ["?"])[0].rsplit("/", 1)[-1]
    m = re.search(r"popen-gw\d+/([A-Za-z0-9_-]+?)\d*(/|$)", argv)
    where = m.group(1)[:30] if m else ("harness" if "tsck-sim" in argv else "-")
    return f"{script[:28]} @ {where}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    started, ended = {}, []
    with open(a.file) as f:
        for line in f:
            x = line.rstrip("\n").split("\t")
            if x[0] == "START" and len(x) == 3:
                started[x[1]] = x[2]
            elif len(x) == 5:
                ended.append((x[0], float(x[1]), float(x[2]), x[3] == "1", x[4]))
    cpu = sum(e[2] for e in ended)
    torch = [e for e in ended if e[3]]
    print(f"{len(started)} interpreters started, {len(ended)} ended normally ({cpu:.0f} CPU-s), "
          f"{len(started) - len(ended)} killed or not ended")
    print(f"{len(torch)} of those imported torch ({sum(e[2] for e in torch):.0f} CPU-s)")
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in ended:
        by[kind(e[4])][0] += 1
        by[kind(e[4])][1] += e[2]
    for k, (n, c) in sorted(by.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{c:8.1f} CPU-s {n:5d} processes  {k}")


if __name__ == "__main__":
    main()
