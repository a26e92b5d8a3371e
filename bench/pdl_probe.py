"""Does programmatic dependent launch (PDL) shorten a chain of small-M GEMVs in a CUDA graph?

Usage (GPU, sm_90+): ``python3 bench/pdl_probe.py [--layers 28] [--reps 20]``

The batch-1 decode step of Qwen3-0.6B is ~290 kernels of 1-6 us each inside one CUDA graph
(docs/benchmarks.md, "Fused norm / SwiGLU GEMVs"): every kernel boundary costs a drain, a launch
and the next kernel's ramp-up. PDL (CUDA programming guide 4.5; Triton's ``launch_pdl``,
``gdc_wait``) lets the next kernel's programs start while the previous one finishes; with an L2
prefetch of the next GEMV's weights before its wait (CUTLASS example 63), its weight fetch
overlaps the previous kernel too. This probe times the 0.6B projections of ``--layers`` layers
chained (each GEMV reads the previous one's output; distinct weights per layer, ~870 MB, more
than L2), with the tiles of ``kernels/configs/gemv_<device>.json``, as: plain launches, PDL,
PDL + prefetch, and each with plain elementwise kernels (a multiply and an add: the residual
add of a real step, which breaks the PDL chain) after o and down, and cuBLAS (``F.linear``)
for reference. Checks that every variant's output equals the plain launches' bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.configs import device_name, kernel_table  # noqa: E402
from kernels.gemv import GemvConfig, gemv  # noqa: E402

#: (name, N, K, input features taken from the previous output) for Qwen3-0.6B at TP 1
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]


def table_config(n: int, k: int, dev) -> GemvConfig:
    """The table's M = 1 tiles for ``(n, k)`` even where it prefers cuBLAS, else the defaults."""
    row = (kernel_table("gemv", device_name(dev)).get(f"{n},{k}") or {}).get("m1")
    return GemvConfig.from_row(row or {}) or GemvConfig()


def chain(x, weights, cfgs, pdl: int, breaks: bool, cublas: bool):
    """Run the layers' four projections in order; returns the last output ``[1, 1024]``."""
    h = x
    for layer in weights:
        for (name, _n, k), w, cfg in zip(SHAPES, layer, cfgs):
            inp = h[:, :k]
            h = F.linear(inp, w) if cublas else gemv(inp, w, config=cfg, pdl=pdl)
            if breaks and name in ("o", "down"):
                # plain (non-PDL) elementwise kernels, in place of the residual add
                h = h * 0.5 + x[:, : h.shape[1]]
    return h


def capture_graph(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn()`` warmed up on a side stream, captured in a CUDA graph and replayed once:
    ``(graph, output of the replay)`` (synchronised). Also used by ``tests/kernels/test_pdl.py``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return g, out


def time_graph(fn, reps: int) -> tuple[float, torch.Tensor]:
    """(median microseconds of one ``fn()`` replayed from a CUDA graph, its output)."""
    fn()
    torch.cuda.synchronize()
    g, out = capture_graph(fn)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def time_or_report(label: str, fn, reps: int) -> tuple[float, torch.Tensor] | None:
    """:func:`time_graph` of ``fn``, or None after printing why it failed (a variant the
    toolchain refuses is reported, not fatal). Also used by ``bench/l2_prefetch_probe.py``."""
    try:
        return time_graph(fn, reps)
    except Exception as exc:
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("pdl_probe: needs a CUDA device of compute capability 9.0 or newer; skipped")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(1, 6144, device=dev, dtype=torch.bfloat16)
    weights = [
        [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _, n, k in SHAPES]
        for _ in range(args.layers)
    ]
    cfgs = [table_config(n, k, dev) for _, n, k in SHAPES]
    print("tiles:", {s[0]: c for s, c in zip(SHAPES, cfgs)})
    kernels = 4 * args.layers
    rows = []
    ref = {}
    for breaks in (False, True):
        for label, pdl, cublas in (
            ("plain", 0, False),
            ("pdl", 1, False),
            ("pdl+prefetch", 2, False),
            ("cublas", 0, True),
        ):
            run = functools.partial(chain, x, weights, cfgs, pdl, breaks, cublas)
            timed = time_or_report(f"{label} breaks={breaks}", run, args.reps)
            if timed is None:
                continue
            us, out = timed
            same = "-"
            if not cublas:
                if label == "plain":
                    ref[breaks] = out.clone()
                same = (
                    "NO" if breaks not in ref else "yes" if torch.equal(out, ref[breaks]) else "NO"
                )
            rows.append((label, breaks, us, us / kernels, same))
    print(f"\n{args.layers} layers x 4 projections ({kernels} GEMVs), batch 1, CUDA graph")
    print("| launches | residual kernels between | us per chain | us per GEMV | equals plain |")
    print("|---|---|---|---|---|")
    for label, breaks, us, per, same in rows:
        print(f"| {label} | {'yes' if breaks else 'no'} | {us:.1f} | {per:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
