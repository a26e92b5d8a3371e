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
  that walks the 112 GEMVs, each program taking ``--tiles`` rows at a time in a grid-stride
  loop (default: ``ceil(N / programs)`` rows, one tile per program), with a grid
  barrier after each GEMV (an acquire-release arrival counter at GPU scope, spun on);
* ``persistent+L2 prefetch``: the same, each program asking L2 for its next GEMV's weight tiles
  between its arrival at the barrier and its wait (their fetch overlaps the wait);
* ``persistent+preload P``: instead, each program loads the first ``P`` columns of its next
  GEMV's first tile into registers there;
* ``pdl+prefetch, one tile per program``: one PDL launch per GEMV again (the L2 prefetch
  before the wait, as the engine), but of the persistent chain's tiles (``ceil(N / programs)``
  rows x the whole K per program, no split-K, ``--rows-warps`` warps): which part of a
  difference is the barrier and which the tiles;
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

from kernels.grid_barrier import grid_arrive, grid_leave, grid_wait, launch_resident  # noqa: E402
from kernels.interpreter import interpreting  # noqa: E402
from kernels.pdl import launch_options, pdl_wait, prefetch_l2  # noqa: E402
from kernels.rounding import round_to  # noqa: E402

#: Qwen3-0.6B at TP 1: hidden size, q/k/v outputs, o input, intermediate size
HIDDEN, QKV, ATTN, INTER = 1024, 4096, 2048, 3072


