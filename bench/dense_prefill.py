"""A lone prompt's attention: the Triton prefill kernel against the cuDNN path, as the backend
launches them (issue 20's 32k first token).

Usage (GPU)::

    python3 bench/dense_prefill.py [--tokens 1024 2048 4096 8192 16384 32768] [--block-size 128]

For each prompt length T (Qwen3-0.6B heads: H_q 16, H_kv 8, D 128, bf16) the prompt's keys and
values sit in a paged cache of ``--block-size``-token blocks under a shuffled block table, and
``TritonAttentionBackend._attend`` runs on the metadata of a step that is the whole prompt, once
with ``dense_prefill_min_tokens=0`` (the Triton kernel) and once with 1 (cuDNN through
:func:`engine.attention.dense_prefill.dense_causal_attention`, its gather and GQA repeat
included). Both outputs are checked against each other and, up to 4,096 tokens, against a
float32 reference on every row; times are medians of ``triton.testing.do_bench`` (eager launches:
the cuDNN path runs only outside CUDA graphs). Prints a markdown table of ms and TFLOP/s
(causal: ``2 * T^2 * H_q * D`` flops).

``--engine CKPT`` instead checks the path inside the engine: one lone prompt of
``--engine-prompt`` tokens (no prefix cache), greedy, 8 tokens with their top-5 log-probabilities,
with the cuDNN path on and then off (the process-wide backend's ``dense_prefill_min_tokens``);
PASS when the first token's top-5 log-probabilities agree within 0.05 and every step's chosen
token, up to the first step where they differ, is among the other run's top 5.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.kernels import gather_dense, paged_kv  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

HQ, HKV, D = 16, 8, 128


def reference(q, k, v, scale):
    """float32 causal attention, ``[T, H_q, D]``."""
    t = q.shape[0]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    vf = v.float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    s = qf @ kf.transpose(1, 2) * scale
    s.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1)


def lone_prompt(t: int, block_size: int, dev, g):
    """``(q, k_cache, v_cache, block_table, meta)`` of a step that is one whole ``t``-token
    prompt: random bf16 q and paged K/V under a shuffled block table."""
    k_cache, v_cache, bt = paged_kv([t], block_size, torch.bfloat16, dev, g, HKV, D)
    q = torch.randn(t, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
        block_tables=bt,
        seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=dev),
        max_query_len=t,
        max_seq_len=t,
        is_decode=False,
    )
    return q, k_cache, v_cache, bt, meta


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def engine_check(ckpt: str, prompt: int) -> int:
    """The engine's first tokens with the cuDNN path on and off (see the module docstring)."""
    import random

    from engine.attention.registry import get_attention_backend
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.worker.build import build_engine

    engine = build_engine(
        EngineConfig(
            model=ckpt,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=40960,
            enable_prefix_caching=False,
        )
    )
    backend = get_attention_backend("triton")
    on = backend.dense_prefill_min_tokens
    print(f"prefill-only budget {engine.scheduler.prefill_only_token_budget}, cuDNN from {on}")
    rng = random.Random(3)
    ids = [rng.randrange(1000, 30000) for _ in range(prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    runs = {}
    for label, low in (("cuDNN", on), ("Triton", 0)):
        backend.dense_prefill_min_tokens = low
        steps, tokens, lps = 0, [], []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ttft = None
        engine.add_request(label, ids, params)
        while engine.has_unfinished():
            outputs, _ = engine.step()
            steps += 1
            for o in outputs:
                if o.new_token_ids and ttft is None:
                    ttft = 1e3 * (time.perf_counter() - t0)
                tokens += o.new_token_ids
                lps += o.logprobs
        runs[label] = (tokens, lps)
        print(f"{label}: TTFT {ttft:.1f} ms, {steps} steps, tokens {tokens}")
    backend.dense_prefill_min_tokens = on
    (ta, la), (tb, lb) = runs["cuDNN"], runs["Triton"]
    first_a, first_b = dict(la[0][1]), dict(lb[0][1])
    common = set(first_a) & set(first_b)
    diff = max((abs(first_a[t] - first_b[t]) for t in common), default=float("inf"))
    # up to the first step where the runs chose differently (their contexts differ after it)
    same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta) - 1)
    in_top = all(ta[i] in dict(lb[i][1]) and tb[i] in dict(la[i][1]) for i in range(same + 1))
    ok = diff <= 0.05 and len(common) >= 4 and in_top
    print(
        f"first token top-5 |logprob diff| max {diff:.4f} over {len(common)} shared ids; "
        f"tokens in the other run's top 5: {in_top}; same tokens: {ta == tb}"
    )
    print("PASS" if ok else "FAILED")
    engine.shutdown()
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cold", type=int, nargs="*", default=[4097, 8191, 30001, 30002, 31999])
    ap.add_argument("--engine", default=None, help="checkpoint: check the path in the engine")
    ap.add_argument("--engine-prompt", type=int, default=20000)
    args = ap.parse_args()
    if args.engine:
        return engine_check(args.engine, args.engine_prompt)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    scale = D**-0.5
    triton_b = TritonAttentionBackend(dense_prefill_min_tokens=0)
    dense_b = TritonAttentionBackend(dense_prefill_min_tokens=1)
    print(
        "| T | Triton ms | TFLOP/s | cuDNN path ms | TFLOP/s | cuDNN / Triton time | rel err "
        "(paths) | rel err vs fp32 (Triton, cuDNN) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for t in args.tokens:
        q, k_cache, v_cache, bt, meta = lone_prompt(t, args.block_size, dev, g)
        outs, ms = [], []
        for b in (triton_b, dense_b):
            outs.append(b._attend(q, k_cache, v_cache, meta, scale))
            ms.append(
                triton.testing.do_bench(
                    lambda b=b, args=(q, k_cache, v_cache, meta, scale): b._attend(*args),
                    warmup=10,
                    rep=100,
                    return_mode="median",
                )
            )
        if dense_b.dense_prefill_min_tokens == 0:
            print("cuDNN path refused (see the warning); stopping")
            return 1
        err = rel(outs[1], outs[0])
        ref_err = "-"
        if t <= 4096:
            k, v = gather_dense(k_cache, v_cache, bt, [t])
            r = reference(q, k, v, scale)
            e0, e1 = rel(outs[0], r), rel(outs[1], r)
            ref_err = f"{e0:.2e}, {e1:.2e}"
            failed |= max(e0, e1) > 1e-2
        failed |= err > 2e-2 or not torch.isfinite(outs[1]).all().item()
        flops = 2 * t * t * HQ * D
        tf = [flops / (m * 1e-3) / 1e12 for m in ms]
        print(
            f"| {t} | {ms[0]:.3f} | {tf[0]:.0f} | {ms[1]:.3f} | {tf[1]:.0f} | "
            f"{ms[1] / ms[0]:.2f} | {err:.2e} | {ref_err} |"
        )
        del k_cache, v_cache, outs
        torch.cuda.empty_cache()
    # cuDNN builds an execution plan per shape: the first call at a new length pays for it
    print()
    print("| new T | first cuDNN call ms | second ms | first Triton call ms | second ms |")
    print("|---|---|---|---|---|")
    for t in args.cold:
        q, k_cache, v_cache, bt, meta = lone_prompt(t, args.block_size, dev, g)
        row = []
        for b in (dense_b, triton_b):
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                b._attend(q, k_cache, v_cache, meta, scale)
                torch.cuda.synchronize()
                row.append(1e3 * (time.perf_counter() - t0))
        print(f"| {t} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    print("FAILED" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
