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
"""

from __future__ import annotations

import argparse
import sys
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


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cold", type=int, nargs="*", default=[4097, 8191, 30001, 30002, 31999])
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    scale = D**-0.5
    triton_b = TritonAttentionBackend(dense_prefill_min_tokens=0)
    dense_b = TritonAttentionBackend(dense_prefill_min_tokens=1)
    print("| T | Triton ms | TFLOP/s | cuDNN path ms | TFLOP/s | cuDNN / Triton time | rel err "
          "(paths) | rel err vs fp32 (Triton, cuDNN) |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for t in args.tokens:
        k_cache, v_cache, bt = paged_kv([t], args.block_size, torch.bfloat16, dev, g, HKV, D)
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
        outs, ms = [], []
        for b in (triton_b, dense_b):
            outs.append(b._attend(q, k_cache, v_cache, meta, scale))
            ms.append(triton.testing.do_bench(
                lambda b=b: b._attend(q, k_cache, v_cache, meta, scale), warmup=10, rep=100,
                return_mode="median",
            ))
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
        print(f"| {t} | {ms[0]:.3f} | {tf[0]:.0f} | {ms[1]:.3f} | {tf[1]:.0f} | "
              f"{ms[1] / ms[0]:.2f} | {err:.2e} | {ref_err} |")
        del k_cache, v_cache, outs
        torch.cuda.empty_cache()
    # cuDNN builds an execution plan per shape: the first call at a new length pays for it
    print()
    print("| new T | first cuDNN call ms | second ms | first Triton call ms | second ms |")
    print("|---|---|---|---|---|")
    import time

    for t in args.cold:
        k_cache, v_cache, bt = paged_kv([t], args.block_size, torch.bfloat16, dev, g, HKV, D)
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
