"""Profile batch-1 latency of the engine (prefill of 1024 tokens, then decode) with torch.profiler.

Usage (on the GPU):
``python bench/profile_latency.py [--ckpt DIR] [--compile-mode model|ops|none]``;
prints step times, the number of graphs compiled for the whole-model forward (any compiled
during the measured runs is a recompile) and the top operators by CUDA and by CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import random_qwen3_checkpoint
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.models.compile import compiled_graph_count
from engine.worker.build import build_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument(
        "--compile-mode",
        choices=["model", "ops", "none"],
        default=None,
        help="EngineConfig.compile_mode (default: the engine's, ops on CUDA)",
    )
    args = ap.parse_args()
    ckpt = str(random_qwen3_checkpoint(args.ckpt))
    eng = build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=4096,
            block_size=16,  # the block count below is sized for 16-token blocks
            num_kv_blocks=4096,
            max_num_seqs=64,
            enable_prefix_caching=False,
            compile_mode=args.compile_mode,
        ),
        eos_token_ids=frozenset(),
    )
    prompt = torch.randint(0, 150000, (1024,)).tolist()

    def run(i):
        eng.add_request(
            f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not any(o.new_token_ids for o in eng.step()[0]):  # async scheduling: a step later
            pass
        t1 = time.perf_counter()
        steps = []
        while eng.has_unfinished():
            s = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - s)
        return (t1 - t0) * 1e3, 1e3 * sum(steps) / len(steps)

    for i in range(3):
        print("warm-up prefill {:.2f} ms, decode {:.2f} ms/step".format(*run(i)))
    graphs = compiled_graph_count()
    print(
        f"compile_mode={eng.executor.model.compile_mode}: "
        f"{graphs} whole-model graphs compiled so far"
    )
    # keep the GPU clocks up, then measure again
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ x
    print("after busy GPU: prefill {:.2f} ms, decode {:.2f} ms/step".format(*run(10)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(20)
    print(
        f"graphs compiled during the measured runs (recompiles): {compiled_graph_count() - graphs}"
    )
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
