"""GPU correctness of the engine: the production configuration against torch attention run eagerly.

Usage (on the GPU): ``python bench/engine_check.py [--ckpt DIR] [--block-size N]`` (Qwen3-0.6B
architecture, random bf16 weights; ``--block-size``: the production engine's tokens per KV block,
default the engine's CUDA default; the reference keeps 16). Prints relative errors; exits
non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import random_qwen3_checkpoint
from engine.core.config import DEFAULT_CUDA_BLOCK_SIZE, EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine
from tests.engine_helpers import logits_for


def engine(ckpt, backend, graphs=False, async_scheduling=True, compile_mode=None, block_size=16):
    return build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=4096,
            block_size=block_size,
            num_kv_blocks=2048 * 16 // block_size,
            attention_backend=backend,
            cuda_graph=graphs,
            max_num_seqs=64,
            max_num_batched_tokens=4096,  # every check batch in one step
            enable_prefix_caching=False,
            async_scheduling=async_scheduling,
            compile_mode=compile_mode,
        ),
        eos_token_ids=frozenset(),
    )


def prefill_logits(eng, prompts):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
    batch = eng.scheduler.schedule()
    logits = logits_for(eng, batch)
    for i in range(len(prompts)):
        eng.abort(f"r{i}")
    return logits


def first_logprobs(eng, prompts, params):
    """Top-k (id, logprob) of each prompt's first sampled token, one request at a time."""
    out = []
    for i, p in enumerate(prompts):
        eng.add_request(f"lp{i}-{len(out)}", p, params)
        entries = []
        while eng.has_unfinished():
            entries += [lp for o in eng.step()[0] for lp in o.logprobs]
        out.append(entries[0][1])
    return out


def reference_consistency(ref_eng, prompts, outputs, err: float) -> float:
    """Fraction of the greedy ``outputs`` (token ids per prompt) that the reference engine,
    teacher-forced over prompt + output, scores within ``3 * err`` (logit units) of its top
    logit at that position."""
    near, total = 0, 0
    for prompt, out in zip(prompts, outputs):
        seq_logits = prefill_logits(ref_eng, [prompt + out[:-1]])[len(prompt) - 1 :]
        for row, tok in zip(seq_logits, out):
            total += 1
            near += bool(row[tok] >= row.max() - 3 * err)
    return near / total


