"""Summarise a py-spy raw (collapsed) profile: top self frames and top inclusive functions per
process.

Usage: ``python bench/pyspy_top.py FILE [--n 25]``
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--n", type=int, default=25)
    args = ap.parse_args()
    self_t: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in open(args.file):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        proc = frames[0] if frames[0].startswith("process") else "?"
        n = int(count)
        totals[proc] += n
        self_t[proc][frames[-1]] += n
        for f in set(frames[1:]):
            incl[proc][f] += n
    for proc, total in totals.most_common():
        print(f"== {proc}: {total} samples")
        print("-- self")
        for f, n in self_t[proc].most_common(args.n):
            print(f"{100 * n / total:5.1f}%  {f}")
        print("-- inclusive")
        for f, n in incl[proc].most_common(args.n):
            print(f"{100 * n / total:5.1f}%  {f}")


if __name__ == "__main__":
    main()
