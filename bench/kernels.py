"""Benchmark of the Triton attention kernels against torch SDPA, with correctness checks.

One command on a CUDA GPU (the lent H200) checks every kernel against the torch reference,
optionally sweeps tile configurations and split counts, and prints one table per section:

    python3 bench/kernels.py [--quick] [--sweep] [--only {all,prefill,decode,mixed}] [--out DIR]
                             [--block-size N]

* prefill TFLOP/s (causal and non-causal; Hq=16, Hkv=8, D=128, bf16; (batch, S) in (16, 1024),
  (4, 4096), (1, 16384)) for the paged kernel (``--block-size`` tokens per page, default the
  engine's: 128 on CUDA; random block table), next to
  ``torch.nn.functional.scaled_dot_product_attention`` on the same keys/values gathered into
  contiguous tensors (``enable_gqa=True``); FLOPs = 4 * B * S^2 * Hq * D, halved when causal;
* decode effective bandwidth (bytes of K and V read / time) at (batch, context) in (1, 4096),
  (64, 4096), (256, 1024), (32, 16384), the same pages, next to dense SDPA decode on contiguous
  KV; timed as CUDA-graph replays cycling over enough copies of the inputs to exceed the L2;
* mixed steps (``--only mixed``): one layer's attention of decode rows plus one prompt chunk, as
  the prefill kernel for every row against the split-KV decode kernel on the decode rows
  (``cu_seqlens_q``) plus the prefill kernel skipping them (``skip_decode_rows``), what
  ``engine/attention/triton_backend.py`` runs; CUDA-graph timed, with the max abs difference of
  the outputs;
* relative error ||out - ref|| / ||ref|| against an fp32 reference for each row (sampled query
  rows for prefill);
* peak extra memory of one prefill launch as S grows.

Kernels only; ``--quick`` runs a reduced version (also on the CPU under TRITON_INTERPRET=1, as a
smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.nn.functional as F
import triton

from bench.decode_configs import DECODE_CONFIGS
from engine.core.config import DEFAULT_CUDA_BLOCK_SIZE
from kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_config,
    decode_scratch,
)
from kernels.kv_cache import store_kv_cache
from kernels.prefill_attention import prefill_attention, prefill_config
from kernels.reference import decode_attention_ref, prefill_attention_ref, store_kv_cache_ref

HQ, HKV, D = 16, 8, 128
LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# ----------------------------------------------------------------------------- inputs
def paged_kv(lens, block_size, dtype, device, g, h_kv=HKV, d=D):
    """Random paged K/V for sequences of the given lengths and a random (shuffled) block table."""
    nblk = [triton.cdiv(n, block_size) for n in lens]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=device)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o : o + n]
        o += n
    k = torch.randn(num_blocks, block_size, h_kv, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(num_blocks, block_size, h_kv, d, device=device, dtype=dtype, generator=g)
    return k, v, bt


def gather_dense(k_cache, v_cache, bt, lens):
    """Contiguous [sum(lens), H_kv, D] K/V from the paged cache (the SDPA baselines' input)."""
    bs = k_cache.shape[1]
    ks, vs = [], []
    for b, n in enumerate(lens):
        blocks = bt[b, : triton.cdiv(n, bs)].long()
        ks.append(k_cache[blocks].flatten(0, 1)[:n])
        vs.append(v_cache[blocks].flatten(0, 1)[:n])
    return torch.cat(ks), torch.cat(vs)


# ----------------------------------------------------------------------------- timing
def bench_ms(fn, quick=False):
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=60 if quick else 150, return_mode="median")


