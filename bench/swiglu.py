"""The prompt step's SwiGLU: the Triton kernel (``kernels/swiglu.py``) against the composition
the engine runs today (``engine.layers.activation.silu_and_mul`` compiled with
``torch.compile(dynamic=True)``, as ``compile_mode="ops"`` does) and eager torch.

Usage (on the GPU): ``python bench/swiglu.py [--inter 3072] [--tokens 1024 4096 16384]``; on the
CPU ``--tiny`` checks the script's logic under the Triton interpreter (tiny shapes, host-clock
times not worth reading).

Rows: tokens T of a prompt step at Qwen3-0.6B's intermediate size (I = 3072, bf16). Each timing
is ``bench/kernels.py``'s ``graph_ms``: the median of CUDA-graph replays cycling over enough
input copies (>= 256 MB) that none is still in the L2; bandwidth = bytes read (T x 2I) + written
(T x I), over the time. Every variant is first checked against eager torch (the fraction of
bit-equal elements, and the largest difference in units of the output's last place); the
kernel's tiles (columns per program, warps) are swept.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.kernels import graph_ms
from engine.layers.activation import silu_and_mul as eager
from kernels.swiglu import silu_and_mul as triton_swiglu

TILES = ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8))


def agreement(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements bit-equal to ``ref``, largest difference in ulps of ``ref``)."""
    exact = (out == ref).float().mean().item()
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    return exact, ((out.float() - ref.float()).abs() / ulp).max().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inter", type=int, default=3072, help="intermediate size I")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tiny", action="store_true", help="CPU: tiny shapes, logic check only")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.tiny or not cuda:
        args.inter, args.tokens = 48, [5, 17]
    compiled = torch.compile(eager, dynamic=True, fullgraph=True) if cuda else eager
    print(f"SwiGLU [T, 2x{args.inter}] -> [T, {args.inter}], bf16, {device}")
    print("| T | variant | us | GB/s | bit-equal to eager | max ulps |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    for t in args.tokens:
        x = (torch.randn(t, 2 * args.inter, generator=g) * 3).to(torch.bfloat16).to(device)
        ref = eager(x)
        nbytes = 3 * t * args.inter * x.element_size()
        copies = max(2, (256 << 20) // (2 * nbytes // 3)) if cuda else 1
        inputs = [x.clone() for _ in range(copies)]
        variants = [("eager torch", eager), ("torch.compile (today)", compiled)]
        variants += [
            (f"triton block {b} warps {w}", lambda v, b=b, w=w: triton_swiglu(v, None, b, w))
            for b, w in (TILES if not args.tiny and cuda else ((16, 1), (32, 2)))
        ]
        for name, fn in variants:
            exact, ulps = agreement(fn(x), ref)
            us = graph_ms([lambda v=v, fn=fn: fn(v) for v in inputs]) * 1e3
            print(
                f"| {t} | {name} | {us:.2f} | {nbytes / us / 1e3:.0f} | {exact:.4f} | {ulps:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
