"""Offline compile check of the paged prefill kernel for the H200 (sm_90), without a GPU.

Compiles every tile configuration that ``bench/prefill_long.py --sweep`` may time (both lists of
``bench/prefill_configs.py``, single-pass and split-KV variants, with and without
``SKIP_DECODE``; GQA-packed candidates at G = 2 and 4, Qwen3-0.6B's and Qwen3-4B/8B's, where
``BLOCK_M // G`` allows packing) and the split merge kernel (per tokens-per-tile), with
``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, specialized as the JIT specializes a real launch (aligned
pointers, unit strides folded, strides divisible by 16); then runs ``ptxas -v`` on each PTX for
its registers and spills, and counts the loads pipelined through ``cp.async`` (0 means
``num_stages`` has no effect).
Fails (exit 1) on a compile error or a kernel whose shared memory exceeds the 227 KiB an sm_90
block may use (such a config would fail at launch). The Triton CPU interpreter misses such
errors, which is why this exists.

Usage: ``python3 bench/prefill_compile_check.py [--threads N] [--quick]`` (``--quick``: the
default configuration only). Must run without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("prefill_compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.prefill_configs import (  # noqa: E402
    SPLIT_CONFIGS,
    TMA_SPLIT_CONFIGS,
    TMA_UNSPLIT_CONFIGS,
    UNSPLIT_CONFIGS,
)
from kernels.prefill_attention import (  # noqa: E402
    MERGE_M,
    MERGE_WARPS,
    _prefill_kernel,
    _prefill_merge_kernel,
    prefill_tiling,
)

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one sm_90 block may use
BF16_PTRS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}
FP32_PTRS = {"po_ptr", "plse_ptr"}


#: integer arguments as a bf16 launch of Qwen3-0.6B's attention passes them (Hq=16, Hkv=8,
#: D=128, KV block 16; a block table 2048 blocks wide); None: not specialized by the JIT
#: (``do_not_specialize``) or a per-step value
INT_ARGS = {
    "stride_qt": 2048,
    "stride_qh": 128,
    "stride_qd": 1,
    "stride_ot": 2048,
    "stride_oh": 128,
    "stride_od": 1,
    "stride_kb": 16384,
    "stride_kt": 1024,
    "stride_kh": 128,
    "stride_kd": 1,
    "stride_vb": 16384,
    "stride_vt": 1024,
    "stride_vh": 128,
    "stride_vd": 1,
    "stride_bt": 2048,
    "stride_pot": 2048,
    "stride_poh": 128,
    "stride_plt": 16,
    "stride_plh": 1,
}


def specialize(fn, constexprs: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of ``fn`` as Triton's JIT specializes a real launch:
    pointers 16-byte aligned (torch allocations; without this no load is pipelined through
    ``cp.async``), integer arguments equal to 1 folded to constants, multiples of 16 marked
    divisible by 16, the rest (``do_not_specialize``, per-step values) plain int32."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("k_desc", "v_desc"):  # host descriptors (KV_TMA), else the caches again
            if constexprs.get("KV_TMA"):
                sig[name] = f"tensordesc<bf16[{constexprs['BLOCK_N']}, {constexprs['HEAD_DIM']}]>"
            else:
                sig[name] = "*bf16"
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name in BF16_PTRS else "*fp32" if name in FP32_PTRS else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            sig[name] = "fp32"
        elif INT_ARGS.get(name) == 1:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if INT_ARGS.get(name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def ptxas_usage(ptx: str) -> str:
    """``registers / spill bytes`` from ``ptxas -v`` (best effort: '' when ptxas is missing)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # a Triton without this helper: skip the register report
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [ptxas, "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"{regs.group(1) if regs else '?'} regs, {spill.group(1) if spill else '?'} B spill"


def compile_sm90(fn, sig: dict, consts: dict, attrs: dict, options: dict):
    """``triton.compile`` of ``fn`` for sm_90 (`TARGET`) as specialized; returns ``(kernel,
    None)``, or ``(None, "Type: message")`` (at most 300 characters of it) when it fails, so
    the compile checks report the failure as a job's error instead of raising. Shared with
    ``bench/gemv_compile_check.py`` and ``bench/decode_compile_check.py``."""
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=TARGET, options=options), None
    except Exception as e:  # reported, and the check fails
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def compile_one(job: tuple[str, object, dict, dict]) -> tuple[str, str | None, int, str]:
    name, fn, consts, options = job
    k, err = compile_sm90(fn, *specialize(fn, consts), options)
    if k is None:
        return name, err, 0, ""
    ttgir = k.asm.get("ttgir", "")
    usage = ptxas_usage(k.asm["ptx"])
    usage += f", {ttgir.count('async_copy_global_to_local')} async copies"
    return name, None, int(k.metadata.shared), usage


