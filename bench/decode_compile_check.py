"""Offline compile check of the split-KV paged decode kernel for the H200 (sm_90), without a GPU.

Compiles ``_decode_split_kernel`` and ``_decode_reduce_kernel`` (``kernels/decode_attention.py``)
with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, as the JIT specializes a bf16 launch
of Qwen3-0.6B's decode attention (16 query heads, 8 KV heads, head_dim 128; q a strided view
of the fused qkv projection), with PDL on (as launched on Hopper, ``kernels/pdl.py``), in every
variant the engine can launch:

* pure decode and the mixed step's rows (``VARLEN``), unsplit and split-KV, the split merge in
  a second launch or in stage 1's last-arriving program (``FUSED_REDUCE``);
* the q/k RMSNorm + rotary + k/v store in the prologue (``FUSED_QK``, with and without the norm;
  pure decode only);
* on 128-token pages (the CUDA default) and 16-token ones, with the default tiles and, without
  ``--quick``, every tile configuration ``bench/kernels.py --sweep`` may time (and G = 4, the
  Qwen3-8B grouping, for the default tiles).

Fails (exit 1) on a compile error, more shared memory than an sm_90 block may use, a memory
access before ``griddepcontrol.wait`` (:func:`bench.pdl_ptx.pdl_order_error`), or PTX without
the synchronisation a variant relies on (:func:`bench.decode_ptx.sync_error`): the fused merge's
acquire-release arrival at GPU scope after a CTA barrier, its counter reset and its L1-bypassing
loads of the partials; the prologue's CTA barrier between the k/v store and the loads. The
Triton CPU interpreter runs programs one after another and compiles nothing, so it misses all
of these, which is why this exists.

Usage: ``python3 bench/decode_compile_check.py [--threads N] [--quick]``. Must run without
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("decode_compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch  # noqa: E402
import triton  # noqa: E402

from bench.decode_configs import DECODE_CONFIGS  # noqa: E402
from bench.decode_ptx import sync_error  # noqa: E402
from bench.pdl_ptx import pdl_order_error  # noqa: E402
from bench.prefill_compile_check import compile_all, compile_sm90, ptxas_usage  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    _decode_reduce_kernel,
    _decode_split_kernel,
    decode_config,
)

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B
SPLITS = 32  # the scratch's split dimension (strides only; the split count is a runtime int)
FP32_PTRS = {"po_ptr", "plse_ptr"}
I32_PTRS = {"counter_ptr", "block_tables_ptr", "seq_lens_ptr", "cu_q_ptr"}
FLOATS = {"eps", "qk_scale"}

#: (label, constexpr flags) of every stage-1 variant the engine launches
VARIANTS = (
    ("decode", {}),
    ("decode split", {"SPLIT": True}),
    ("decode split fused-merge", {"SPLIT": True, "FUSED_REDUCE": True}),
    ("mixed", {"VARLEN": True}),
    ("mixed split", {"SPLIT": True, "VARLEN": True}),
    ("mixed split fused-merge", {"SPLIT": True, "VARLEN": True, "FUSED_REDUCE": True}),
    ("decode qk-rope", {"FUSED_QK": True, "HAS_NORM": True}),
    ("decode split qk-rope", {"SPLIT": True, "FUSED_QK": True, "HAS_NORM": True}),
    (
        "decode split fused-merge qk-rope",
        {"SPLIT": True, "FUSED_REDUCE": True, "FUSED_QK": True, "HAS_NORM": True},
    ),
    (
        "decode split fused-merge rope (no norm)",
        {"SPLIT": True, "FUSED_REDUCE": True, "FUSED_QK": True},
    ),
)


def int_args(page: int, groups: int) -> dict[str, int]:
    """Integer arguments of a launch (strides in elements): q rows of the qkv projection
    ``[B, (Hq + 2 Hkv) * D]``, a ``[blocks, page, Hkv, D]`` cache, a block table for 40,960
    tokens, the ``[B, Hq, SPLITS, D]`` scratch, the new k/v as views of the same projection and
    ``[B, D]`` rotary rows."""
    hq = HKV * groups
    row = (hq + 2 * HKV) * D
    return {
        "stride_nkt": row, "stride_nkh": D, "stride_nkd": 1,
        "stride_nvt": row, "stride_nvh": D, "stride_nvd": 1,
        "stride_cos_t": D, "stride_cos_d": 1, "stride_sin_t": D, "stride_sin_d": 1,
        "num_splits": SPLITS, "min_split_keys": 512,
        "stride_qb": row, "stride_qh": D, "stride_qd": 1,
        "stride_ob": hq * D, "stride_oh": D, "stride_od": 1,
        "stride_kb": page * HKV * D, "stride_kt": HKV * D, "stride_kh": D, "stride_kd": 1,
        "stride_vb": page * HKV * D, "stride_vt": HKV * D, "stride_vh": D, "stride_vd": 1,
        "stride_bt": 40960 // page,
        "stride_pob": hq * SPLITS * D, "stride_poh": SPLITS * D, "stride_pos": D,
        "stride_plb": hq * SPLITS, "stride_plh": SPLITS,
    }  # fmt: skip


def specialize(fn, constexprs: dict, ints: dict[str, int]) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` as Triton's JIT specializes the launch: pointers
    16-byte aligned, integers equal to 1 folded to constants (except ``do_not_specialize``
    ones), multiples of 16 marked divisible by 16. Without ``FUSED_QK`` the prologue's
    pointers are q's (``kernels.decode_attention._qk_rope_args``' placeholders); with it the
    slot mapping is int64."""
    fused_qk = constexprs.get("FUSED_QK", False)
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in FP32_PTRS:
                sig[name] = "*fp32"
            elif name in I32_PTRS:
                sig[name] = "*i32"
            elif name == "slot_ptr" and fused_qk:
                sig[name] = "*i64"
            else:
                sig[name] = "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        elif ints[name] == 1 and name not in fn.do_not_specialize:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_one(job) -> tuple[str, str | None, int, str]:
    """Compile one job of `jobs` for sm_90 and check its PTX.

    Returns ``(name, error or None, shared memory in bytes, ptxas register/spill line)``;
    a compile exception is returned as the error, not raised.
    """
    name, fn, consts, opts, ints = job
    kern, err = compile_sm90(fn, *specialize(fn, consts, ints), opts)
    if kern is None:
        return name, err, 0, ""
    ptx = kern.asm["ptx"]
    err = pdl_order_error(ptx, bool(consts.get("PDL")))
    if err is None and fn is _decode_split_kernel:
        err = sync_error(ptx, consts)
    return name, err, int(kern.metadata.shared), ptxas_usage(ptx)