def graph_ms(fns, reps=20):
    """Median time of one call, from CUDA-graph replays of ``fns`` (one call per input copy)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    for f in fns:  # compile / warm up outside the capture
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (4 * len(fns)))
    times.sort()
    return times[len(times) // 2]


# ----------------------------------------------------------------------------- correctness
def check_correctness(device, g) -> list[tuple[str, float, float]]:
    """Each kernel against the torch reference on fresh random inputs (NaN-poisoned outputs)."""
    rows = []
    for dtype, tol in (
        (torch.float32, 1e-5 if device.type == "cpu" else 2e-3),
        (torch.bfloat16, 1e-2),
    ):
        # store
        kc, vc, bt = paged_kv([70, 33], 16, dtype, device, g)
        key = torch.randn(40, HKV, D, device=device, dtype=dtype, generator=g)
        val = torch.randn(40, HKV, D, device=device, dtype=dtype, generator=g)
        slots = torch.randperm(kc.shape[0] * 16, device=device, generator=g)[:40]
        slots[::7] = -1
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        store_kv_cache_ref(key, val, k1, v1, slots)
        store_kv_cache(key, val, k2, v2, slots)
        ok = torch.equal(k1, k2) and torch.equal(v1, v2)
        rows.append((f"store {dtype}", 0.0 if ok else float("inf"), 0.0))
        # prefill over the paged cache with a cached prefix
        lens, qlens = [70, 33, 300, 17], [70, 15, 129, 1]
        kc, vc, bt = paged_kv(lens, 16, dtype, device, g)
        cu = torch.tensor(
            [0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=device
        )
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(sum(qlens), HQ, D, device=device, dtype=dtype, generator=g)
        for causal in (True, False):
            ref = torch.empty(q.shape, device=device)
            prefill_attention_ref(
                q.float(), kc.float(), vc.float(), bt, cu, sl, ref, D**-0.5, causal
            )
            out = torch.full_like(q, float("nan"))
            prefill_attention(q, kc, vc, bt, cu, sl, out, D**-0.5, causal)
            e = rel(out, ref) if torch.isfinite(out).all() else float("inf")
            rows.append((f"prefill paged {dtype} causal={causal}", e, tol))
        # decode with several split counts
        qd = torch.randn(len(lens), HQ, D, device=device, dtype=dtype, generator=g)
        ref = torch.empty(qd.shape, device=device)
        decode_attention_ref(qd.float(), kc.float(), vc.float(), bt, sl, ref, D**-0.5)
        for ns in (1, 3, 16):
            po, pl = decode_scratch(len(lens), HQ, D, ns, device)
            po.fill_(float("nan"))
            pl.fill_(float("nan"))
            out = torch.full_like(qd, float("nan"))
            decode_attention(qd, kc, vc, bt, sl, out, D**-0.5, po, pl, ns)
            e = rel(out, ref) if torch.isfinite(out).all() else float("inf")
            rows.append((f"decode {dtype} splits={ns}", e, tol))
    return rows


# ----------------------------------------------------------------------------- prefill
def prefill_inputs(batch, s, device, g, block_size):
    lens = [s] * batch
    kc, vc, bt = paged_kv(lens, block_size, torch.bfloat16, device, g)
    q = torch.randn(batch * s, HQ, D, device=device, dtype=torch.bfloat16, generator=g)
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * s
    sl = torch.full((batch,), s, device=device, dtype=torch.int32)
    kd, vd = gather_dense(kc, vc, bt, lens)
    return dict(q=q, kc=kc, vc=vc, bt=bt, cu=cu, sl=sl, kd=kd, vd=vd, batch=batch, s=s)


def prefill_fns(inp, causal, cfg_paged=None):
    q, out = inp["q"], torch.empty_like(inp["q"])
    b, s = inp["batch"], inp["s"]
    scale = D**-0.5

    def paged():
        prefill_attention(
            q,
            inp["kc"],
            inp["vc"],
            inp["bt"],
            inp["cu"],
            inp["sl"],
            out,
            scale,
            causal,
            config=cfg_paged,
        )
        return out

    qs = q.view(b, s, HQ, D).transpose(1, 2)
    ks = inp["kd"].view(b, s, HKV, D).transpose(1, 2)
    vs = inp["vd"].view(b, s, HKV, D).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True
        )

    return paged, sdpa


def prefill_reference_error(inp, causal, outs: dict, g, rows_per_seq=256):
    """Rel. error of each output on sampled query rows against an fp32 (no TF32) reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    b, s = inp["batch"], inp["s"]
    errs = {k: [0.0, 0.0] for k in outs}
    for seq in range(min(b, 4)):
        rows = torch.randperm(s, device=inp["q"].device, generator=g)[: rows_per_seq - 1]
        rows = torch.cat([rows, torch.tensor([s - 1], device=rows.device)])
        qf = inp["q"][seq * s + rows].float().transpose(0, 1)  # [Hq, R, D]
        kf = (
            inp["kd"][seq * s : (seq + 1) * s]
            .float()
            .repeat_interleave(HQ // HKV, 1)
            .transpose(0, 1)
        )
        vf = (
            inp["vd"][seq * s : (seq + 1) * s]
            .float()
            .repeat_interleave(HQ // HKV, 1)
            .transpose(0, 1)
        )
        sc = torch.matmul(qf, kf.transpose(1, 2)) * D**-0.5
        if causal:
            kpos = torch.arange(s, device=rows.device)
            sc = sc.masked_fill(kpos[None, None, :] > rows[None, :, None], float("-inf"))
        ref = torch.matmul(torch.softmax(sc, -1), vf).transpose(0, 1)  # [R, Hq, D]
        del sc
        for k, o in outs.items():
            if o.dim() == 4:  # sdpa [B, Hq, S, D]
                got = o[seq].transpose(0, 1)[rows]
            else:
                got = o[seq * s + rows]
            errs[k][0] += (got.float() - ref).pow(2).sum().item()
            errs[k][1] += ref.pow(2).sum().item()
    return {
        k: math.sqrt(a / bb) if torch.isfinite(torch.tensor(a)) else float("inf")
        for k, (a, bb) in errs.items()
    }


def _pc(bm, bn, w, st, **flags):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, **flags}


PREFILL_CONFIGS = [
    _pc(128, 128, 8, 3, BT_PREFETCH=False),
    _pc(128, 128, 8, 3, BT_PREFETCH=True),
    _pc(128, 64, 8, 3, BT_PREFETCH=True),
    _pc(128, 64, 8, 4, BT_PREFETCH=True),
    _pc(64, 64, 4, 3, BT_PREFETCH=True),
    _pc(128, 128, 8, 2, BT_PREFETCH=True),
]


def sweep_prefill(device, g, quick, block_size):
    """Best paged-kernel config per causal mode at (4, 4096); returns
    {("paged", causal): config}."""
    b, s = (1, 256) if quick else (4, 4096)
    inp = prefill_inputs(b, s, device, g, block_size)
    best = {}
    for causal in (True, False):
        flops = 4 * b * s * s * HQ * D * (0.5 if causal else 1.0)
        res = []
        for cfg in PREFILL_CONFIGS[:2] if quick else PREFILL_CONFIGS:
            try:
                paged, _ = prefill_fns(inp, causal, cfg)
                ms = bench_ms(paged, quick=True)
                res.append((flops / ms / 1e9, cfg))
                log(f"  sweep prefill paged causal={causal} {cfg}: {flops / ms / 1e9:.1f} TFLOP/s")
            except Exception as e:  # a config that fails to compile is skipped
                log(
                    f"  sweep prefill paged causal={causal} {cfg}: FAILED "
                    f"{type(e).__name__}: {str(e)[:200]}"
                )
        if res:
            best[("paged", causal)] = max(res, key=lambda r: r[0])[1]
    return best


def run_prefill(device, g, quick, best, block_size):
    shapes = [(2, 128), (1, 256)] if quick else [(16, 1024), (4, 4096), (1, 16384)]
    rows = []
    for b, s in shapes:
        inp = prefill_inputs(b, s, device, g, block_size)
        for causal in (True, False):
            paged, sdpa = prefill_fns(inp, causal, best.get(("paged", causal)))
            flops = 4 * b * s * s * HQ * D * (0.5 if causal else 1.0)
            outs = {"paged": paged().clone(), "sdpa": sdpa()}
            errs = prefill_reference_error(inp, causal, outs, g)
            t = {k: bench_ms(f, quick) for k, f in (("paged", paged), ("sdpa", sdpa))}
            tf = {k: flops / ms / 1e9 for k, ms in t.items()}
            rows.append(dict(batch=b, s=s, causal=causal, tflops=tf, ms=t, err=errs))
            log(
                f"  prefill B={b} S={s} causal={causal}: paged {tf['paged']:.1f} "
                f"sdpa {tf['sdpa']:.1f} TFLOP/s; "
                f"err paged {errs['paged']:.1e} sdpa {errs['sdpa']:.1e}"
            )
        del inp
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


# ----------------------------------------------------------------------------- decode


def decode_setup(b, ctx, device, g, block_size, min_bytes=256 << 20):
    kv_bytes = 2 * b * ctx * HKV * D * 2
    copies = max(1, min(32, triton.cdiv(min_bytes, kv_bytes))) if torch.cuda.is_available() else 1
    sets = []
    for _ in range(copies):
        kc, vc, bt = paged_kv([ctx] * b, block_size, torch.bfloat16, device, g)
        q = torch.randn(b, HQ, D, device=device, dtype=torch.bfloat16, generator=g)
        sl = torch.full((b,), ctx, device=device, dtype=torch.int32)
        sets.append(dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, out=torch.empty_like(q)))
    return sets, kv_bytes


