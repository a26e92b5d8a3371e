"""Offline throughput on nano-vllm's workload: this engine vs transformers' continuous batching.

Usage (on the GPU): ``python bench/offline.py [--hf-seconds 120] [--skip-hf]``
Prints one table: output tokens/s of each and the ratio. transformers runs the same requests
(per-request max_new_tokens through its continuous-batching manager); when it cannot finish
within ``--hf-seconds`` its throughput is measured on the tokens it produced until then.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import Timer, nano_vllm_workload, random_qwen3_checkpoint
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine


def _free_gpu() -> None:
    """After ``del engine``: torch.compile's caches still hold its model, so reset them."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def run_ours(ckpt: str, prompts, out_lens, args) -> dict:
    engine = build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cuda_graph=not args.no_cuda_graph,
            enable_prefix_caching=False,
        ),
        eos_token_ids=frozenset(),
    )
    engine.generate([prompts[0][:64]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    with Timer() as t:
        outs = engine.generate(prompts, params)
    total = sum(len(o) for o in outs)
    assert total == sum(out_lens), (total, sum(out_lens))
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    info = engine.cache_info
    res = dict(
        name="qwen-serve",
        tokens=total,
        seconds=t.seconds,
        tok_s=total / t.seconds,
        kv_blocks=info.num_kv_blocks,
        preemptions=engine.scheduler.num_preemptions,
    )
    del engine
    _free_gpu()
    return res


def run_ours_serve_shape(ckpt: str, args) -> dict:
    """Engine only, the shape of the HTTP benchmark at concurrency 64: 128 requests of 1,024 random
    prompt ids and 128 output tokens, at most 64 running (the 80 % comparison of issue 7), with the
    server's default engine settings (its token budget, not ``--max-num-batched-tokens``)."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randint(1000, 30000) for _ in range(1024)] for _ in range(128)]
    engine = build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=args.max_model_len,
            max_num_seqs=64,
            enable_prefix_caching=False,
        ),
        eos_token_ids=frozenset(),
    )
    engine.generate([prompts[0][:64]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    with Timer() as t:
        outs = engine.generate(
            prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=128)
        )
    total = sum(len(o) for o in outs)
    del engine
    _free_gpu()
    return dict(
        name="qwen-serve, 128 x (1024 in, 128 out), max 64 running",
        tokens=total,
        seconds=t.seconds,
        tok_s=total / t.seconds,
    )


def run_hf(ckpt: str, prompts, out_lens, budget_s: float) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).cuda()
    gen_cfg = GenerationConfig(
        max_new_tokens=max(out_lens),
        do_sample=True,
        temperature=0.6,
        eos_token_id=-1,
        pad_token_id=0,
    )
    manager = model.init_continuous_batching(generation_config=gen_cfg)
    manager.start()
    t0 = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, out_lens)]
    done, tokens = set(), 0
    while len(done) < len(ids) and time.perf_counter() - t0 < budget_s:
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished() and r.request_id not in done:
            done.add(r.request_id)
            tokens += len(r.generated_tokens)
    seconds = time.perf_counter() - t0
    partial = 0
    if len(done) < len(ids):  # count tokens of unfinished requests too
        try:
            for state in manager.scheduler.active_requests.values():
                partial += len(state.generated_tokens)
        except Exception:  # noqa: BLE001 - internal API differs between versions
            pass
    manager.stop(block=False)
    return dict(
        name="transformers CB (paged|sdpa)",
        tokens=tokens + partial,
        seconds=seconds,
        tok_s=(tokens + partial) / seconds,
        finished=len(done),
        of=len(ids),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (default: the checkpoint's max_position_embeddings)",
    )
    ap.add_argument("--hf-seconds", type=float, default=120)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--serve-shape",
        action="store_true",
        help="also run the HTTP benchmark's c=64 shape engine-only",
    )
    args = ap.parse_args()
    ckpt = str(random_qwen3_checkpoint(args.ckpt))
    prompts, out_lens = nano_vllm_workload(args.num_seqs)
    print(
        f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(out_lens)} output tokens"
    )
    rows = [run_ours(ckpt, prompts, out_lens, args)]
    shape_row = run_ours_serve_shape(ckpt, args) if args.serve_shape else None
    if not args.skip_hf:
        try:
            rows.append(run_hf(ckpt, prompts, out_lens, args.hf_seconds))
        except Exception as exc:  # noqa: BLE001 - report and keep our numbers
            print(f"transformers run failed: {type(exc).__name__}: {exc}")
    print("\n| engine | output tokens | seconds | output tok/s | ratio |\n|---|---|---|---|---|")
    for r in rows:
        extra = f" ({r['finished']}/{r['of']} finished)" if "finished" in r else ""
        print(
            f"| {r['name']}{extra} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.0f} | "
            f"{rows[0]['tok_s'] / r['tok_s']:.2f}x |"
        )
    if shape_row:
        r = shape_row
        print(f"| {r['name']} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.0f} | |")
    print(
        f"\nqwen-serve: {rows[0]['kv_blocks']} KV blocks, {rows[0]['preemptions']} preemptions; "
        f"GPU: {torch.cuda.get_device_name()}"
    )


if __name__ == "__main__":
    main()