def jobs(quick: bool) -> list:
    """The compile jobs: ``(name, kernel, constexprs, options, integer arguments)``."""
    default = decode_config(D, torch.bfloat16, torch.device("cuda"))
    configs = [default] if quick else [default] + [c for c in DECODE_CONFIGS if c != default]
    layouts = [(128, 2)] if quick else [(128, 2), (16, 2), (128, 4)]
    out = []
    for page, groups in layouts:
        ints = int_args(page, groups)
        for cfg in configs if groups == 2 else [default]:
            for label, flags in VARIANTS:
                consts = {
                    "NUM_GROUPS": groups,
                    "BLOCK_G": max(16, triton.next_power_of_2(groups)),
                    "HEAD_DIM": D,
                    "BLOCK_N": cfg["BLOCK_N"],
                    "PAGE_SIZE": page,
                    "SPLIT": False,
                    "DOT_PREC": "tf32",
                    "UPCAST": False,
                    "BT_PREFETCH": bool(cfg.get("BT_PREFETCH", False)),
                    "VARLEN": False,
                    "FUSED_REDUCE": False,
                    "BLOCK_S": 32,
                    "FUSED_QK": False,
                    "HAS_NORM": False,
                    "EXACT_ROPE": False,  # (as on the GPU: integer roundings interpreter-only)
                    "PDL": True,
                    **flags,
                }
                opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                name = f"{label} page={page} G={groups} {cfg}"
                out.append((name, _decode_split_kernel, consts, opts, ints))
    for varlen in (False, True):
        consts = {"HEAD_DIM": D, "BLOCK_S": 32, "VARLEN": varlen, "PDL": True}
        name = f"reduce{' varlen' if varlen else ''}"
        out.append((name, _decode_reduce_kernel, consts, {"num_warps": 4}, int_args(128, 2)))
    return out


def main() -> int:
    """Compile every job (``--quick``: the default tiles on 128-token pages); exit status 1 on
    any failure."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    return compile_all(jobs(args.quick), compile_one, args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
