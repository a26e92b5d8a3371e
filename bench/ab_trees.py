"""A/B of two source trees on the GPU in one call: engine-only figures interleaved, plus serving.

Usage (on the GPU):
``python bench/ab_trees.py --old DIR --new DIR [--repeats 3] [--serve-conc 64]``.
Runs ``bench/ab_engine.py`` for old, new, old, new, ... (each run a fresh process with its own
engine and distinct latency prompts), then one ``bench/serve.py`` level per tree with the server
started from that tree, and prints a table of medians with the spread (max - min) of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=str(REPO))
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--tokenizer-from", default=str(REPO / ".benchassets/tokenizer"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-conc", type=int, nargs="*", default=[64])
    ap.add_argument("--out", default="/tmp")
    ap.add_argument(
        "--engine-args",
        action="append",
        default=[],
        help="an extra argument of bench/ab_engine.py (repeatable)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from bench.common import random_qwen3_checkpoint

    random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rep in range(args.repeats):
        for name, tree in trees.items():
            out = subprocess.run(
                [
                    sys.executable,
                    str(REPO / "bench/ab_engine.py"),
                    "--tree",
                    str(tree),
                    "--ckpt",
                    args.ckpt,
                    "--seed",
                    str(rep),
                    *args.engine_args,
                ],
                capture_output=True,
                text=True,
                cwd=tree,
                env={**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"},
            )
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not line:
                print(
                    f"{name} run {rep} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}",
                    flush=True,
                )
                continue
            r = json.loads(line[-1])
            runs[name].append(r)
            print(name, rep, r, flush=True)
    serve: dict[str, list[dict]] = {}
    for name, tree in trees.items():
        if not args.serve_conc:
            break
        out = subprocess.run(
            [
                sys.executable,
                str(REPO / "bench/serve.py"),
                "--ckpt",
                args.ckpt,
                "--skip-peer",
                "--server-root",
                str(tree),
                "--out",
                f"{args.out}/serve_{name}",
                "--concurrency",
                *map(str, args.serve_conc),
            ],
            capture_output=True,
            text=True,
        )
        rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
        serve[name] = rows
        if not rows:
            print(f"serve {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}", flush=True)
    print(
        "\n| tree | runs | offline tok/s median (spread) | batch-1 TTFT ms median (spread) "
        "| batch-1 TPOT ms median (spread) | start-up s |"
    )
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        if not rs:
            continue
        cells = []
        for key in ("offline_tok_s", "ttft_ms", "tpot_ms"):
            xs = [r[key] for r in rs]
            cells.append(
                f"{statistics.median(xs):.6g} ({max(xs) - min(xs):.3g}; "
                f"{', '.join(f'{x:g}' for x in xs)})"
            )
        print(
            f"| {name} | {len(rs)} | "
            + " | ".join(cells)
            + f" | {statistics.median(r['startup_s'] for r in rs):.0f} |"
        )
    if serve:
        print(
            "\n| tree | conc | done | out tok/s | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms "
            "| ITL mean/med/p99 ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, rows in serve.items():
            for r in rows:
                print(
                    f"| {name} | {r['concurrency']} | {r['completed']} | {r['out_tok_s']:.0f} "
                    f"| {r['ttft_mean']:.1f}/{r['ttft_median']:.1f}/{r['ttft_p99']:.1f} "
                    f"| {r['tpot_mean']:.2f}/{r['tpot_median']:.2f}/{r['tpot_p99']:.2f} "
                    f"| {r['itl_mean']:.2f}/{r['itl_median']:.2f}/{r['itl_p99']:.2f} |"
                )


if __name__ == "__main__":
    main()