@triton.jit
def _prefetch_tiles(
    w_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    BK: tl.constexpr, pid, nprog,
):  # fmt: skip
    """Ask L2 for every 128-byte line of this program's ``[BN, K]`` weight tiles of a GEMV
    (``prefetch.global.L2``, ``max(BK, 64) // 64`` lines per row at a time, the columns past
    ``K`` clamped: reads nothing into registers; ``BP``: ``BN`` rounded up to a power of two,
    the rows past ``BN`` or ``N`` clamped)."""
    STEP: tl.constexpr = BK if BK >= 64 else 64  # a line (64 bf16) at least
    for t in range(pid, (N + BN - 1) // BN, nprog):
        r = tl.minimum(t * BN + tl.minimum(tl.arange(0, BP), BN - 1), N - 1)
        rows = r.to(tl.int64)
        for k0 in tl.static_range(0, K, STEP):
            cols = tl.minimum(k0 + tl.arange(0, STEP // 64) * 64, K - 1)
            ptrs = w_ptr + rows[:, None] * K + cols[None, :]
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
            )


@triton.jit
def _preload(
    w_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    BK: tl.constexpr, PRE: tl.constexpr, pid, nprog, PREFETCH: tl.constexpr,
):  # fmt: skip
    """The next GEMV's weights asked for before its barrier: with ``PREFETCH`` every line of
    this program's tiles into L2 (:func:`_prefetch_tiles`); with ``PRE > 0`` the first ``PRE``
    columns of its first tile (tile ``pid``; zeros where ``pid`` has none) loaded into
    registers, returned as bf16 ``[BP, PRE]`` (else 0)."""
    if PREFETCH:
        _prefetch_tiles(w_ptr, N, K, BN, BP, BK, pid, nprog)
    if PRE > 0:
        i = tl.arange(0, BP)
        rows = pid * BN + i
        ok = (i < BN) & (rows < N)
        ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + tl.arange(0, PRE)[None, :]
        w0 = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        w0 = 0
    return w0


@triton.jit
def _gemv_tile(
    w_ptr, x_ptr, y_ptr, t, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
    BP: tl.constexpr, BK: tl.constexpr, w0, PRE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``y[n] = sum_k W[n, k] x[k]`` (bf16 in, float32 sums, bf16 out) for the rows of tile
    ``t`` (``BN`` rows of ``W [N, K]``, ``BP`` its power-of-two width, the rows past ``BN`` or
    ``N`` masked); its first ``PRE`` columns come from ``w0`` (bf16 ``[BP, PRE]``, loaded
    earlier) when ``PRE > 0``. ``x`` is read at L2 (``.cg``): another
    program wrote it before the last barrier. ``EMULATE_RNE``: the interpreter's rounding
    (:func:`kernels.rounding.round_to`)."""
    i = tl.arange(0, BP)
    rows = (t * BN + i).to(tl.int64)
    ok = (i < BN) & (rows < N)
    part = tl.zeros((BP,), dtype=tl.float32)
    if PRE > 0:
        x0 = tl.load(x_ptr + tl.arange(0, PRE), cache_modifier=".cg").to(tl.float32)
        part = tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
    acc = tl.zeros((BP, BK), dtype=tl.float32)
    for k0 in tl.static_range(PRE, K, BK):
        cols = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        wv = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0)
        wv = wv.to(tl.float32)
        acc += wv * xv[None, :]
    y = round_to(part + tl.sum(acc, axis=1), y_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(y_ptr + rows, y, mask=ok)


@triton.jit
def _gemv_tiles(
    w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    BK: tl.constexpr, pid, nprog, w0, PRE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """This program's tiles of one GEMV (:func:`_gemv_tile`) in a grid-stride loop: tile
    ``pid`` with the preloaded ``w0`` (:func:`_preload`), then ``pid + nprog``, ..."""
    if pid < (N + BN - 1) // BN:
        _gemv_tile(w_ptr, x_ptr, y_ptr, pid, N, K, BN, BP, BK, w0, PRE, EMULATE_RNE)
    for t in range(pid + nprog, (N + BN - 1) // BN, nprog):
        _gemv_tile(w_ptr, x_ptr, y_ptr, t, N, K, BN, BP, BK, 0, 0, EMULATE_RNE)


@triton.jit
def _chain_step(
    w, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, w0,
    w_next, N_NEXT: tl.constexpr, K_NEXT: tl.constexpr, BN_NEXT: tl.constexpr,
    BP_NEXT: tl.constexpr, bar_ptr, target, pid, nprog, BK: tl.constexpr, PRE: tl.constexpr,
    WORK: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """One GEMV of the chain (``y = W x``, ``W [N, K]`` at ``w``, its first tile's columns
    ``w0`` preloaded; with ``WORK``), then the barrier after it (with ``SYNC``; counter
    ``target``) with the next GEMV's weights (``[N_NEXT, K_NEXT]`` at ``w_next``) asked for
    between the arrival and the wait (:func:`_preload`); returns that preload."""
    if WORK:
        _gemv_tiles(w, x_ptr, y_ptr, N, K, BN, BP, BK, pid, nprog, w0, PRE, EMULATE_RNE)
    if SYNC:
        grid_arrive(bar_ptr)
    w0_next = _preload(w_next, N_NEXT, K_NEXT, BN_NEXT, BP_NEXT, BK, PRE, pid, nprog, PREFETCH)
    if SYNC:
        grid_wait(bar_ptr, target)
    return w0_next


@triton.jit
def _chain_kernel(
    w_ptr, a_ptr, b_ptr, bar_ptr, LAYERS,
    H: tl.constexpr, Q: tl.constexpr, A: tl.constexpr, FF: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
    BP_QKV: tl.constexpr, BP_O: tl.constexpr, BP_GU: tl.constexpr, BP_DOWN: tl.constexpr,
    BK: tl.constexpr, WORK: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr,
    PRE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``LAYERS`` x (qkv ``[Q, H]``, o ``[H, A]``, gate_up ``[2FF, H]``, down ``[H, FF]``) GEMVs
    chained through two bf16 activation buffers (``a`` ``[H]`` in and out, ``b`` between), the
    weights of layer ``l`` packed at ``w_ptr + l * (Q*H + H*A + 2FF*H + H*FF)`` in that order,
    a grid barrier between GEMVs (:func:`grid_arrive`, then the next GEMV's weights asked for
    (:func:`_preload`: ``PREFETCH``, ``PRE``), then :func:`grid_wait`). ``WORK`` False leaves the
    GEMVs out (barriers only); ``SYNC`` False leaves the barriers out (correct only with one
    program). The last program to leave resets the counters (:func:`grid_leave`), so every
    launch starts from zero."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    OFF_O: tl.constexpr = Q * H
    OFF_GU: tl.constexpr = OFF_O + H * A
    OFF_DOWN: tl.constexpr = OFF_GU + 2 * FF * H
    LAYER: tl.constexpr = OFF_DOWN + H * FF
    wq = _preload(w_ptr, Q, H, BN_QKV, BP_QKV, BK, PRE, pid, nprog, PREFETCH)
    for layer in range(LAYERS):
        w = w_ptr + layer * LAYER  # < 2**31 elements for up to 136 layers of 0.6B
        # the next layer's qkv (past the last layer: its own qkv again, unused)
        w_next = w_ptr + tl.minimum(layer + 1, LAYERS - 1) * LAYER
        t = layer * 4 * nprog  # the barrier counter before this layer
        wo = _chain_step(
            w, a_ptr, b_ptr, Q, H, BN_QKV, BP_QKV, wq, w + OFF_O, H, A, BN_O, BP_O,
            bar_ptr, t + nprog, pid, nprog, BK, PRE, WORK, SYNC, PREFETCH, EMULATE_RNE,
        )  # fmt: skip
        wg = _chain_step(
            w + OFF_O, b_ptr, a_ptr, H, A, BN_O, BP_O, wo, w + OFF_GU, 2 * FF, H, BN_GU, BP_GU,
            bar_ptr, t + 2 * nprog, pid, nprog, BK, PRE, WORK, SYNC, PREFETCH, EMULATE_RNE,
        )  # fmt: skip
        wd = _chain_step(
            w + OFF_GU, a_ptr, b_ptr, 2 * FF, H, BN_GU, BP_GU, wg, w + OFF_DOWN, H, FF, BN_DOWN,
            BP_DOWN, bar_ptr, t + 3 * nprog, pid, nprog, BK, PRE, WORK, SYNC, PREFETCH,
            EMULATE_RNE,
        )  # fmt: skip
        wq = _chain_step(
            w + OFF_DOWN, b_ptr, a_ptr, H, FF, BN_DOWN, BP_DOWN, wd, w_next, Q, H, BN_QKV, BP_QKV,
            bar_ptr, t + 4 * nprog, pid, nprog, BK, PRE, WORK, SYNC, PREFETCH, EMULATE_RNE,
        )  # fmt: skip
    if SYNC:
        grid_leave(bar_ptr, nprog)


@triton.jit
def _rows_gemv_kernel(
    w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    BK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """One GEMV per launch with the persistent chain's tiles (program ``t``: tile ``t`` of
    ``BN`` rows x the whole K, :func:`_gemv_tile`), launched as the engine launches its GEMVs:
    with ``PDL`` a programmatic dependent launch (:func:`kernels.pdl.pdl_wait`), with
    ``PREFETCH`` the tile's first ``4 * BK`` columns asked of L2 before the wait
    (:func:`kernels.pdl.prefetch_l2`)."""
    t = tl.program_id(0)
    if PREFETCH:
        i = tl.minimum(tl.arange(0, BP), BN - 1)
        rows = tl.minimum(t * BN + i, N - 1).to(tl.int64)
        prefetch_l2(w_ptr, rows, K, 0, K, 64, BK // 64)
    pdl_wait(PDL)
    _gemv_tile(w_ptr, x_ptr, y_ptr, t, N, K, BN, BP, BK, 0, 0, EMULATE_RNE)


def rows_gemv(
    w: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    rows: int,
    block_k: int = 256,
    num_warps: int = 8,
    pdl: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:
    """``y[:N] = w @ x[:K]`` (bf16 ``w [N, K]`` contiguous, bf16 vectors) by
    :func:`_rows_gemv_kernel`, ``rows`` rows per program (``ceil(N / rows)`` programs); PDL and
    the L2 prefetch need a Hopper GPU (compiled kernels). Returns ``y``.

    Raises:
        ValueError: ``block_k`` not dividing K, or ``rows`` under 1.
    """
    n, k = w.shape
    if k % block_k or rows < 1:
        raise ValueError(f"block_k {block_k} must divide K = {k} and rows ({rows}) be >= 1")
    _rows_gemv_kernel[(triton.cdiv(n, rows),)](
        w, x, y, n, k, rows, triton.next_power_of_2(rows), block_k, pdl, prefetch, interpreting(),
        num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return y


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
    tiles: tuple[int, int, int, int] | None = (16, 8, 16, 8),
    programs: int = 1,
    block_k: int = 256,
    work: bool = True,
    sync: bool = True,
    prefetch: bool = False,
    num_warps: int = 8,
    preload: int = 0,
    info: dict | None = None,
) -> torch.Tensor:
    """Run :func:`_chain_kernel` in place: ``a`` (bf16 ``[>= H]``) holds the chain's input and
    then its output; ``b`` (bf16 ``[>= max(Q, 2I)]``) is scratch; ``bar`` two zeroed int32
    counters; ``w`` the packed bf16 weights (``layers * layer_numel(*dims)``). ``tiles``: rows
    per tile of qkv, o, gate_up, down (any count >= 1; None: ``ceil(N / programs)``, one tile
    per program); ``block_k`` divides every K;
    ``prefetch``: the next GEMV's tiles asked of L2 at each barrier; ``preload``: columns of
    the next GEMV's first tile loaded into registers there (0, or a power-of-two multiple of
    ``block_k`` that divides every K).

    Raises:
        ValueError: a tile under one row, a ``block_k`` or ``preload`` that does not divide
            every K, more than one program without ``sync``, or more programs than the GPU
            holds at once (:func:`launch_resident`, whose register line goes to
            ``info["usage"]`` when ``info`` is a dict).
    """
    h, q, at, i = dims
    ns = (q, h, 2 * i, h)
    tiles = tiles or tuple(-(-n // programs) for n in ns)
    if min(tiles) < 1:
        raise ValueError(f"tiles {tiles}: every tile needs a row")
    widths = tuple(triton.next_power_of_2(t) for t in tiles)
    if any(k % block_k for k in (h, at, i)):
        raise ValueError(f"block_k {block_k} does not divide every K of {dims}")
    if preload and (
        preload % block_k or preload & (preload - 1) or any(k % preload for k in (h, at, i))
    ):
        raise ValueError(
            f"preload {preload}: not a power-of-two multiple of block_k dividing every K"
        )
    if programs > 1 and not sync:
        raise ValueError("without barriers the chain is correct with one program only")
    args = (
        w, a, b, bar, layers, h, q, at, i, *tiles, *widths, block_k, work, sync, prefetch, preload,
        interpreting(),
    )  # fmt: skip
    usage = launch_resident(_chain_kernel, (programs,), args, num_warps, w.device)
    if info is not None:
        info["usage"] = usage
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
    ap.add_argument(
        "--tiles", type=int, nargs=4, default=None,
        help="rows per tile of qkv, o, gate_up, down (default: N / programs, one tile each)",
    )  # fmt: skip
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--preload", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--rows-warps", type=int, nargs="*", default=[8, 16])
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

    def run_pdl():
        a.copy_(x)  # (as every variant below does)
        return chain(a[None, :], views, cfgs, 2, False, False)

    timed = time_or_report("pdl+prefetch", run_pdl, args.reps)
    if timed is not None:
        rows.append(("pdl+prefetch (one launch per GEMV)", timed[0], rel(timed[1][0])))
    shapes = [(QKV, HIDDEN), (HIDDEN, ATTN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    for warps in args.rows_warps:  # one PDL launch per GEMV, the persistent chain's tiles

        def run_rows(warps=warps):
            a.copy_(x)
            src, dst = a, b
            for view, (n, _k) in zip((v for layer in views for v in layer), shapes * args.layers):
                rows_gemv(view, src, dst, -(-n // programs), args.block_k, warps, True, True)
                src, dst = dst, src
            return src

        timed = time_or_report(f"pdl rows {warps} warps", run_rows, args.reps)
        if timed is not None:
            rows.append((f"pdl+prefetch, one tile per program, {warps} warps", *timed[:1],
                         rel(timed[1])))  # fmt: skip
    variants = [("persistent", True, False, 0), ("persistent+L2 prefetch", True, True, 0)]
    variants += [(f"persistent+preload {p}", True, False, p) for p in args.preload]
    variants += [("barriers only", False, False, 0)]
    tiles = tuple(args.tiles) if args.tiles else None
    for label, work, prefetch, preload in variants:
        info: dict = {}

        def run(work=work, prefetch=prefetch, preload=preload, info=info):
            a.copy_(x)
            return persistent_chain(
                w, a, b, bar, args.layers, dims, tiles, programs, args.block_k,
                work=work, prefetch=prefetch, num_warps=args.warps, preload=preload, info=info,
            )  # fmt: skip

        timed = time_or_report(label, run, args.reps)
        if timed is not None:
            err = rel(timed[1]) if work else float("nan")
            usage = info.get("usage") or "registers not reported"
            rows.append((f"{label} ({programs} programs; {usage})", timed[0], err))
    print(
        f"\n{args.layers} layers x 4 projections ({kernels} GEMVs), batch 1, CUDA graph; "
        f"persistent tiles {tiles or 'N / programs'}, block_k {args.block_k}, "
        f"{args.warps} warps"
    )
    print("| variant | us per chain | us per GEMV | rel err vs fp32 chain |")
    print("|---|---|---|---|")
    bad = 0
    for label, us, err in rows:
        flag = " **over 5e-2**" if err > 5e-2 else ""  # (nan: no output to check)
        bad += bool(flag)
        print(f"| {label} | {us:.1f} | {us / kernels:.2f} | {err:.2e}{flag} |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