def batch1_latency(eng, prompt, trials: int) -> tuple[float, float]:
    """Median first-token latency (ms) after ``prompt`` and the last trial's decode ms/token."""
    ttfts = []
    for trial in range(trials):
        eng.add_request(
            f"lat{trial}-{time.monotonic_ns()}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True),
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not any(o.new_token_ids for o in eng.step()[0]):  # async scheduling: a step later
            pass
        t1 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        t2 = time.perf_counter()
        ttfts.append(1e3 * (t1 - t0))
    return sorted(ttfts)[len(ttfts) // 2], 1e3 * (t2 - t1) / 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument(
        "--block-size", type=int, default=DEFAULT_CUDA_BLOCK_SIZE, help="the production engine's"
    )
    args = ap.parse_args()
    ckpt = str(random_qwen3_checkpoint(args.ckpt))
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (1, 17, 100, 515, 1024)
    ]
    ok = True
    # reference: torch attention, eager, no graphs, synchronous steps; against the production
    # configuration: Triton kernels, the default torch.compile mode, CUDA graphs, async scheduling
    ref_eng = engine(ckpt, "torch", compile_mode="none", async_scheduling=False)
    ref = prefill_logits(ref_eng, prompts)
    graph_eng = engine(ckpt, "triton", graphs=True, block_size=args.block_size)
    print(f"production engine: KV block {args.block_size} tokens")
    got = prefill_logits(graph_eng, prompts)
    rel = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"prefill logits, production engine vs torch eager (bf16): rel err {rel:.2e}, "
        f"argmax agreement {agree:.3f}"
    )
    ok &= rel < 2e-2

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    dec_prompts = [
        torch.randint(0, 150000, (n,), generator=gen).tolist()
        for n in (5, 33, 64, 200, 300, 31, 7, 128)
    ]
    out_torch = ref_eng.generate(dec_prompts, params)
    out_graph = graph_eng.generate(dec_prompts, params)

    def match(a, b):
        same = sum(x == y for oa, ob in zip(a, b) for x, y in zip(oa, ob))
        return same / sum(len(o) for o in a)

    # Greedy paths in bf16 part after a near-tie, so positional agreement is only indicative.
    # The check: score the production engine's greedy tokens with the reference engine
    # (teacher-forced, every position of prompt + output) -- each chosen token must be the
    # reference's argmax or within the bf16 logit error of it (3x the 99.9th percentile of
    # |production - reference| over the prefill logits above).
    diff = (got - ref).abs().float().flatten()
    err = (
        diff[torch.randint(0, diff.numel(), (1 << 20,), generator=gen).to(diff.device)]
        .quantile(0.999)
        .item()
    )
    consistent = reference_consistency(ref_eng, dec_prompts, out_graph, err)
    print(
        f"greedy 8x32 tokens, production engine vs torch eager: positional agreement "
        f"{match(out_graph, out_torch):.3f}; production tokens within 3x the logit error "
        f"({3 * err:.3f}) of the reference's top logit: {consistent:.3f}"
    )
    ok &= consistent >= 0.99

    # batch 1: one sequence per step, the decode graphs' batch-1 twins (the persistent decode
    # path where the model has one, up to its context bound; the layer loop past it)
    pd = getattr(graph_eng.executor.model, "persistent_decode", None)
    b1_gen = torch.Generator().manual_seed(1)  # (its own: the later checks' prompts unchanged)
    b1_prompts = dec_prompts[:3] + [torch.randint(0, 150000, (1000,), generator=b1_gen).tolist()]
    out_b1 = [graph_eng.generate([p], params)[0] for p in b1_prompts]
    consistent = reference_consistency(ref_eng, b1_prompts, out_b1, err)
    path = (
        f"persistent decode up to {pd.max_context} tokens; {pd.layout_summary()}"
        if pd is not None
        else "layer loop (no persistent path)"
    )
    print(
        f"greedy batch 1, 4x32 tokens ({path}): production tokens within 3x the logit error of "
        f"the reference's top logit: {consistent:.3f}"
    )
    ok &= consistent >= 0.99
    del ref_eng

    # prefill/mixed-step CUDA graphs against the same engine's eager prefill (same weights)
    lp_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    lp_prompts = [
        torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (3, 40, 130, 700, 1500)
    ]
    runner = graph_eng.executor
    pg = runner.prefill_graphs
    with_graphs = first_logprobs(graph_eng, lp_prompts, lp_params)
    runner.prefill_graphs = None
    eager = first_logprobs(graph_eng, lp_prompts, lp_params)
    runner.prefill_graphs = pg
    same_ids = all([i for i, _ in a] == [i for i, _ in b] for a, b in zip(with_graphs, eager))
    diff = max(abs(x - y) for a, b in zip(with_graphs, eager) for (_, x), (_, y) in zip(a, b))
    print(
        f"prefill CUDA graphs vs eager prefill, top-5 logprobs of 5 prompts: same ids {same_ids}, "
        f"max |diff| {diff:.2e}"
    )
    ok &= diff < 5e-2

    # engine-only latency at batch 1 (no HTTP): prefill of 1024 tokens, then decode steps
    prompt = torch.randint(0, 150000, (1024,), generator=gen).tolist()
    for label, graphs in (("prefill graphs off", None), ("prefill graphs on", pg)):
        runner.prefill_graphs = graphs
        ttft, tpot = batch1_latency(graph_eng, prompt, trials=5)
        print(
            f"engine-only batch 1 ({label}): first token after a 1024-token prompt {ttft:.2f} ms "
            f"(median of 5), decode {tpot:.2f} ms/token"
        )
    print("engine check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
