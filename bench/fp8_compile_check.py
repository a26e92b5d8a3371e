"""Compile the block-FP8 kernels for the H200 (CUDA sm_90) on a machine without a GPU: every
configuration ``bench/fp8_sweep.py`` may time, or (``--quick``) the built-in ones and one of each
option, as ``kernels/fp8_gemm.py``'s launchers launch them.

Usage (no GPU needed; not under ``TRITON_INTERPRET``)::

    python3 bench/fp8_compile_check.py [--quick | --gemv-variants] [--arch 90]

The launchers run on ``meta`` tensors with their kernels swapped for recorders, so each launch's
arguments are exactly what the launcher passes; Triton's own specialization of those arguments
(``native_specialize_impl``: 16-byte aligned pointers, 16-divisible integers, integers equal to
1) gives the signature, and ``triton.compile`` builds it for ``GPUTarget("cuda", arch, 32)``.
Prints per kernel: shared memory, registers and spilled bytes (``ptxas -v`` on the PTX), compile
seconds, and the failures (a compile error, or more shared memory than the H200's 227 KB, which
fails at launch). First it checks that the sweep's warm-up launches specialize as its timed
ones (else the timing process would compile again). Exits 1 when a built-in configuration fails
or a warm-up specializes differently (any other failing configuration is skipped by the sweep).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import bench.fp8_sweep as sweep  # noqa: E402
import kernels.fp8_gemm as fg  # noqa: E402
import kernels.pdl as pdl_module  # noqa: E402
from bench.fp8_sweep import SHAPES, SMEM_LIMIT, cfg_str, compile_key, compile_set  # noqa: E402
from bench.pdl_ptx import pdl_order_error  # noqa: E402
from kernels.fp8_configs import M_BUCKETS, Fp8Config, default_fp8_config  # noqa: E402

KERNELS = (
    "_fp8_gemm_kernel",
    "_fp8_gemv_kernel",
    "_group_quant_kernel",
    "_fp8_gemv_bd_kernel",
    "_fp8_gemv_fma_kernel",
)


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, grid, args, kwargs))


@contextmanager
def recorded_launches():
    """The launches of ``kernels.fp8_gemm``'s kernels inside the block, as a list of
    ``(jit function, grid, args, kwargs)``; nothing runs."""
    launches: list = []
    saved = {name: getattr(fg, name) for name in KERNELS}
    try:
        for name, fn in saved.items():
            setattr(fg, name, _Recorder(fn, launches))
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(fg, name, fn)


def launches_of(cfg: Fp8Config, m: int = 16, n: int = 4096, k: int = 4096) -> list:
    """The launches ``fp8_linear`` makes for ``cfg`` at ``[M, K] x [K, N]`` (bf16 in and out),
    with PDL on as on Hopper (``kernels/pdl.py``; the meta device would turn it off)."""
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    ws = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32, device="meta")
    saved = pdl_module.pdl_enabled
    pdl_module.pdl_enabled = lambda device: True
    try:
        with recorded_launches() as launches:
            fg.fp8_linear(x, w, ws, config=cfg)
    finally:
        pdl_module.pdl_enabled = saved
    return launches


def specialization(fn, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attributes, options) the JIT derives from one launch's arguments
    (Triton's ``native_specialize_impl``, honouring ``do_not_specialize``): what its compile
    cache is keyed on, besides the source."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    kwargs = dict(kwargs)
    opts = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    kwargs.pop("launch_pdl", None)  # read by the launcher only (no PTX changes with it)
    bound = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name] if p.name in bound else p.default  # a constexpr left at its default
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", v
            continue
        ty, key = native_specialize_impl(
            CUDABackend, v, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
        )
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = key
        elif isinstance(key, str) and key:
            attrs[(i,)] = CUDABackend.parse_attr(key)
    return signature, constexprs, attrs, opts


def compile_launch(fn, args, kwargs, arch: int):
    """``triton.compile`` of one recorded launch for ``cuda:arch``, specialized as the JIT
    would specialize these arguments."""
    signature, constexprs, attrs, opts = specialization(fn, args, kwargs)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes) from ``ptxas -v`` of the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        cmd = [get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", path, "-o", os.devnull]
        err = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def variant_set() -> list[Fp8Config]:
    """The configurations of ``bench/fp8_sweep.py --gemv-variants`` (one per compile key)."""
    with variants_mode():
        return compile_set(SHAPES, sweep.VARIANT_MS)


@contextmanager
def variants_mode():
    """``bench.fp8_sweep``'s candidates as with --gemv-variants inside the block."""
    saved = sweep.GEMV_VARIANTS["on"]
    sweep.GEMV_VARIANTS["on"] = True
    try:
        yield
    finally:
        sweep.GEMV_VARIANTS["on"] = saved


