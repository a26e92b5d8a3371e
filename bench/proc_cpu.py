"""CPU use of the server's processes while a benchmark runs (Linux ``/proc``).

Usage: ``python bench/proc_cpu.py --root PID [--interval 1] --out FILE.json`` in the background,
stopped with SIGTERM/SIGINT: every ``interval`` seconds it reads the CPU time (user + system) of
``PID`` and all its descendants, and at the end writes, per process (pid, parent, name from
its command line), the busiest window's CPU use in percent of one core and the mean over the
windows in which the process used any CPU. Used to show how the HTTP work of a serving run is spread
over the API-server processes (``--api-server-count``) and what the engine core uses.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, ValueError, IndexError):
        return None


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        text = " ".join(p.decode(errors="replace") for p in parts if p)
    except OSError:
        return "?"
    if "multiprocessing.spawn" in text or "multiprocessing.forkserver" in text:
        return "spawned child"
    return text[:80]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=int, required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    last: dict[int, float] = {}
    windows: dict[int, list[float]] = {}
    names: dict[int, str] = {}
    parents: dict[int, int] = {}
    t_last = time.monotonic()
    while not stop:
        time.sleep(args.interval)
        now = time.monotonic()
        for pid in _tree(args.root):
            cpu = _cpu_seconds(pid)
            if cpu is None:
                continue
            names.setdefault(pid, _name(pid))
            parents.setdefault(pid, _ppid(pid))
            if pid in last:
                windows.setdefault(pid, []).append(100 * (cpu - last[pid]) / (now - t_last))
            last[pid] = cpu
        t_last = now
    report = []
    for pid, w in windows.items():
        busy = [x for x in w if x > 1.0]
        report.append(
            {
                "pid": pid,
                "ppid": parents.get(pid, -1),
                "name": names.get(pid, "?"),
                "max_pct": round(max(w), 1),
                "mean_busy_pct": round(sum(busy) / len(busy), 1) if busy else 0.0,
                "cpu_s": round(last.get(pid, 0.0), 1),
            }
        )
    report.sort(key=lambda r: -r["cpu_s"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
