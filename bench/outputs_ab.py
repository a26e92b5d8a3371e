"""Token-for-token outputs of two source trees' engines on one workload (A/B of a host-side change
that must not change any output).

Usage (on the GPU): ``python bench/outputs_ab.py --old DIR [--new DIR] [--ckpt CKPT]
[--device cuda]``; ``--device cpu`` (with a small ``--ckpt``) is a smoke run of the script.

Each tree's engine (the server's defaults -- CUDA graphs, async scheduling, bf16 -- with at most
32 sequences, so fewer graphs to capture) runs in a fresh process, in the order old, new, old:
requests join while others decode (decode graphs of several batch sizes, compositions changing
every few steps) and leave at different lengths, with greedy,
seeded random (temperature, top-k, top-p), logprobs, and host-state sampling (min_tokens,
penalties: deferred sampling) rows; unseeded random rows are left out (their seeds differ per
process). The two old runs show whether the engine is deterministic on this device; the new
run must give the old run's tokens (and logprob entries within 1e-3). Prints one line per
comparison and exits 1 when new differs from an old run that repeated itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def workload(SamplingParams) -> list[tuple[int, str, list[int], object]]:
    """(step at which it is added, id, prompt, params) of every request."""
    rng = random.Random(0)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=20, seed=2),
        dict(temperature=0.7, top_p=0.9, seed=3),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.6, seed=4, min_tokens=6, presence_penalty=0.5),
    ]
    out = [(0, "solo", [rng.randrange(1000, 30000) for _ in range(1024)], dict(temperature=0.0))]
    for i in range(18):
        prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(8, 300))]
        out.append((40 + 3 * i, f"r{i}", prompt, kinds[i % len(kinds)]))
    return [
        (at, rid, prompt, SamplingParams(max_tokens=24 + 7 * (k % 9), ignore_eos=True, **kw))
        for k, (at, rid, prompt, kw) in enumerate(out)
    ]


def run_tree(tree: str, ckpt: str, device: str) -> dict:
    """The tree's outputs: request id -> (token ids, logprob entries)."""
    sys.path.insert(0, tree)
    import torch

    from bench.ab_engine import load_engine_api

    build, EngineConfig, SamplingParams = load_engine_api(Path(tree))
    cuda = device.startswith("cuda")
    eng = build(  # the server's defaults, but 32 sequences: fewer graphs to capture
        EngineConfig(
            model=ckpt,
            device=device,
            dtype=torch.bfloat16 if cuda else torch.float32,
            max_model_len=4096,
            max_num_seqs=32,
            enable_prefix_caching=False,
        )
    )
    pending = workload(SamplingParams)
    tokens: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            eng.add_request(rid, prompt, params)
            tokens[rid], logprobs[rid] = [], []
        outs, _ = eng.step()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += o.logprobs
        step += 1
    return {"tokens": tokens, "logprobs": logprobs, "steps": step}


def compare(a: dict, b: dict) -> list[str]:
    """Differences of b from a, one line each (empty: the same)."""
    diffs = []
    for rid, want in a["tokens"].items():
        got = b["tokens"].get(rid)
        if got != want:
            k = next((i for i, (x, y) in enumerate(zip(want, got or [])) if x != y), None)
            diffs.append(f"{rid}: tokens differ (first at {k}; lengths {len(want)}, {len(got)})")
            continue
        for i, (x, y) in enumerate(zip(a["logprobs"][rid], b["logprobs"][rid], strict=True)):
            if (x is None) != (y is None) or (
                x is not None
                and (
                    abs(x[0] - y[0]) > 1e-3
                    or [t for t, _ in x[1]] != [t for t, _ in y[1]]
                    or any(abs(p - q) > 1e-3 for (_, p), (_, q) in zip(x[1], y[1]))
                )
            ):
                diffs.append(f"{rid}: logprobs differ at token {i}: {x} vs {y}")
                break
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="the reference tree")
    ap.add_argument("--new", default=str(REPO))
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one tree, JSON out
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_tree(args.child, args.ckpt, args.device)))
        return 0
    if args.device.startswith("cuda"):
        sys.path.insert(0, str(REPO))
        from bench.common import random_qwen3_checkpoint

        random_qwen3_checkpoint(args.ckpt)
    runs = {}
    for name, tree in (("old", args.old), ("new", args.new), ("old again", args.old)):
        tree = str(Path(tree).resolve())
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                tree,
                "--ckpt",
                args.ckpt,
                "--device",
                args.device,
            ],
            capture_output=True,
            text=True,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"},
        )
        if out.returncode:
            print(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            return 2
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        n = sum(len(t) for t in runs[name]["tokens"].values())
        print(f"{name} ({tree}): {runs[name]['steps']} steps, {n} tokens", flush=True)
    repeat = compare(runs["old"], runs["old again"])
    diffs = compare(runs["old"], runs["new"])
    print(f"old vs old again: {'same' if not repeat else f'{len(repeat)} differ'}")
    print(f"old vs new: {'same' if not diffs else f'{len(diffs)} differ'}")
    for line in (repeat + diffs)[:20]:
        print("  " + line)
    return 1 if diffs and not repeat else 0


if __name__ == "__main__":
    sys.exit(main())