def warm_mismatches() -> list[str]:
    """Configurations of the sweep whose warm-up launch (``bench.fp8_sweep.WARM_SHAPE``) the
    JIT would specialize differently from a timed shape and M (the timing process would then
    compile it again itself): the GEMM, small-M and quantization kernels. The default mode's
    configurations at every shape and bucket they may be timed at; --gemv-variants' (whose
    split counts are those of one shape) at their own shape, against the configuration the
    warm-up compiles for their compile key."""
    from bench.fp8_sweep import WARM_MS, WARM_SHAPE

    main_kernels = KERNELS

    def keys(cfg, m, n, k):
        return [specialization(f, a, kw) for f, _, a, kw in launches_of(cfg, m, n, k)
                if f.__name__ in main_kernels]  # fmt: skip

    def warm(cfg):
        _, wn, wk = WARM_SHAPE
        return [
            keys(cfg, wm, wn, wk) for wm in WARM_MS if not (cfg.kind == "gemv" and wm > cfg.block_m)
        ]

    bad = []
    for cfg in compile_set(SHAPES, M_BUCKETS):
        warm_keys = warm(cfg)
        for name, n, k in SHAPES:
            for m in M_BUCKETS:
                if cfg.kind == "gemv" and m > cfg.block_m or cfg.split_k > 1 and m > 256:
                    continue  # never timed there (bench.fp8_sweep.stage_a, variants)
                if keys(cfg, m, n, k) not in warm_keys:
                    bad.append(f"{cfg_str(cfg)} at {name} M={m}")
    with variants_mode():
        compiled = {compile_key(c): c for c in compile_set(SHAPES, sweep.VARIANT_MS)}
        warm_of: dict = {}
        for name, n, k in SHAPES:
            for m in sweep.VARIANT_MS:
                first = sweep.stage_a(m, n, k)
                for cfg in dict.fromkeys(
                    first + [v for c in first for v in sweep.variants(m, n, k, c)]
                ):
                    rep = compiled[compile_key(cfg)]
                    if rep not in warm_of:
                        warm_of[rep] = warm(rep)
                    if keys(cfg, m, n, k) not in warm_of[rep]:
                        bad.append(f"{cfg_str(cfg)} at {name} M={m} (--gemv-variants)")
    return bad


def quick_set() -> list[Fp8Config]:
    """The built-in configurations of the sweep's shapes and M, and one of each option."""
    out = {default_fp8_config(m, n, k) for _, n, k in SHAPES for m in (1, 16, *M_BUCKETS)}
    out |= {
        Fp8Config("gemm", 64, 128, 4, 4, split_k=4, group_m=1),
        Fp8Config("gemm", 16, 64, 4, 5, split_k=2, fuse_quant=True),
        Fp8Config("gemm", 128, 256, 8, 3),
        Fp8Config("gemv", 64, 64, 4, 4, split_k=4),
        Fp8Config("gemv", 1, 32, 4, 1, split_k=2, fma=True),
        Fp8Config("gemv", 1, 16, 4, 1, split_k=2, fma=True, block_k=512, bit_cvt=True),
        Fp8Config("gemv", 1, 128, 4, 4, split_k=2, x_groups=16, prefetch=True),
        Fp8Config("gemv", 16, 64, 4, 4, split_k=4, x_groups=4, block_k=256),
        Fp8Config("gemv", 16, 128, 8, 4, split_k=4, scale_ahead=True),
    }
    return sorted(out, key=cfg_str)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--gemv-variants", action="store_true",
        help="the configurations of bench/fp8_sweep.py --gemv-variants (M = 1 and 16)",
    )  # fmt: skip
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    bad = warm_mismatches()
    for what in bad:
        print(f"warm-up specializes differently: {what}")
    if not bad:
        print("warm-up launches specialize as the timed ones")
    builtin = {default_fp8_config(m, n, k) for _, n, k in SHAPES for m in (1, 16, *M_BUCKETS)}
    cfgs = (
        quick_set() if args.quick
        else variant_set() if args.gemv_variants
        else compile_set(SHAPES, M_BUCKETS)
    )  # fmt: skip
    cfgs = sorted(set(cfgs) | builtin, key=cfg_str)
    print(f"{len(cfgs)} configurations for sm_{args.arch}, triton {triton.__version__}")
    print(
        "| config | kernel | shared KB | registers | spilled bytes | s |\n|---|---|---|---|---|---|"
    )
    failed, seen = [], set()
    t_all = time.perf_counter()
    for cfg in cfgs:
        # the small-M tiles are timed at M = 1 too (the batch-1 bucket), which the JIT
        # specializes apart; fma runs one row only
        small = cfg.kind == "gemv" and cfg.block_m <= 16
        ms = tuple(m for m in (16, 1) if m <= cfg.block_m) if small else (16,)
        launches = [(m, launch) for m in ms for launch in launches_of(cfg, m)]
        for m, (fn, _grid, a, kw) in launches:
            t = time.perf_counter()
            key = (
                fn.__name__,
                compile_key(cfg) if fn.__name__ != "_group_quant_kernel" else repr(kw),
                m,
            )
            if key in seen:
                continue
            seen.add(key)
            try:
                kernel = compile_launch(fn, a, kw, args.arch)
            except Exception as exc:  # noqa: BLE001 - reported, then judged below
                print(f"| {cfg_str(cfg)} | {fn.__name__} | FAILED {type(exc).__name__}: "
                      f"{str(exc)[:160]} | | | |")  # fmt: skip
                failed.append((cfg, fn.__name__))
                continue
            regs, spill = ptxas_usage(kernel.asm["ptx"], args.arch)
            shared = kernel.metadata.shared
            print(
                f"| {cfg_str(cfg)} M={m} | {fn.__name__} | {shared / 1024:.1f} | {regs} | {spill} "
                f"| {time.perf_counter() - t:.1f} |",
                flush=True,
            )
            if shared > SMEM_LIMIT:  # the launch would fail on the H200 (the sweep skips it)
                failed.append((cfg, f"{fn.__name__}: {shared} B shared > {SMEM_LIMIT}"))
            race = pdl_order_error(kernel.asm["ptx"], bool(kw.get("PDL")))
            if race:
                bad.append(race)  # never acceptable, built-in tiles or not
                failed.append((cfg, f"{fn.__name__}: {race}"))
    print(f"{len(seen)} kernels in {time.perf_counter() - t_all:.1f} s")
    for cfg, what in failed:
        print(f"failed: {cfg_str(cfg)} {what}{' (built-in)' if cfg in builtin else ''}")
    return 1 if bad or any(cfg in builtin for cfg, _ in failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
