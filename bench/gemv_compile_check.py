"""Offline compile check of the small-M GEMV kernels for the H200 (sm_90), without a GPU.

Compiles, with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``:

* ``_gemv_kernel`` (``kernels/gemv.py``) with the default tiles and every configuration of the
  committed H200 table, and at M = 64 (a 64-row activation tile) with the default tiles (and
  at M = 32) and every configuration the plain sweep times for 17-64 rows on Qwen3-0.6B's
  shapes;
* ``_gemv_swiglu_kernel`` and ``_gemv_rms_norm_kernel`` (``kernels/gemv_fused.py``) with every
  configuration ``bench/gemv.py --fused`` may time (Qwen3-0.6B's and 8B's K) and the default
  tiles (what a forced fusion without a table uses), the norm with and without the residual
  (the first layer), one bias variant each and one ragged-K (``EVEN_K`` false) variant;

each with PDL and the weight prefetch on (as launched on Hopper, ``kernels/pdl.py``) and as
the JIT specializes a launch of M = 1 (the row count folded to a constant) and of M = 16
(aligned pointers, multiples of 16 marked divisible). Reports shared memory, registers and
spills (``ptxas -v``); fails (exit 1) on a compile error, more shared memory than an sm_90
block may use, or a memory access before ``griddepcontrol.wait`` (:func:`pdl_order_error`).
The Triton CPU interpreter misses such errors, which is why this exists.

Usage: ``python3 bench/gemv_compile_check.py [--threads N] [--quick]`` (``--quick``: the default
tiles only). Must run without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("gemv_compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch  # noqa: E402

from bench.gemv_configs import FUSED_SHAPES, SHAPES, candidates, fused_candidates  # noqa: E402
from bench.pdl_ptx import pdl_order_error  # noqa: E402
from bench.prefill_compile_check import compile_all, compile_sm90, ptxas_usage  # noqa: E402
from kernels.configs import table_path  # noqa: E402
from kernels.gemv import GEMV_WIDE_MAX_M, GemvConfig, _gemv_kernel, block_m, prefetchable  # noqa: E402
from kernels.gemv_fused import _gemv_rms_norm_kernel, _gemv_swiglu_kernel  # noqa: E402
from kernels.gemv_qk_rope import _gemv_rms_norm_qk_rope_kernel  # noqa: E402

#: every other pointer: bf16
PTR_TYPES = {"part_ptr": "*fp32", "counter_ptr": "*i32", "slot_ptr": "*i64"}
#: the q/k/v + rotary kernel's other integers: a Qwen3-0.6B layer over 128-token blocks
#: (cos/sin ``[M, 1, 128]`` rows, cache ``[blocks, 128, 8, 128]``, 16 q and 8 KV heads)
QK_ROPE_INTS = {
    "stride_cos_t": 128,
    "stride_cos_d": 1,
    "stride_sin_t": 128,
    "stride_sin_d": 1,
    "stride_cb": 128 * 8 * 128,
    "stride_co": 8 * 128,
    "stride_ch": 128,
    "stride_cd": 1,
    "num_q_heads": 16,
    "num_kv_heads": 8,
}


def specialize(fn, constexprs: dict, m: int, n: int, k: int) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of a bf16 launch of ``fn`` with ``m`` rows, ``n``
    outputs and ``k`` inputs: pointers 16-byte aligned, integers equal to 1 folded to constants,
    multiples of 16 marked divisible by 16, ``eps`` a float32."""
    ints = {
        "M": m,
        "N": n,
        "K": k,
        "K_PER_SPLIT": k,
        "stride_xm": 2 * k if fn is _gemv_swiglu_kernel else k,
        "stride_rm": k,
        "stride_rom": k,
        "stride_wn": k,
        "stride_om": n,
        **QK_ROPE_INTS,
    }
    # (constexprs the kernel does not take are dropped: the q/k/v + rotary kernel's N tile is
    # HEAD_DIM, not BLOCK_N)
    sig, attrs = {}, {}
    consts = {name: v for name, v in constexprs.items() if name in fn.arg_names}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = PTR_TYPES.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("eps", "qk_eps"):
            sig[name] = "fp32"
        elif ints[name] == 1:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_one(job) -> tuple[str, str | None, int, str]:
    name, fn, consts, opts, (m, n, k) = job
    kern, err = compile_sm90(fn, *specialize(fn, consts, m, n, k), opts)
    if kern is None:
        return name, err, 0, ""
    ptx = kern.asm["ptx"]
    err = pdl_order_error(ptx, bool(consts.get("PDL")))
    return name, err, int(kern.metadata.shared), ptxas_usage(ptx)


