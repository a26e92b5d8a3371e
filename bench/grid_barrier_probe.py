"""Is a grid barrier inside one persistent kernel cheaper than a kernel boundary with PDL?

Usage (GPU, sm_90+): ``python3 bench/grid_barrier_probe.py [--layers 28] [--reps 20]``

Issue 19's batch-1 target (1.0 ms per token on the H200; 1.09 today) is a question of kernel
boundaries, not bytes: ``bench/pdl_probe.py`` measured 4.59 us per chained Qwen3-0.6B
projection with PDL and the weight prefetch, ~3 us above the weights' HBM time, whether the
weights come from HBM or L2. The remaining lever the issue names is a persistent whole-layer
decode kernel (Hazy Research's "No Bubbles" megakernel, 2025): one launch per layer or model,
its phases separated by grid-wide barriers instead of kernel boundaries, the next phase's
weights requested before each barrier. Before building one, this probe measures the
primitive on the same 112-GEMV chain as ``bench/pdl_probe.py`` (28 layers x the 0.6B
projections qkv, o, gate_up, down at M = 1, each reading the previous one's output, ~880 MB of
distinct weights):

* ``pdl+prefetch``: the engine's GEMV kernel, one launch each (PDL, L2 weight prefetch), the
  tiles of ``kernels/configs/gemv_<device>.json`` -- today's cost of a boundary;
* ``persistent``: one launch of ``--programs`` programs (default: the SM count, all resident)
  that walks the 112 GEMVs, each program taking N tiles in a grid-stride loop, with a grid
  barrier after each GEMV (an acquire-release arrival counter at GPU scope, spun on);
* ``persistent+prefetch``: the same, each program asking L2 for its next GEMV's weight tiles
  before it arrives at the barrier (their fetch overlaps the wait);
* ``barriers only``: the persistent launch with the GEMVs left out: 112 barriers' cost alone.

Every variant's last output is checked against a float32 torch chain of the same bf16 weights
(each GEMV's output rounded to bf16, as the kernels do): the relative error is printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.interpreter import interpreting  # noqa: E402
from kernels.rounding import round_to  # noqa: E402

#: Qwen3-0.6B at TP 1: hidden size, q/k/v outputs, o input, intermediate size
HIDDEN, QKV, ATTN, INTER = 1024, 4096, 2048, 3072


@triton.jit
def grid_barrier(bar_ptr, target):
    """Wait until the int32 counter at ``bar_ptr`` reaches ``target`` after adding this
    program's arrival: every thread's stores before the call are visible to every program
    after it (a CTA barrier, then one acquire-release atomic per program at GPU scope, then
    acquire loads of the counter until it reaches ``target``). All programs of the grid must be
    resident at once (a grid no larger than the SMs' capacity), or this never returns."""
    tl.debug_barrier()
    seen = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_tiles(
    w_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, pid, nprog
):
    """Ask L2 for every 128-byte line of this program's ``[BN, K]`` weight tiles of a GEMV
    (``prefetch.global.L2``, ``BK // 64`` lines per row at a time: reads nothing into
    registers)."""
    for t in range(pid, N // BN, nprog):
        rows = (t * BN + tl.arange(0, BN)).to(tl.int64)
        for k0 in tl.static_range(0, K, BK):
            ptrs = w_ptr + rows[:, None] * K + (k0 + tl.arange(0, BK // 64) * 64)[None, :]
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
            )


@triton.jit
def _gemv_tiles(
    w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    pid, nprog, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``y[n] = sum_k W[n, k] x[k]`` (bf16 in, float32 sums, bf16 out) for this program's
    ``[BN, K]`` tiles of ``W [N, K]`` in a grid-stride loop; ``x`` is read at L2 (``.cg``):
    another program wrote it before the last barrier. ``EMULATE_RNE``: the interpreter's
    rounding (:func:`kernels.rounding.round_to`)."""
    for t in range(pid, N // BN, nprog):
        rows = (t * BN + tl.arange(0, BN)).to(tl.int64)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
            wv = tl.load(w_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
            acc += wv * xv[None, :]
        y = round_to(tl.sum(acc, axis=1), y_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(y_ptr + rows, y)


@triton.jit
def _phase_end(
    w_next, bar_ptr, phase, nprog, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """After GEMV ``phase``: optionally ask L2 for the next GEMV's tiles (``[N, K]`` at
    ``w_next``), then the grid barrier (its counter target: ``(phase + 1) * nprog``)."""
    if PREFETCH:
        _prefetch_tiles(w_next, N, K, BN, BK, pid, nprog)
    if SYNC:
        grid_barrier(bar_ptr, (phase + 1) * nprog)


@triton.jit
def _chain_kernel(
    w_ptr, a_ptr, b_ptr, bar_ptr, LAYERS,
    H: tl.constexpr, Q: tl.constexpr, A: tl.constexpr, FF: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
    BK: tl.constexpr, WORK: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``LAYERS`` x (qkv ``[Q, H]``, o ``[H, A]``, gate_up ``[2FF, H]``, down ``[H, FF]``) GEMVs
    chained through two bf16 activation buffers (``a`` ``[H]`` in and out, ``b`` between), the
    weights of layer ``l`` packed at ``w_ptr + l * (Q*H + H*A + 2FF*H + H*FF)`` in that order.
    ``WORK`` False leaves the GEMVs out (barriers only); ``SYNC`` False leaves the barriers out
    (correct only with one program: the interpreter test); ``PREFETCH``: see
    :func:`_phase_end`. The last program to leave resets the two counters (``bar_ptr[0]``: the
    barrier, ``bar_ptr[1]``: departures), so every launch starts from zero."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    OFF_O: tl.constexpr = Q * H
    OFF_GU: tl.constexpr = OFF_O + H * A
    OFF_DOWN: tl.constexpr = OFF_GU + 2 * FF * H
    LAYER: tl.constexpr = OFF_DOWN + H * FF
    for layer in range(LAYERS):
        w = w_ptr + layer * LAYER  # < 2**31 elements for up to 136 layers of 0.6B
        ph = layer * 4
        if WORK:
            _gemv_tiles(w, a_ptr, b_ptr, Q, H, BN_QKV, BK, pid, nprog, EMULATE_RNE)
        _phase_end(w + OFF_O, bar_ptr, ph, nprog, pid, H, A, BN_O, BK, SYNC, PREFETCH)
        if WORK:
            _gemv_tiles(w + OFF_O, b_ptr, a_ptr, H, A, BN_O, BK, pid, nprog, EMULATE_RNE)
        _phase_end(w + OFF_GU, bar_ptr, ph + 1, nprog, pid, 2 * FF, H, BN_GU, BK, SYNC, PREFETCH)
        if WORK:
            _gemv_tiles(w + OFF_GU, a_ptr, b_ptr, 2 * FF, H, BN_GU, BK, pid, nprog, EMULATE_RNE)
        _phase_end(w + OFF_DOWN, bar_ptr, ph + 2, nprog, pid, H, FF, BN_DOWN, BK, SYNC, PREFETCH)
        if WORK:
            _gemv_tiles(w + OFF_DOWN, b_ptr, a_ptr, H, FF, BN_DOWN, BK, pid, nprog, EMULATE_RNE)
        # the next layer's qkv (past the last layer: its own qkv again, harmless as a hint)
        w_next = w_ptr + tl.minimum(layer + 1, LAYERS - 1) * LAYER
        _phase_end(w_next, bar_ptr, ph + 3, nprog, pid, Q, H, BN_QKV, BK, SYNC, PREFETCH)
    if SYNC:
        left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == nprog - 1:  # every program has passed the last barrier
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


def layer_numel(h: int, q: int, a: int, i: int) -> int:
    """Weight elements of one packed layer (qkv, o, gate_up, down)."""
    return q * h + h * a + 2 * i * h + h * i


def persistent_chain(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bar: torch.Tensor,
    layers: int,
    dims: tuple[int, int, int, int] = (HIDDEN, QKV, ATTN, INTER),
    tiles: tuple[int, int, int, int] = (16, 8, 16, 8),
    programs: int = 1,
    block_k: int = 256,
    work: bool = True,
    sync: bool = True,
    prefetch: bool = False,
    num_warps: int = 8,
) -> torch.Tensor:
    """Run :func:`_chain_kernel` in place: ``a`` (bf16 ``[>= H]``) holds the chain's input and
    then its output; ``b`` (bf16 ``[>= max(Q, 2I)]``) is scratch; ``bar`` two zeroed int32
    counters; ``w`` the packed bf16 weights (``layers * layer_numel(*dims)``). ``tiles``: rows
    per tile of qkv, o, gate_up, down (each dividing its N); ``block_k`` divides every K.

    Raises:
        ValueError: a tile or ``block_k`` that does not divide its dimension, or more than one
            program without ``sync``.
    """
    h, q, at, i = dims
    for n, bn in zip((q, h, 2 * i, h), tiles):
        if n % bn:
            raise ValueError(f"tile of {bn} rows does not divide N = {n}")
    if any(k % block_k for k in (h, at, i)):
        raise ValueError(f"block_k {block_k} does not divide every K of {dims}")
    if programs > 1 and not sync:
        raise ValueError("without barriers the chain is correct with one program only")
    _chain_kernel[(programs,)](
        w, a, b, bar, layers, h, q, at, i, *tiles, block_k, work, sync, prefetch, interpreting(),
        num_warps=num_warps,
    )  # fmt: skip
    return a


def reference_chain(w: torch.Tensor, x: torch.Tensor, layers: int, dims=(HIDDEN, QKV, ATTN, INTER)):
    """The same chain in float32 torch, each output rounded to bf16: ``[H]`` float32."""
    h, q, at, i = dims
    shapes = [(q, h), (h, at), (2 * i, h), (h, i)]
    per = layer_numel(*dims)
    act = x[:h].float()
    for layer in range(layers):
        off = layer * per
        for n, k in shapes:
            wt = w[off : off + n * k].view(n, k).float()
            act = (wt @ act[:k]).to(torch.bfloat16).float()
            off += n * k
    return act


def main() -> int:
    from bench.pdl_probe import SHAPES, chain, table_config, time_or_report

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--programs", type=int, default=0, help="0: the SM count")
    ap.add_argument("--tiles", type=int, nargs=4, default=[16, 8, 16, 8])
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("grid_barrier_probe: needs a CUDA device of compute capability 9.0+; skipped")
        return 0
    dev = torch.device("cuda")
    programs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    dims = (HIDDEN, QKV, ATTN, INTER)
    per = layer_numel(*dims)
    w = torch.empty(args.layers * per, device=dev, dtype=torch.bfloat16)
    off = 0
    for _ in range(args.layers):
        for n, k in ((QKV, HIDDEN), (HIDDEN, ATTN), (2 * INTER, HIDDEN), (HIDDEN, INTER)):
            w[off : off + n * k] = (torch.randn(n * k, device=dev) / k**0.5).to(torch.bfloat16)
            off += n * k
    x = torch.randn(6144, device=dev, dtype=torch.bfloat16)
    ref = reference_chain(w, x, args.layers, dims)
    a = torch.empty(6144, device=dev, dtype=torch.bfloat16)
    b = torch.empty(6144, device=dev, dtype=torch.bfloat16)
    bar = torch.zeros(2, device=dev, dtype=torch.int32)
    kernels = 4 * args.layers

    def rel(out: torch.Tensor) -> float:
        return ((out.float()[:HIDDEN] - ref).norm() / ref.norm()).item()

    rows = []
    # today's kernels: one PDL launch per GEMV (the engine's tiles), the same weights as views
    views, off = [], 0
    for _ in range(args.layers):
        layer = []
        for _name, n, k in SHAPES:
            layer.append(w[off : off + n * k].view(n, k))
            off += n * k
        views.append(layer)
    cfgs = [table_config(n, k, dev) for _, n, k in SHAPES]
    timed = time_or_report(
        "pdl+prefetch", lambda: chain(x[None, :], views, cfgs, 2, False, False), args.reps
    )
    if timed is not None:
        rows.append(("pdl+prefetch (one launch per GEMV)", timed[0], rel(timed[1][0])))
    for label, work, prefetch in (
        ("persistent", True, False),
        ("persistent+prefetch", True, True),
        ("barriers only", False, False),
    ):

        def run(work=work, prefetch=prefetch):
            a.copy_(x)
            return persistent_chain(
                w, a, b, bar, args.layers, dims, tuple(args.tiles), programs, args.block_k,
                work=work, prefetch=prefetch, num_warps=args.warps,
            )  # fmt: skip

        timed = time_or_report(label, run, args.reps)
        if timed is not None:
            err = rel(timed[1]) if work else float("nan")
            rows.append((f"{label} ({programs} programs)", timed[0], err))
    print(
        f"\n{args.layers} layers x 4 projections ({kernels} GEMVs), batch 1, CUDA graph; "
        f"persistent tiles {args.tiles}, block_k {args.block_k}, {args.warps} warps"
    )
    print("| variant | us per chain | us per GEMV | rel err vs fp32 chain |")
    print("|---|---|---|---|")
    for label, us, err in rows:
        print(f"| {label} | {us:.1f} | {us / kernels:.2f} | {err:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
