"""Decode-step anatomy of one source tree's engine: kernels per step, GPU time per kernel, TPOT.

Usage (on the GPU): ``python bench/decode_profile.py --tree DIR --ckpt CKPT [--batch 1 64]``.

Builds the tree's engine with the server's defaults (bf16, CUDA graphs, async scheduling; prefix
caching off), and for each batch size B runs B requests of a ``--prompt-tokens`` prompt
(default 1,024; distinct random tokens) to their decode phase, then

* times ``--steps`` decode steps on the host clock (``tpot_ms``: mean step time);
* profiles ``--profile-steps`` more with ``torch.profiler`` (CUPTI reports the kernels a CUDA
  graph replays) and prints kernels per step, summed kernel time per step (the GPU's busy time;
  ``step - busy`` is the bubble), and the kernels grouped by name: launches per step and
  microseconds per step;
* ``weights_gb`` / ``tpot`` gives the bandwidth the step reaches on the weights alone.

Prints one JSON line per batch size (``{"batch", "tpot_ms", "kernels_per_step",
"gpu_busy_us_per_step", "weights_gb", "weight_tb_s", "top": [[name, launches/step, us/step]]}``)
and a Markdown table of the top kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ab_engine import load_engine_api, server_default_engine  # noqa: E402


def short(name: str, width: int = 70) -> str:
    """A kernel name without template arguments, cut to ``width`` characters."""
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).replace("void ", "")
    return s[:width]


def kernel_table(prof, steps: int) -> tuple[int, float, list[tuple[str, float, float]]]:
    """(kernels per step, GPU busy microseconds per step, [(name, launches/step, us/step)])."""
    from torch.autograd import DeviceType

    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or e.name.startswith(("Memcpy", "Memset")):
            continue
        row = by_name[short(e.name)]
        row[0] += 1
        row[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    rows = sorted(
        ((n, c / steps, us / steps) for n, (c, us) in by_name.items()), key=lambda r: -r[2]
    )
    count = sum(c for _, c, _ in rows)
    busy = sum(us for _, _, us in rows)
    return round(count), busy, rows


def host_profile(eng, steps: int, sync, top: int = 14) -> list[tuple[str, float, float, float]]:
    """cProfile of ``steps`` engine steps: [(function, calls/step, own us/step, cumulative
    us/step)] for the ``top`` functions by own time (the host work async scheduling overlaps
    with the GPU; cProfile's overhead inflates it, so read it as proportions)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    sync()
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append(
            (f"{Path(file).name}:{line}({fn})", nc / steps, 1e6 * tt / steps, 1e6 * ct / steps)
        )
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="each request's prompt")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--label", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the host work")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (the engine's option)")
    ap.add_argument(
        "--dummy",
        action="store_true",
        help="--ckpt is a directory with config.json only (bench/fp8.py's Qwen3-8B shape): dummy "
        "weights, no random checkpoint written",
    )
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    # the tree's engine and kernels first: the checkpoint writer imports transformers, which
    # probes for (and imports) a top-level package named ``kernels`` -- it would bind this
    # repository's instead of the tree's
    build, EngineConfig, SamplingParams = load_engine_api(tree)
    from bench.common import random_qwen3_checkpoint

    if not args.dummy:
        random_qwen3_checkpoint(args.ckpt)
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    overrides = {"quantization": args.quantization} if args.quantization else {}
    if args.dummy:
        overrides["load_format"] = "dummy"
    eng = server_default_engine(build, EngineConfig, args.ckpt, args.device, **overrides)
    weights_gb = (
        sum(p.numel() * p.element_size() for p in eng.executor.model.parameters()) / 1e9
        if hasattr(eng, "executor") and hasattr(eng.executor, "model")
        else float("nan")
    )
    rng = random.Random(7)
    label = args.label or tree.name
    total = args.steps + 2 * args.profile_steps + 8
    for b in args.batch:
        sp = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for i in range(b):
            prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt_tokens)]
            eng.add_request(f"b{b}-{i}", prompt, sp)
        # run until every request decodes (all prompts done), plus a few steps
        for _ in range(200):
            eng.step()
            if (
                all(r.num_computed_tokens >= args.prompt_tokens for r in eng.scheduler.running)
                and len(eng.scheduler.running) == b
            ):
                break
        for _ in range(4):
            eng.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        sync()
        tpot = 1e3 * (time.perf_counter() - t0) / args.steps
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                eng.step()
            sync()
        count, busy, rows = kernel_table(prof, args.profile_steps)
        host = host_profile(eng, args.profile_steps, sync) if args.host_profile else None
        while eng.has_unfinished():
            eng.step()
        res = {
            "tree": label,
            "batch": b,
            "tpot_ms": round(tpot, 4),
            "kernels_per_step": count,
            "gpu_busy_us_per_step": round(busy, 1),
            "weights_gb": round(weights_gb, 3),
            "weight_tb_s": round(weights_gb / tpot, 3),
            "top": [[n, round(c, 2), round(us, 2)] for n, c, us in rows[: args.top]],
        }
        print(json.dumps(res), flush=True)
        print(
            f"\n{label}, batch {b}: step {tpot * 1e3:.0f} us, {count} kernels/step, GPU busy "
            f"{busy:.0f} us/step ({100 * busy / (tpot * 1e3):.0f} %), weights {weights_gb:.2f} GB "
            f"-> {weights_gb / tpot:.2f} TB/s\n"
        )
        print("| kernel | launches/step | us/step |\n|---|---|---|")
        for n, c, us in rows[: args.top]:
            print(f"| `{n}` | {c:.2f} | {us:.1f} |")
        if host:
            print(f"\nhost (cProfile of {args.profile_steps} steps, us per step, by own time):\n")
            print("| function | calls/step | own us/step | cumulative us/step |\n|---|---|---|---|")
            for name, calls, own, cum in host:
                print(f"| `{name}` | {calls:.1f} | {own:.1f} | {cum:.1f} |")


if __name__ == "__main__":
    main()