def decode_fns(sets, num_splits, cfg):
    fns = []
    for st in sets:
        b = st["q"].shape[0]
        po, pl = decode_scratch(b, HQ, D, num_splits, st["q"].device)

        def f(st=st, po=po, pl=pl):
            decode_attention(
                st["q"],
                st["kc"],
                st["vc"],
                st["bt"],
                st["sl"],
                st["out"],
                D**-0.5,
                po,
                pl,
                num_splits,
                config=cfg,
            )

        fns.append(f)
    return fns


def dense_decode_sets(sets, ctx):
    dsets = []
    for st in sets:
        b = st["q"].shape[0]
        kd, vd = gather_dense(st["kc"], st["vc"], st["bt"], [ctx] * b)
        dsets.append(
            dict(
                q=st["q"].view(b, HQ, 1, D),
                k=kd.view(b, ctx, HKV, D).transpose(1, 2).contiguous(),
                v=vd.view(b, ctx, HKV, D).transpose(1, 2).contiguous(),
            )
        )
    return dsets


def sweep_decode(device, g, quick, num_sms, block_size):
    """Best stage-1 config over (64, 4096) unsplit and (1, 4096) split; returns the config."""
    shapes = [(2, 256)] if quick else [(64, 4096), (1, 4096)]
    scores = {}
    configs = DECODE_CONFIGS[:2] if quick else DECODE_CONFIGS
    for b, ctx in shapes:
        sets, kv_bytes = decode_setup(b, ctx, device, g, block_size)
        ns = choose_num_splits(b, HKV, ctx, num_sms)
        for i, cfg in enumerate(configs):
            try:
                ms = graph_ms(decode_fns(sets, ns, cfg))
                bw = kv_bytes / ms / 1e9  # bytes per ms / 1e9 = TB/s
                scores.setdefault(i, []).append(bw)
                log(f"  sweep decode B={b} ctx={ctx} splits={ns} {cfg}: {bw:.3f} TB/s")
            except Exception as e:
                scores.setdefault(i, []).append(0.0)
                log(f"  sweep decode {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
        del sets
    # geometric mean over the shapes
    best = max(scores, key=lambda i: math.prod(max(x, 1e-9) for x in scores[i]))
    return configs[best]


def run_decode(device, g, quick, num_sms, cfg, sweep_splits, block_size):
    shapes = [(1, 256), (4, 100)] if quick else [(1, 4096), (64, 4096), (256, 1024), (32, 16384)]
    rows = []
    for b, ctx in shapes:
        sets, kv_bytes = decode_setup(b, ctx, device, g, block_size)
        # correctness of this exact shape against the fp32 reference (first copy)
        st = sets[0]
        ref = torch.empty(st["q"].shape, device=device)
        decode_attention_ref(
            st["q"].float(), st["kc"].float(), st["vc"].float(), st["bt"], st["sl"], ref, D**-0.5
        )
        ns = choose_num_splits(b, HKV, ctx, num_sms)
        fns = decode_fns(sets, ns, cfg)
        st["out"].fill_(float("nan"))
        fns[0]()
        err = rel(st["out"], ref) if torch.isfinite(st["out"]).all() else float("inf")
        ms = graph_ms(fns)
        split_res = {ns: kv_bytes / ms / 1e9}  # TB/s
        if sweep_splits:
            for cand in (1, 2, 4, 8, 16, 32, 64):
                if cand != ns and cand * 16 <= ctx:
                    split_res[cand] = kv_bytes / graph_ms(decode_fns(sets, cand, cfg)) / 1e9
        eager = bench_ms(fns[0], quick)  # eager launch (no CUDA graph), L2 flushed by do_bench
        dsets = dense_decode_sets(sets, ctx)
        del sets
        sdpa_fns = [
            (
                lambda d=d: F.scaled_dot_product_attention(
                    d["q"], d["k"], d["v"], scale=D**-0.5, enable_gqa=True
                )
            )
            for d in dsets
        ]
        sdpa_out = sdpa_fns[0]().view(b, HQ, D)
        sdpa_err = rel(sdpa_out, ref)
        sdpa_ms = graph_ms(sdpa_fns)
        sdpa_eager = bench_ms(sdpa_fns[0], quick)
        bw, sbw = kv_bytes / ms / 1e9, kv_bytes / sdpa_ms / 1e9  # TB/s
        rows.append(
            dict(
                batch=b,
                ctx=ctx,
                splits=ns,
                tbps=bw,
                sdpa_tbps=sbw,
                us=ms * 1e3,
                sdpa_us=sdpa_ms * 1e3,
                err=err,
                sdpa_err=sdpa_err,
                split_sweep=split_res,
                eager_tbps=kv_bytes / eager / 1e9,
                sdpa_eager_tbps=kv_bytes / sdpa_eager / 1e9,
            )
        )
        log(
            f"  decode B={b} ctx={ctx} splits={ns}: {bw:.3f} TB/s ({ms * 1e3:.1f} us) "
            f"sdpa {sbw:.3f} TB/s "
            f"({sdpa_ms * 1e3:.1f} us) err {err:.1e} sdpa err {sdpa_err:.1e}; split sweep (TB/s) "
            + " ".join(f"{k}:{v:.2f}" for k, v in sorted(split_res.items()))
        )
        del dsets
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


# ----------------------------------------------------------------------------- mixed steps
# (decode rows, their context, prompt-chunk tokens): decodes of running requests plus one chunk of
# a new prompt (no cached prefix), in the scheduler's order (running requests first)
MIXED_SHAPES = [
    (64, 1100, 2048),
    (64, 1100, 1024),
    (256, 600, 512),
    (4, 1100, 2048),
    (0, 1100, 1024),
]
MIXED_SHAPES_QUICK = [(3, 40, 40), (0, 40, 24)]


def mixed_setup(n_dec, ctx, chunk, device, g, block_size, min_bytes=256 << 20):
    """Copies of one mixed step's attention inputs (enough to exceed the L2 on a GPU)."""
    lens, q_lens = [ctx + 1] * n_dec + [chunk], [1] * n_dec + [chunk]
    kv_bytes = 2 * sum(lens) * HKV * D * 2
    copies = max(1, min(32, triton.cdiv(min_bytes, kv_bytes))) if torch.cuda.is_available() else 1
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    sets = []
    for _ in range(copies):
        kc, vc, bt = paged_kv(lens, block_size, torch.bfloat16, device, g)
        q = torch.randn(sum(q_lens), HQ, D, device=device, dtype=torch.bfloat16, generator=g)
        sets.append(
            {"q": q, "kc": kc, "vc": vc, "bt": bt, "cu": cu, "sl": sl, "out": torch.empty_like(q)}
        )
    return sets, max(lens)


def mixed_fns(sets, num_splits):
    """(old, new) callables per input copy: the prefill kernel for every row, or the split-KV decode
    kernel on the decode rows plus the prefill kernel skipping them (the engine's mixed step)."""
    old, new = [], []
    for st in sets:
        b = st["sl"].shape[0]
        po, pl = decode_scratch(b, HQ, D, num_splits, st["q"].device)
        args = (st["q"], st["kc"], st["vc"], st["bt"])

        def f_old(st=st, args=args):
            prefill_attention(*args, st["cu"], st["sl"], st["out"], D**-0.5, True)
            return st["out"]

        def f_new(st=st, args=args, po=po, pl=pl):
            decode_attention(
                *args, st["sl"], st["out"], D**-0.5, po, pl, num_splits, cu_seqlens_q=st["cu"]
            )
            prefill_attention(
                *args, st["cu"], st["sl"], st["out"], D**-0.5, True, skip_decode_rows=True
            )
            return st["out"]

        old.append(f_old)
        new.append(f_new)
    return old, new


def run_mixed(device, g, quick, num_sms, block_size):
    """One layer's attention of a mixed step, timed both ways (CUDA-graph replays on a GPU)."""
    rows = []
    for n_dec, ctx, chunk in MIXED_SHAPES_QUICK if quick else MIXED_SHAPES:
        sets, max_len = mixed_setup(n_dec, ctx, chunk, device, g, block_size)
        ns = choose_num_splits(n_dec + 1, HKV, max_len, num_sms)
        old, new = mixed_fns(sets, ns)
        st = sets[0]
        st["out"].fill_(float("nan"))
        out_old = old[0]().clone()
        st["out"].fill_(float("nan"))
        out_new = new[0]().clone()
        diff = (out_old.float() - out_new.float()).abs().max().item()
        if not (torch.isfinite(out_old).all() and torch.isfinite(out_new).all()):
            diff = float("inf")
        ms_old, ms_new = graph_ms(old), graph_ms(new)
        rows.append(
            {
                "decode_rows": n_dec,
                "ctx": ctx,
                "chunk": chunk,
                "splits": ns,
                "ms_old": ms_old,
                "ms_new": ms_new,
                "max_abs_diff": diff,
            }
        )
        log(
            f"  mixed {n_dec} decode rows ctx {ctx} + {chunk}-token chunk (splits {ns}): "
            f"prefill only {ms_old:.3f} ms, decode + prefill {ms_new:.3f} ms "
            f"({ms_old / ms_new:.2f}x); max abs diff {diff:.1e}"
        )
        del sets, old, new
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


# ----------------------------------------------------------------------------- memory
def run_memory(device, g, quick, best, block_size):
    shapes = [256, 512] if quick else [1024, 4096, 16384, 65536]
    rows = []
    for s in shapes:
        inp = prefill_inputs(1, s, device, g, block_size)
        del inp["kd"], inp["vd"]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out = torch.empty_like(inp["q"])
        prefill_attention(
            inp["q"],
            inp["kc"],
            inp["vc"],
            inp["bt"],
            inp["cu"],
            inp["sl"],
            out,
            D**-0.5,
            True,
            config=best.get(("paged", True)),
        )
        extra = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
        rows.append(
            dict(
                s=s,
                extra_mib=extra / 2**20,
                out_mib=out.numel() * 2 / 2**20,
                scores_mib=HQ * s * s * 4 / 2**20,
            )
        )
        del inp, out
    return rows


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="small sizes (smoke test; CPU interpreter too)"
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="sweep tile configs and split counts first (of the sections --only times)",
    )
    ap.add_argument("--out", default=None, help="directory for bench.json and bench.log")
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=(
            "tokens per KV page of the timed paged caches (default: the engine's, "
            f"{DEFAULT_CUDA_BLOCK_SIZE} on CUDA and 16 on the CPU; the GPU tables before "
            "2026-12-05 used 16)"
        ),
    )
    ap.add_argument(
        "--only",
        choices=["all", "prefill", "decode", "mixed"],
        default="all",
        help=(
            "time only the prefill, the decode kernels or mixed steps "
            "(correctness checks always run)"
        ),
    )
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.block_size is None:
        args.block_size = DEFAULT_CUDA_BLOCK_SIZE if device.type == "cuda" else 16
    g = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        num_sms, gpu = props.multi_processor_count, props.name
    else:
        num_sms, gpu = 4, "cpu (TRITON_INTERPRET=1)"
    log(
        f"# {gpu}, {num_sms} SMs; torch {torch.__version__}, triton {triton.__version__}; "
        f"KV pages of {args.block_size} tokens"
    )
    t0 = time.time()
    result: dict = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "block_size": args.block_size,
    }
    failed = False

    log("## correctness (rel err vs fp32 torch reference, NaN-poisoned outputs)")
    for name, e, tol in check_correctness(device, g):
        bad = not (e <= tol)
        failed |= bad
        log(f"  {'FAIL' if bad else 'ok  '} {name}: {e:.2e} (tol {tol:.0e})")
    result["correct"] = not failed

    best: dict = {}
    dcfg = decode_config(D, torch.bfloat16, device)
    if args.sweep:  # the sections --only times
        log(f"## sweep ({time.time() - t0:.0f}s)")
        try:
            if args.only in ("all", "prefill"):
                best = sweep_prefill(device, g, args.quick, args.block_size)
        except Exception:
            log(traceback.format_exc())
        try:
            if args.only in ("all", "decode"):
                dcfg = sweep_decode(device, g, args.quick, num_sms, args.block_size)
        except Exception:
            log(traceback.format_exc())
    default_p = {"paged": prefill_config(D, torch.bfloat16, device, True)}
    log(
        f"## configs: prefill { ({str(k): v for k, v in best.items()} or default_p) }; "
        f"decode {dcfg}"
    )
    result["configs"] = {"prefill": {str(k): v for k, v in best.items()}, "decode": dcfg}

    pre, dec, mix, mem = [], [], [], []
    if args.only in ("all", "prefill"):
        log(f"## prefill ({time.time() - t0:.0f}s)")
        pre = run_prefill(device, g, args.quick, best, args.block_size)
    if args.only in ("all", "decode"):
        log(f"## decode ({time.time() - t0:.0f}s)")
        dec = run_decode(device, g, args.quick, num_sms, dcfg, args.sweep, args.block_size)
    if args.only in ("all", "mixed"):
        log(f"## mixed steps ({time.time() - t0:.0f}s)")
        mix = run_mixed(device, g, args.quick, num_sms, args.block_size)
    if args.only == "all":
        log(f"## memory ({time.time() - t0:.0f}s)")
        mem = run_memory(device, g, args.quick, best, args.block_size)
    result.update(prefill=pre, decode=dec, mixed=mix, memory=mem)

    for r in pre + dec:
        bad = not (r["err"]["paged"] <= 1e-2) if "tflops" in r else not (r["err"] <= 1e-2)
        failed |= bad
    for r in mix:  # the same rows from two kernels: bf16 rounding of differently ordered fp32 sums
        failed |= not (r["max_abs_diff"] <= 2e-2)

    lines = []
    lines.append(
        f"Kernels bench: {gpu}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
        f"Hq={HQ} Hkv={HKV} D={D}, KV pages of {args.block_size} tokens"
    )
    lines.append("")
    lines.append(
        "| prefill | B | S | Triton paged TFLOP/s | SDPA TFLOP/s | paged/SDPA "
        "| rel err paged / SDPA |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for r in pre:
        tf, e = r["tflops"], r["err"]
        lines.append(
            f"| {'causal' if r['causal'] else 'non-causal'} | {r['batch']} | {r['s']} "
            f"| {tf['paged']:.0f} | {tf['sdpa']:.0f} | {tf['paged'] / tf['sdpa']:.2f}x "
            f"| {e['paged']:.1e} / {e['sdpa']:.1e} |"
        )
    lines.append("")
    lines.append(
        "| decode (CUDA graph) | B | context | splits | Triton paged TB/s | us "
        "| SDPA dense TB/s | us | ratio | "
        "eager TB/s Triton / SDPA | rel err Triton / SDPA |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in dec:
        lines.append(
            f"| | {r['batch']} | {r['ctx']} | {r['splits']} | {r['tbps']:.2f} | {r['us']:.1f} "
            f"| {r['sdpa_tbps']:.2f} | {r['sdpa_us']:.1f} | {r['tbps'] / r['sdpa_tbps']:.2f}x "
            f"| {r['eager_tbps']:.2f} / {r['sdpa_eager_tbps']:.2f} | "
            f"{r['err']:.1e} / {r['sdpa_err']:.1e} |"
        )
    lines.append("")
    lines.append(
        "| mixed step, one layer (CUDA graph) | ms old: prefill kernel for all rows "
        "| ms new: decode kernel + "
        "prefill kernel skipping decode rows | ratio old/new | decode splits | max abs diff |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in mix:
        lines.append(
            f"| {r['decode_rows']} decode rows ctx {r['ctx']} + {r['chunk']}-token chunk "
            f"| {r['ms_old']:.3f} | {r['ms_new']:.3f} | {r['ms_old'] / r['ms_new']:.2f}x "
            f"| {r['splits']} | {r['max_abs_diff']:.1e} |"
        )
    lines.append("")
    lines.append(
        "| prefill memory (B=1, causal, paged) | S | peak extra MiB (incl. output) | output MiB "
        "| S^2 fp32 score matrix MiB |"
    )
    lines.append("|---|---|---|---|---|")
    for r in mem:
        lines.append(
            f"| | {r['s']} | {r['extra_mib']:.1f} | {r['out_mib']:.1f} | {r['scores_mib']:.0f} |"
        )
    lines.append("")
    lines.append(f"correctness: {'PASS' if not failed else 'FAIL'}; total {time.time() - t0:.0f}s")
    log("")
    for line in lines:
        log(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, "bench.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
