"""Does asking L2 for the next projections' weights on a side stream shorten a GEMV chain?

Usage (GPU): ``python3 bench/l2_prefetch_probe.py [--layers 28] [--reps 30]``

The batch-1 decode step's projections reach 1-1.8 TB/s each because every GEMV starts its own
weight fetch (docs/benchmarks.md). This probe chains Qwen3-0.6B's four projections per layer
with the engine's decode kernels (``gemv_rms_norm`` for q/k/v and gate/up, ``gemv`` for o,
``gemv_swiglu`` for down; PDL launches, the tables' tiles) in one CUDA graph and times:

* ``cold``: distinct weights per layer (~870 MB, more than L2): today's step;
* ``hot``: one layer's weights in every layer (all in L2): the bound a perfect prefetch nears;
* ``prefetch dN pP``: cold, and before each projection a side-stream kernel of P programs
  (:func:`kernels.l2_prefetch.l2_prefetch`) asks L2 for the weights of the projection N ahead.

Every variant's output must equal ``cold``'s bit for bit (the prefetch is a hint). Prints a
markdown table: microseconds per chain, per GEMV, and the weight bytes over the time.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.pdl_probe import time_or_report  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_fused import gemv_rms_norm, gemv_swiglu  # noqa: E402
from kernels.l2_prefetch import l2_prefetch  # noqa: E402

HIDDEN, Q, KV, INTER = 1024, 2048, 1024, 3072
#: per layer, in launch order: (name, N, K)
SHAPES = [("qkv", Q + KV, HIDDEN), ("o", HIDDEN, Q), ("gate_up", 2 * INTER, HIDDEN),
          ("down", HIDDEN, INTER)]  # fmt: skip


def chain(x, norm_w, layers, distance: int, side, programs: int = 16):
    """One decode step's projections over ``layers`` (lists of four weights); with
    ``distance`` > 0, projection ``j + distance``'s weight is prefetched before projection j."""
    flat = [w for layer in layers for w in layer]
    main = torch.cuda.current_stream()

    def fetch(j):
        if distance and j < len(flat):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch([flat[j]], programs)

    for j in range(distance):
        fetch(j)
    h, residual, j = x, torch.zeros_like(x), 0
    for qkv_w, o_w, gu_w, down_w in layers:
        fetch(j + distance)
        qkv, residual = gemv_rms_norm(h, norm_w, 1e-6, qkv_w, residual=residual)
        fetch(j + 1 + distance)
        o = gemv(qkv[:, :Q].contiguous(), o_w)
        fetch(j + 2 + distance)
        gu, residual = gemv_rms_norm(o, norm_w, 1e-6, gu_w, residual=residual)
        fetch(j + 3 + distance)
        h = gemv_swiglu(gu, down_w)
        j += 4
    if distance:
        main.wait_stream(side)
    return torch.cat([h, residual], dim=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--distances", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 16, 64])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("l2_prefetch_probe: needs a CUDA device; skipped")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    cold = [
        [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _, n, k in SHAPES]
        for _ in range(args.layers)
    ]
    hot = [cold[0]] * args.layers
    nbytes = sum(w.numel() * 2 for layer in cold for w in layer)
    side = torch.cuda.Stream()
    rows, ref = [], None
    variants = [("cold", cold, 0, 1), ("hot (bound)", hot, 0, 1)]
    variants += [(f"prefetch d{d} p{p}", cold, d, p) for d in args.distances for p in args.programs]
    for label, layers, d, p in variants:
        timed = time_or_report(
            label, functools.partial(chain, x, norm_w, layers, d, side, p), args.reps
        )
        if timed is None:
            continue
        us, out = timed
        if label == "cold":
            ref = out.clone()
        same = "-" if layers is hot else ("yes" if torch.equal(out, ref) else "NO")
        rows.append((label, us, us / (4 * args.layers), nbytes / us / 1e6, same))
    print(f"\n{args.layers} layers x 4 projections, batch 1, CUDA graph, PDL, "
          f"{nbytes / 1e6:.0f} MB of weights")  # fmt: skip
    print("| variant | us per chain | us per GEMV | weights TB/s | equals cold |")
    print("|---|---|---|---|---|")
    for label, us, per, tbs, same in rows:
        print(f"| {label} | {us:.1f} | {per:.2f} | {tbs:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
