"""Design study for the prefill attention kernel on Hopper (issue 19 item 2, issue 20): which of
Triton 3.6's tools close the gap to SDPA, measured before any of them is built into
``kernels/prefill_attention.py``.

One causal attention problem (``B`` sequences of ``S`` tokens, Qwen3-0.6B's Hq=16 / Hkv=8 /
D=128, bf16, no cached prefix) computed by variants of one FlashAttention-2 kernel (Dao 2023;
the loop of Triton's fused-attention tutorial: unmasked tiles, then the masked diagonal) that
differ only in how K/V tiles reach shared memory and how the loop is scheduled:

- ``dense-ptr``: K/V contiguous ``[B*S, Hkv, D]``, pointer loads (cp.async, software pipeline);
- ``dense-tma``: the same through host tensor descriptors (TMA, ``cp.async.bulk.tensor``);
- ``paged-ptr``: the paged cache (``page`` tokens per block, shuffled block table), pointer
  gather as the installed kernel does;
- ``paged-tma``: the paged cache with ``page >= BLOCK_N``: one TMA box per K/V tile at row
  ``block * page + offset`` of the cache viewed as ``[blocks * page, Hkv * D]``;
- each with ``warp_specialize`` on the key loop (producer / consumer warp groups) or off.

References in the same run: ``F.scaled_dot_product_attention`` under each backend torch has here
(cuDNN, flash, efficient; "sdpa" = torch's own pick), and the installed paged kernel
(``kernels.prefill_attention``, page 16). Every variant is checked against the installed kernel's
output (relative error) before it is timed; a variant that fails to compile or is wrong prints
why and is not timed.

Usage (GPU)::

    python3 bench/prefill_variants.py [--shapes 1x16384 4x4096 1x32768] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.kernels import graph_ms  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402

HQ, HKV, D = 16, 8, 128
_LOG2E = 1.4426950408889634

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


@triton.jit
def _tile_kv(
    k_desc,
    v_desc,
    k_ptr,
    v_ptr,
    bt_ptr,
    start_n,
    row0,
    kv_head,
    stride_kt,
    stride_kh,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr,
):
    """K and V tiles ``[BLOCK_N, D]`` of keys ``start_n ..`` of the sequence whose first row is
    ``row0`` (dense modes) / whose block-table row is ``bt_ptr`` (paged modes)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MODE == 0:  # dense pointers
        rows = (row0 + start_n + offs_n).to(tl.int64)
        ptrs = rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    elif MODE == 1:  # dense TMA
        k = k_desc.load([row0 + start_n, kv_head * HEAD_DIM])
        v = v_desc.load([row0 + start_n, kv_head * HEAD_DIM])
    elif MODE == 2:  # paged pointers
        pos = start_n + offs_n
        blk = tl.load(bt_ptr + pos // PAGE).to(tl.int64)
        rows = blk * PAGE + pos % PAGE
        ptrs = rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    else:  # paged TMA, PAGE >= BLOCK_N
        blk = tl.load(bt_ptr + start_n // PAGE)
        row = blk * PAGE + start_n % PAGE
        k = k_desc.load([row, kv_head * HEAD_DIM])
        v = v_desc.load([row, kv_head * HEAD_DIM])
    return k, v


@triton.jit
def _attn_variant(
    q_ptr,
    out_ptr,
    k_desc,
    v_desc,
    k_ptr,
    v_ptr,
    bt_ptr,
    qk_scale,
    S,
    num_m,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    WS: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tile // num_m
    m_blk = num_m - 1 - tile % num_m  # heaviest tiles of each sequence first
    kv_head = head // NUM_GROUPS
    row0 = seq * S
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi_full = m_blk * BLOCK_M
    for start_n in tl.range(0, hi_full, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k, v = _tile_kv(
            k_desc,
            v_desc,
            k_ptr,
            v_ptr,
            bt_row,
            start_n,
            row0,
            kv_head,
            stride_kt,
            stride_kh,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            MODE,
        )
        qk = tl.dot(q, tl.trans(k))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + l_ij
        m_i = m_ij
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(hi_full, hi_full + BLOCK_M, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k, v = _tile_kv(
            k_desc,
            v_desc,
            k_ptr,
            v_ptr,
            bt_row,
            start_n,
            row0,
            kv_head,
            stride_kt,
            stride_kh,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            MODE,
        )
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + l_ij
        m_i = m_ij
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
    )


MODES = {"dense-ptr": 0, "dense-tma": 1, "paged-ptr": 2, "paged-tma": 3}


def make_inputs(b, s, page, g):
    """q, dense k/v, and the same k/v in a shuffled paged cache of ``page`` tokens per block."""
    dev = "cuda"
    q = torch.randn(b * s, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    kd = torch.randn(b * s, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(b * s, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    paged = {}
    for p in sorted(set([16, page])):
        nblk = s // p
        perm = torch.randperm(b * nblk, device=dev, generator=g)
        bt = perm.view(b, nblk).to(torch.int32).contiguous()
        kc = torch.empty(b * nblk, p, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        kc[perm] = kd.view(b * nblk, p, HKV, D)
        vc[perm] = vd.view(b * nblk, p, HKV, D)
        paged[p] = (kc, vc, bt)
    return q, kd, vd, paged


def variant_fn(mode, ws, cfg, b, s, page, q, kd, vd, paged, out):
    bm, bn, warps, stages = cfg
    num_m = s // bm
    mcode = MODES[mode]
    if mode.startswith("dense"):
        k2, v2 = kd.view(b * s, HKV * D), vd.view(b * s, HKV * D)
        bt = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
        pg = bn
    else:
        pg = page if mode == "paged-tma" else 16
        kc, vc, bt = paged[pg]
        k2, v2 = kc.view(-1, HKV * D), vc.view(-1, HKV * D)
    if mcode in (1, 3):
        kdesc = TensorDescriptor.from_tensor(k2, [bn, D])
        vdesc = TensorDescriptor.from_tensor(v2, [bn, D])
    else:
        kdesc = vdesc = k2  # unused placeholders
    grid = (HQ, b * num_m)

    def fn():
        _attn_variant[grid](
            q,
            out,
            kdesc,
            vdesc,
            k2,
            v2,
            bt,
            D**-0.5 * _LOG2E,
            s,
            num_m,
            bt.stride(0),
            q.stride(0),
            q.stride(1),
            HKV * D,
            D,
            NUM_GROUPS=HQ // HKV,
            HEAD_DIM=D,
            BLOCK_M=bm,
            BLOCK_N=bn,
            PAGE=pg,
            MODE=mcode,
            WS=ws,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    return fn


def installed_fn(b, s, q, paged, out):
    kc, vc, bt = paged[16]
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * s
    sl = torch.full((b,), s, device="cuda", dtype=torch.int32)

    def fn():
        return prefill_attention(q, kc, vc, bt, cu, sl, out, D**-0.5, True)

    return fn


def sdpa_fns(b, s, q, kd, vd):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs = q.view(b, s, HQ, D).transpose(1, 2)
    ks = kd.view(b, s, HKV, D).transpose(1, 2)
    vs = vd.view(b, s, HKV, D).transpose(1, 2)
    # flash / efficient want K/V heads repeated (no enable_gqa in every backend)
    kr = ks.repeat_interleave(HQ // HKV, dim=1)
    vr = vs.repeat_interleave(HQ // HKV, dim=1)

    def pick(backend, gqa):
        def fn():
            if backend is None:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            with sdpa_kernel([backend]):
                if gqa:
                    return F.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=True, enable_gqa=True
                    )
                return F.scaled_dot_product_attention(qs, kr, vr, is_causal=True)

        return fn

    return {
        "sdpa": pick(None, True),
        "sdpa-cudnn": pick(SDPBackend.CUDNN_ATTENTION, False),
        "sdpa-flash": pick(SDPBackend.FLASH_ATTENTION, False),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x16384", "4x4096", "1x32768"])
    ap.add_argument("--page", type=int, default=128, help="page size of the paged-tma variant")
    ap.add_argument("--quick", action="store_true", help="fewer tile configurations")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    t0 = time.time()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    configs = [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 128, 4, 2),
        (128, 64, 4, 4),
    ]
    if args.quick:
        configs = configs[:3]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        b, s = (int(x) for x in shape.split("x"))
        q, kd, vd, paged = make_inputs(b, s, args.page, g)
        flops = 4 * b * HQ * D * s * (s + 1) / 2
        ref_out = torch.empty_like(q)
        inst = installed_fn(b, s, q, paged, ref_out)
        inst()
        ref = ref_out.float()
        res = {}
        res["installed (paged 16)"] = graph_ms([inst])
        for name, fn in sdpa_fns(b, s, q, kd, vd).items():
            try:
                o = fn()
                err = (
                    (o.transpose(1, 2).reshape(b * s, HQ, D).float() - ref).norm() / ref.norm()
                ).item()
                res[name] = graph_ms([fn])
                print(
                    f"{shape} {name}: {res[name]:.3f} ms rel err vs installed {err:.2e}", flush=True
                )
            except Exception as e:  # noqa: BLE001
                print(
                    f"{shape} {name}: unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True
                )
        for mode in MODES:
            for ws in (False, True):
                for cfg in configs:
                    if time.time() - t0 > args.budget_s:
                        print("budget reached; skipping the rest")
                        break
                    if mode == "paged-tma" and cfg[1] > args.page:
                        continue
                    name = f"{mode}{' ws' if ws else ''} {cfg}"
                    out = torch.full_like(q, float("nan"))
                    try:
                        fn = variant_fn(mode, ws, cfg, b, s, args.page, q, kd, vd, paged, out)
                        fn()
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not math.isfinite(err) or err > 2e-2:
                            print(f"{shape} {name}: WRONG rel err {err:.2e}", flush=True)
                            continue
                        res[name] = graph_ms([fn])
                        print(f"{shape} {name}: {res[name]:.3f} ms err {err:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        msg = str(e).strip().splitlines()
                        print(
                            f"{shape} {name}: FAILED {type(e).__name__}: "
                            f"{msg[-1][:200] if msg else ''}",
                            flush=True,
                        )
                        if "--verbose" in sys.argv:
                            traceback.print_exc()
        base = res.get("sdpa")
        for name, ms in sorted(res.items(), key=lambda kv: kv[1]):
            tf = flops / ms / 1e9
            rows.append(
                dict(
                    shape=shape, name=name, ms=ms, tflops=tf, vs_sdpa=(base / ms) if base else None
                )
            )
        del q, kd, vd, paged
        torch.cuda.empty_cache()
    print("\n| shape | variant | ms | TFLOP/s | x SDPA |\n|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['vs_sdpa']:.2f}" if r["vs_sdpa"] else "-"
        print(f"| {r['shape']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {vs} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "prefill_variants.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