def jobs(quick: bool) -> list[tuple[str, object, dict, dict]]:
    out = []
    seen = set()
    lists = [(UNSPLIT_CONFIGS[:1] if quick else UNSPLIT_CONFIGS, False)]
    lists.append((SPLIT_CONFIGS[:1] if quick else SPLIT_CONFIGS, True))
    # the KV_TMA candidates, on 128-token pages (the engine's CUDA default)
    lists.append((TMA_UNSPLIT_CONFIGS[:1] if quick else TMA_UNSPLIT_CONFIGS, False))
    lists.append((TMA_SPLIT_CONFIGS[:1] if quick else TMA_SPLIT_CONFIGS, True))
    for configs, split in lists:
        for cfg in configs:
            # (G, packed): unpacked at Qwen3-0.6B's G = 2; packed candidates at G = 2 and 4
            groups = [(2, False)]
            if cfg.get("GQA_PACK"):
                groups = [(g, True) for g in (2, 4) if prefill_tiling(cfg, 8 * g, 8)[0]]
            for (num_groups, pack), skip in [(gp, sk) for gp in groups for sk in (False, True)]:
                tok = cfg["BLOCK_M"] // num_groups if pack else cfg["BLOCK_M"]
                consts = {
                    "NUM_GROUPS": num_groups,
                    "HEAD_DIM": 128,
                    "BLOCK_M": cfg["BLOCK_M"],
                    "BLOCK_N": cfg["BLOCK_N"],
                    "PAGE_SIZE": 128 if cfg.get("KV_TMA") else 16,
                    "CAUSAL": True,
                    "DOT_PREC": "tf32",
                    "UPCAST": False,
                    "BT_PREFETCH": cfg["BT_PREFETCH"],
                    "SKIP_DECODE": skip,
                    "SPLIT": split,
                    "GQA_PACK": pack,
                    "KV_TMA": bool(cfg.get("KV_TMA")),
                }
                opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                name = f"{'split' if split else 'single'} {cfg} G={num_groups} skip_decode={skip}"
                out.append((name, _prefill_kernel, consts, opts))
                if split and (tok, cfg["BLOCK_N"]) not in seen:
                    seen.add((tok, cfg["BLOCK_N"]))
                    consts = {
                        "HEAD_DIM": 128,
                        "TOK": tok,
                        "BLOCK_N": cfg["BLOCK_N"],
                        "MERGE_M": min(MERGE_M, tok),
                        "CAUSAL": True,
                        "SKIP_DECODE": True,
                    }
                    opts = {"num_warps": MERGE_WARPS, "num_stages": 1}
                    name = f"merge TOK={tok} BLOCK_N={cfg['BLOCK_N']}"
                    out.append((name, _prefill_merge_kernel, consts, opts))
    return out


def compile_all(todo: list, compile_one, threads: int) -> int:
    """Compile the jobs ``todo`` with ``compile_one`` (-> name, error or None, shared bytes,
    usage) in ``threads`` threads; prints a line per job (a failure, or more shared memory than
    the H200's, is FAIL) and the count; returns the exit code, 1 if any failed. Shared with
    ``bench/gemv_compile_check.py``."""
    t0 = time.time()
    bad = 0
    with ThreadPoolExecutor(max(1, threads)) as ex:
        for name, err, shared, usage in ex.map(compile_one, todo):
            if err is None and shared > SMEM_LIMIT:
                err = f"shared memory {shared} B > {SMEM_LIMIT} B"
            bad += err is not None
            status = f"FAIL {err}" if err else f"ok   smem {shared // 1024} KiB, {usage}"
            print(f"{status}: {name}", flush=True)
    print(f"{len(todo) - bad}/{len(todo)} compiled for sm_90 in {time.time() - t0:.0f}s")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    return compile_all(jobs(args.quick), compile_one, args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
