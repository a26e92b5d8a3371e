"""Where a lone long prompt's time to first token goes: the engine in this process, one prompt of
``--prompt`` random tokens (no prefix-cache hit), every step of its prefill under torch's
profiler, GPU time summed per kernel and per kernel family (issue 20's 32k TTFT).

Usage (GPU)::

    python3 bench/prefill_profile.py [--ckpt /tmp/qwen3-0.6b-random] [--prompt 32000]
        [--top 25] [-- EngineConfig overrides as KEY=VALUE ...]

Prints the TTFT of an unprofiled run (wall clock from ``add_request`` to the first token, after
a warm-up prompt of the same length so that compilation and graph capture stay out), the
number of steps, then for the profiled run: GPU busy time (sum of kernel times) against the wall
time (the difference is host time the GPU waited for), the families (prompt attention, its
split merge, GEMMs, norms / rotary / KV store, sampling, other) and the top kernels.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.step_times import _overrides  # noqa: E402

#: kernel-name fragments of each family, first match wins (lower case)
FAMILIES = (
    ("prompt attention", ("_prefill_kernel", "prefill_attn", "flash", "fmha")),
    ("split merge", ("_prefill_merge",)),
    ("decode attention", ("decode",)),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "_mm_")),
    ("norm / rotary / kv store", ("norm", "rope", "rotary", "kv_store", "store_kv", "qk_")),
    ("activation", ("silu", "swiglu", "act_")),
    ("sampling", ("sampl", "argmax", "topk", "softmax")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--prompt", type=int, default=32000)
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled first-token runs timed")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script's logic only")
    ap.add_argument("overrides", nargs="*", help="EngineConfig fields, KEY=VALUE")
    args = ap.parse_args()

    import torch

    from bench.common import random_qwen3_checkpoint
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.worker.build import build_engine

    if not Path(args.ckpt, "config.json").exists():
        random_qwen3_checkpoint(args.ckpt)
    fields = dict(
        model=args.ckpt,
        device=args.device,
        dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    fields.update(_overrides(args.overrides))
    engine = build_engine(EngineConfig(**fields))
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def ttft(rid: str) -> tuple[float, int]:
        ids = [rng.randrange(1000, 30000) for _ in range(args.prompt)]
        sync()
        t0 = time.perf_counter()
        engine.add_request(rid, ids, params)
        steps = 0
        got = None
        while engine.has_unfinished():
            outputs, _ = engine.step()
            steps += 1
            for o in outputs:
                if o.new_token_ids and got is None:
                    got = time.perf_counter()
        sync()
        return 1e3 * ((got or time.perf_counter()) - t0), steps

    label = " ".join(args.overrides) or "default"
    ttft("warm-0")
    times = [ttft(f"t{i}")[0] for i in range(args.repeats)]
    _, steps = ttft("steps")
    print(
        f"[{label}] prompt {args.prompt}: TTFT {' / '.join(f'{t:.1f}' for t in times)} ms "
        f"(unprofiled runs; mean {statistics.mean(times):.2f}, median "
        f"{statistics.median(times):.2f}), {steps} steps"
    )
    act = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[act.CUDA] if args.device == "cuda" else [act.CPU])
    t0 = time.perf_counter()
    with prof:
        ttft("profiled")
    wall = 1e3 * (time.perf_counter() - t0)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if args.device != "cuda" or ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_kernel[ev.name]
            us = getattr(ev, "device_time_total", None) if args.device == "cuda" else None
            rec[0] += (us if us is not None else ev.cpu_time_total) / 1e3
            rec[1] += 1
    busy = sum(v[0] for v in per_kernel.values())
    fams: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        fams[family(name)] += ms
    print(
        f"[{label}] profiled run: wall {wall:.1f} ms, GPU kernel time {busy:.1f} ms "
        f"({100 * busy / wall:.0f} % busy)"
    )
    print("| family | ms | % of kernel time |\n|---|---|---|")
    for fam, ms in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"| {fam} | {ms:.1f} | {100 * ms / busy:.1f} |")
    print("| kernel | family | calls | ms |\n|---|---|---|---|")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {name[:90]} | {family(name)} | {n} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
