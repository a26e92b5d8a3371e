"""Where the time of the offline workload goes: per-phase host timings and a kernel profile.

Usage (on the GPU): ``python bench/profile_offline.py [--ckpt DIR]``. Runs nano-vllm's workload
(see ``bench/offline.py``) once with wall-clock timers around the engine's phases (schedule,
input preparation, forward, sampling, output processing), then profiles a few steady decode
steps at full batch with torch.profiler and prints the top kernels by CUDA time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

import engine.worker.model_runner as mr
from bench.common import nano_vllm_workload, random_qwen3_checkpoint
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine


def timed(acc: dict, key: str, fn, sync: bool = False):
    def wrapper(*a, **kw):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **kw)
        if sync:
            torch.cuda.synchronize()
        acc[key] += time.perf_counter() - t
        return out

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--sync", action="store_true", help="turn async scheduling off")
    args = ap.parse_args()
    ckpt = str(random_qwen3_checkpoint(args.ckpt))
    eng = build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=4096,
            max_num_seqs=256,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            async_scheduling=not args.sync,
        ),
        eos_token_ids=frozenset(),
    )
    prompts, out_lens = nano_vllm_workload(256)
    eng.generate([prompts[0][:64]], SamplingParams(max_tokens=8, ignore_eos=True))

    acc: dict[str, float] = defaultdict(float)
    runner = eng.executor
    orig = (eng.scheduler.schedule, mr.prepare_inputs, runner.launch, mr.StepHandle.result)
    eng.scheduler.schedule = timed(acc, "schedule", eng.scheduler.schedule)
    mr.prepare_inputs = timed(acc, "prepare_inputs", mr.prepare_inputs)
    runner.launch = timed(acc, "launch (incl. prepare_inputs)", runner.launch)
    mr.StepHandle.result = timed(acc, "wait for the GPU (StepHandle.result)", mr.StepHandle.result)
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    prefill_ms = []
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        s = time.perf_counter()
        outs, st = eng.step()
        dt = time.perf_counter() - s
        kind = "decode" if st.num_prompt_tokens == 0 else "prefill/mixed"
        if st.num_prompt_tokens:
            prefill_ms.append(round(1e3 * dt, 1))
        kinds[kind][0] += 1
        kinds[kind][1] += dt
        kinds[kind][2] += st.num_running
    total = time.perf_counter() - t0
    print(
        f"workload: {sum(out_lens)} output tokens in {total:.2f} s = "
        f"{sum(out_lens) / total:.0f} tok/s "
        f"(async scheduling {eng.async_scheduling})"
    )
    for k, (n, sec, run) in kinds.items():
        print(
            f"  {k}: {n} steps, {sec:.2f} s, {1e3 * sec / max(n, 1):.2f} ms/step, "
            f"mean running {run / max(n, 1):.1f}"
        )
    print(f"  prefill/mixed step times (ms): {prefill_ms}")
    acc["engine outside schedule/launch/wait"] = (
        total
        - acc["schedule"]
        - acc["launch (incl. prepare_inputs)"]
        - acc["wait for the GPU (StepHandle.result)"]
    )
    for k, v in acc.items():
        print(f"  {k:55s} {v:7.2f} s  {100 * v / total:5.1f} %")
    eng.scheduler.schedule, mr.prepare_inputs, runner.launch, mr.StepHandle.result = orig

    # steady decode at full batch: 256 requests, 500-token prompts. The prompts' prefill takes
    # ~15 steps (steps with decodes carry a bounded prompt share), so step until three steps in
    # a row carry no prompt token with all 256 running, then profile 5 decode steps.
    for i in range(256):
        eng.add_request(
            f"d{i}",
            prompts[i % 256][:100] * 5,
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512),
        )
    pure, warm_steps = 0, 0
    while pure < 3 and warm_steps < 400:
        _, st = eng.step()
        warm_steps += 1
        pure = pure + 1 if st.num_prompt_tokens == 0 and st.num_running == 256 else 0
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats = [eng.step()[1] for _ in range(5)]
        torch.cuda.synchronize()
    print(
        f"decode profile after {warm_steps} warm-up steps: "
        f"rows {[s.num_running for s in stats]}, "
        f"prompt tokens {[s.num_prompt_tokens for s in stats]} (5 steps)"
    )
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
    print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    for i in range(256):
        eng.abort(f"d{i}")
    while eng.has_unfinished():
        eng.step()

    # batch-1 prefill of 1024 tokens: CPU vs GPU
    p = prompts[5][:1024] + prompts[6][: 1024 - len(prompts[5][:1024])]
    for i in range(3):
        eng.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.add_request("pf", p, SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        print(f"prefill {len(p)} tokens (profiled): {1e3 * (time.perf_counter() - t):.2f} ms")
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    print(ka.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=70))


if __name__ == "__main__":
    main()