def _consts(cfg: GemvConfig, **flags) -> dict:
    base = {
        "BLOCK_M": 16,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "SPLIT_K": cfg.split_k,
        "HAS_BIAS": False,
        "EVEN_K": True,
        "UPCAST": False,
        "DOT_PREC": "tf32",
        # as launched on Hopper (kernels/pdl.py): PDL, and the weight prefetch where it applies
        "PDL": True,
        "PREFETCH": prefetchable(torch.empty(0, dtype=torch.bfloat16), cfg.block_k),
    }
    return {**base, **flags}


def jobs(quick: bool) -> list:
    out = []

    def add(label, fn, cfg, shape, ms=(1, 16), **flags):
        opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        for m in ms:
            consts = _consts(cfg, **flags)
            if fn is _gemv_kernel:  # the plain kernel's row tile follows M (16, 32 or 64)
                consts["BLOCK_M"] = block_m(m)
            out.append((f"{label} {cfg} {flags} M={m}", fn, consts, opts, (m, *shape)))

    plain = {GemvConfig()}
    wide = {GemvConfig()}  # M = 64: a 64-row activation tile
    if not quick:
        table = json.loads(table_path("gemv", "NVIDIA H200").read_text())
        for rows in table.values():
            plain.update(c for c in map(GemvConfig.from_row, rows.values()) if c is not None)
        for name, (n, k) in SHAPES.items():
            if name.startswith("0.6B"):
                wide.update(candidates(n, k, sweep=True, tiny=False, m=GEMV_WIDE_MAX_M))
    for cfg in sorted(plain, key=str):
        add("gemv", _gemv_kernel, cfg, (1024, 3072))
    for cfg in sorted(wide, key=str):  # (the default tiles at 32 rows too: M = 17-32)
        ms = (GEMV_WIDE_MAX_M // 2, GEMV_WIDE_MAX_M) if cfg == GemvConfig() else (GEMV_WIDE_MAX_M,)
        add("gemv", _gemv_kernel, cfg, (1024, 3072), ms=ms)
    rne = {"EMULATE_RNE": False}
    for kind, fn in (("swiglu", _gemv_swiglu_kernel), ("rms_norm", _gemv_rms_norm_kernel)):
        cfgs = {GemvConfig()}
        if not quick:
            for knd, _, k in FUSED_SHAPES.values():
                if knd == kind:
                    cfgs.update(fused_candidates(kind, k, tiny=False))
        n, k = next((n, k) for knd, n, k in FUSED_SHAPES.values() if knd == kind)
        for cfg in sorted(cfgs, key=str):
            if kind == "rms_norm":
                add(kind, fn, cfg, (n, k), HAS_RESIDUAL=True, **rne)
                add(kind, fn, cfg, (n, k), HAS_RESIDUAL=False, **rne)
            else:
                add(kind, fn, cfg, (n, k), **rne)
        extra = {"HAS_RESIDUAL": True} if kind == "rms_norm" else {}
        add(kind, fn, GemvConfig(), (n, k), HAS_BIAS=True, **extra, **rne)
        add(kind, fn, GemvConfig(), (n, k - 40), EVEN_K=False, **extra, **rne)
    # q/k/v with the q/k norm + rotary + KV store: N tiles of one head (BLOCK_N is HEAD_DIM)
    cfgs = {GemvConfig(block_n=128)}
    if not quick:
        cfgs.update(fused_candidates("qkv_rope", 1024, tiny=False))
    rope = {"HEAD_DIM": 128, "BLOCK_SIZE": 128, "HAS_RESIDUAL": True, "HAS_QK_NORM": True, **rne}
    for cfg in sorted(cfgs, key=str):
        add("qkv_rope", _gemv_rms_norm_qk_rope_kernel, cfg, (4096, 1024), **rope)
    first = {**rope, "HAS_RESIDUAL": False, "HAS_QK_NORM": False, "HAS_BIAS": True}
    add("qkv_rope", _gemv_rms_norm_qk_rope_kernel, GemvConfig(block_n=128), (4096, 1024), **first)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    return compile_all(jobs(args.quick), compile_one, args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
