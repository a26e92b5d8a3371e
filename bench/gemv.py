"""The small-M bf16 linear kernel (``kernels/gemv.py``) against cuBLAS (``F.linear``) at decode
shapes, with a tile sweep that writes the per-device table the kernel reads; ``--fused``: the
fused variants (``kernels/gemv_fused.py``) against the unfused pairs they replace.

Usage (on the GPU): ``python bench/gemv.py [--sweep] [--fused] [--write-table] [--out DIR]``;
on the CPU, to check the script's logic under the Triton interpreter: ``python bench/gemv.py
--tiny [--fused]`` (tiny shapes, two tile configurations, host-clock timings; writes to
``--out`` only).

Shapes: Qwen3-0.6B's projections (qkv 1024->4096, o 2048->1024, gate_up 1024->6144, down
3072->1024) and Qwen3-8B's, at M = 1, 16 and 64 (``--ms``); ``--fused``: qkv and gate_up with
the residual add + RMSNorm before them, down with SwiGLU, o with split-KV decode attention's merge
(``kernels/gemv_merge.py``; unfused: the decode kernel's reduce launch, then the product).
Each timing is the median of CUDA-graph replays over enough weight copies (>= 256 MB) that no
weight is still in the 50 MB L2 from the last call, as in a real step where every layer reads
its own weights. Every configuration's result is checked
against a float32 reference before it is timed (relative error at most twice the cuBLAS /
unfused path's plus 1e-3, and for the norm the new residual bit for bit); one that fails to
compile or is wrong is never chosen.

Tables: the plain sweep (``--write-table``) stores ``kernels/configs/gemv_<device>.json``: the
best configuration per shape and M bucket, ``cublas_faster`` where cuBLAS won. ``--fused``
stores ``gemv_fused_<device>.json``: per ``"<kind>:<N>,<K>"`` and M bucket the best fused
configuration and ``fused_faster``, true only where the fused kernel beat the unfused pair --
the elementwise op compiled by Inductor (as the compiled model runs it) followed by today's
product (the plain table's choice, kernel or cuBLAS); a row whose verdict came from a
decode-step A/B (``decode_step_ab``) keeps it (:func:`keep_step_verdicts`). Both tables also land
in ``--out``.
``--fused`` sweeps 8 configurations per kind, compiled first in ``--compile-workers`` spawned
processes (filling Triton's disk cache), and stops timing new ones after ``--budget-s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # before Triton is imported: the kernels run in the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.gemv_configs import (  # noqa: E402
    FUSED_SHAPES,
    QKV_ROPE_HEAD_DIM,
    QKV_ROPE_KV_HEADS,
    SHAPES,
    TINY_FUSED_SHAPES,
    TINY_SHAPES,
    candidates,
    fused_candidates,
)
from bench.kernels import graph_ms  # noqa: E402
from engine.layers.activation import silu_and_mul  # noqa: E402
from engine.layers.dense_linear import _small_m_product  # noqa: E402
from engine.layers.norm import add_rms_norm  # noqa: E402
from kernels.configs import current_table, device_name, table_path  # noqa: E402
from kernels.decode_attention import choose_num_splits, merge_splits  # noqa: E402
from kernels.gemv import GEMV_WIDE_MAX_M, GemvConfig, gemv, m_bucket  # noqa: E402
from kernels.gemv_fused import fused_gemv_config, gemv_rms_norm, gemv_swiglu  # noqa: E402
from kernels.gemv_merge import gemv_attn_merge  # noqa: E402
from kernels.gemv_qk_rope import gemv_rms_norm_qk_rope  # noqa: E402
from kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from kernels.reference import qk_norm_rope_store_ref  # noqa: E402

EPS = 1e-6


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def accurate(err: float, baseline_err: float) -> bool:
    """The sweep's correctness bound: at most twice the baseline's error plus 1e-3."""
    return err <= 2 * baseline_err + 1e-3


def weight_copies(n: int, k: int, dev, g, tiny: bool) -> list[torch.Tensor]:
    """``[N, K]`` bf16 weights, enough identical copies (>= 256 MB) that none is in L2."""
    copies = 2 if tiny else max(2, (256 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02]
    return ws + [torch.empty_like(ws[0]).copy_(ws[0]) for _ in range(copies - 1)]


def sweep_plain(args, dev, g) -> tuple[dict, list[dict]]:
    """The kernel's best configuration per shape and M against cuBLAS."""
    table: dict = {}
    rows = []
    shapes = TINY_SHAPES if args.tiny else SHAPES
    for name in args.shapes or [s for s in shapes if s.startswith(("0.6B", "tiny"))]:
        n, k = shapes[name]
        ws = weight_copies(n, k, dev, g, args.tiny)
        for m in args.ms:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            cublas_ms = graph_ms([lambda w=w, x=x: F.linear(x, w) for w in ws])
            cublas_err = rel(F.linear(x, ws[0]), ref)
            best = None
            for cfg in candidates(n, k, args.sweep, args.tiny, m):
                try:
                    err = rel(gemv(x, ws[0], None, cfg), ref)
                    if not accurate(err, cublas_err):
                        print(f"{name} M={m} {cfg}: wrong (rel err {err:.1e}), skipped", flush=True)
                        continue
                    ms = graph_ms([lambda w=w, c=cfg, x=x: gemv(x, w, None, c) for w in ws])
                except Exception as e:  # a tile the compiler refuses (shared memory, ...)
                    print(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg, err)
            if best is None:
                print(
                    f"{name} M={m}: no configuration compiled and passed; cuBLAS kept", flush=True
                )
                table.setdefault(f"{n},{k}", {})[m_bucket(m)] = {"cublas_faster": True}
                continue
            ms, cfg, err = best
            gb = n * k * 2 / 1e9
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "gemv_us": 1e3 * ms,
                "cublas_us": 1e3 * cublas_ms,
                "gemv_tb_s": gb / ms,
                "cublas_tb_s": gb / cublas_ms,
                "gemv_rel_err": err,
                "cublas_rel_err": cublas_err,
                "config": cfg.__dict__,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            table.setdefault(f"{n},{k}", {})[m_bucket(m)] = {
                **cfg.__dict__,
                "cublas_faster": cublas_ms < ms,  # every timed configuration was accurate
                "gemv_us": round(1e3 * ms, 2),
                "cublas_us": round(1e3 * cublas_ms, 2),
            }
        del ws
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "\n| shape | M | gemv us | cuBLAS us | gemv / cuBLAS time | gemv TB/s | cuBLAS TB/s "
        "| rel err gemv / cuBLAS | config (block_n, block_k, split, warps, stages) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["config"]
        print(
            f"| {r['shape']} {r['k']}->{r['n']} | {r['m']} | {r['gemv_us']:.2f} "
            f"| {r['cublas_us']:.2f} | {r['gemv_us'] / r['cublas_us']:.2f} "
            f"| {r['gemv_tb_s']:.2f} | {r['cublas_tb_s']:.2f} "
            f"| {r['gemv_rel_err']:.1e} / {r['cublas_rel_err']:.1e} "
            f"| {c['block_n']}, {c['block_k']}, {c['split_k']}, {c['num_warps']}, "
            f"{c['num_stages']} |"
        )
    return table, rows


def merge_case(m: int, k: int, dev, g, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode partials of ``m`` sequences for a K = heads x 128 output projection (64
    under ``--tiny``): the engine's split count for Qwen3-0.6B's 8 KV heads on this GPU
    (``TritonAttentionBackend.partial_splits``), every split holding keys -- a long context,
    the fused kernel's worst case (it skips an empty split's partial; a short context leaves
    the later splits empty)."""
    d = 64 if tiny else 128
    sms = 4 if tiny else torch.cuda.get_device_properties(dev).multi_processor_count
    s = choose_num_splits(m, 8, 1 << 30, sms)
    po = torch.randn(m, k // d, s, d, device=dev, generator=g)
    lse = torch.randn(m, k // d, s, device=dev, generator=g) * 4
    return po, lse


class QKRopeCase:
    """A decode step's q/k/v inputs for ``m`` tokens of the ``qkv_rope`` fusion (head size 128,
    8 KV heads; 16 and 1 under ``--tiny``): the layer input, residual and norm weights, q/k
    norm weights, rotary rows of random positions, a paged cache of 16-token blocks and
    distinct slots."""

    def __init__(self, m: int, n: int, k: int, dev, g, tiny: bool):
        bf = torch.bfloat16
        self.d = d = 16 if tiny else QKV_ROPE_HEAD_DIM
        self.hkv = 1 if tiny else QKV_ROPE_KV_HEADS
        self.hq = n // d - 2 * self.hkv
        self.x = torch.randn(m, k, device=dev, generator=g, dtype=bf)
        self.res = torch.randn(m, k, device=dev, generator=g, dtype=bf)
        self.nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(bf)
        self.qk_w = [(1 + 0.2 * torch.randn(d, device=dev, generator=g)).to(bf) for _ in "qk"]
        pos = torch.randint(0, 8192, (m, 1), device=dev, generator=g).float()
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
        ang = torch.cat([pos * inv] * 2, dim=1)
        self.cos, self.sin = ang.cos().to(bf), ang.sin().to(bf)
        self.cache = [torch.zeros(m, 16, self.hkv, d, device=dev, dtype=bf) for _ in "kv"]
        self.slots = torch.arange(m, device=dev) * 16 + 3

    def q_ref(self, w: torch.Tensor) -> torch.Tensor:
        """float32 rotated q ``[M, Hq * D]`` (torch's RMSNorm, product, the torch q/k norm +
        rotary reference)."""
        h = self.x.float() + self.res.float()
        y = F.rms_norm(h, (h.shape[1],), self.nw.float(), EPS) @ w.float().T
        return self._rope(y, self.cos.float(), self.sin.float(), [t.float() for t in self.qk_w],
                          [c.float() for c in self.cache])  # fmt: skip

    def _rope(self, y, cos, sin, qk_w, cache):
        m, d = y.shape[0], self.d
        q, k, v = y.split([self.hq * d, self.hkv * d, self.hkv * d], dim=1)
        view = (m, -1, d)
        args = (*cache, self.slots, cos, sin, *qk_w, EPS)
        return qk_norm_rope_store_ref(q.view(view), k.view(view), v.view(view), *args).view(m, -1)

    def unfused(self, w: torch.Tensor, tiles: GemvConfig | None, norm) -> torch.Tensor:
        """Today's pair: the norm GEMV where its table entry won (``tiles``), else the compiled
        norm (``norm``) then today's product, as the model dispatches; then the q/k norm +
        rotary + store launch. Returns the rotated q ``[M, Hq * D]``."""
        m, d = self.x.shape[0], self.d
        if tiles is not None:
            y, _ = gemv_rms_norm(self.x, self.nw, EPS, w, None, self.res, tiles)
        else:
            y = _small_m_product(norm(self.x, self.res, self.nw, EPS)[0], w, None)
        q, k, v = y.split([self.hq * d, self.hkv * d, self.hkv * d], dim=1)
        view = (m, -1, d)
        args = (*self.cache, self.slots, self.cos, self.sin, *self.qk_w, EPS)
        return qk_norm_rope_store(q.view(view), k.view(view), v.view(view), *args).view(m, -1)

    def fused(self, w: torch.Tensor, cfg: GemvConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused launch: ``(rotated q [M, Hq * D], new residual)``."""
        y, new_res = gemv_rms_norm_qk_rope(
            self.x, self.nw, EPS, w, None, self.res, self.hq, self.hkv, *self.cache, self.slots,
            self.cos, self.sin, *self.qk_w, EPS, cfg,
        )  # fmt: skip
        return y[:, : self.hq * self.d], new_res


def fused_case(kind: str, m: int, n: int, k: int, dev, g, tiny: bool):
    """``(float32 reference (w -> [M, N']), unfused pair (w -> [M, N']), fused call ((w, cfg)
    -> ([M, N'], new residual or None)), expected new residual or None)`` for one kind: the
    unfused pair is the elementwise op (Inductor-compiled on the GPU, as the compiled model
    runs it; eager under ``--tiny``) then today's product, except for ``qkv_rope``, whose pair
    is today's norm GEMV then the q/k norm + rotary + store launch (N': the rotated q's
    columns there, else N)."""
    if kind == "qkv_rope":
        c = QKRopeCase(m, n, k, dev, g, tiny)
        tiles = fused_gemv_config("rms_norm", m, n, k, dev)
        norm = add_rms_norm if tiny else torch.compile(add_rms_norm, dynamic=False)
        return c.q_ref, lambda w: c.unfused(w, tiles, norm), c.fused, c.res + c.x
    if kind == "rms_norm":
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        res = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(torch.bfloat16)
        act32 = F.rms_norm(x.float() + res.float(), (k,), nw.float(), EPS)
        norm = add_rms_norm if tiny else torch.compile(add_rms_norm, dynamic=False)
        unfused_act = lambda: norm(x, res, nw, EPS)[0]  # noqa: E731
        fused = lambda w, c: gemv_rms_norm(x, nw, EPS, w, None, res, c)  # noqa: E731
        want_res = res + x
    elif kind == "attn_merge":
        po, lse = merge_case(m, k, dev, g, tiny)
        w8 = torch.exp2(lse - lse.amax(2, keepdim=True))
        act32 = ((po * w8[..., None]).sum(2) / w8.sum(2)[..., None]).reshape(m, k)
        heads, d = po.shape[1], po.shape[3]
        out = torch.empty(m, heads, d, device=dev, dtype=torch.bfloat16)
        unfused_act = lambda: merge_splits(po, lse, out).view(m, k)  # noqa: E731
        fused = lambda w, c: (gemv_attn_merge(po, lse, w, None, c), None)  # noqa: E731
        want_res = None
    else:
        gate_up = torch.randn(m, 2 * k, device=dev, generator=g, dtype=torch.bfloat16) * 2
        act32 = F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
        swiglu = silu_and_mul if tiny else torch.compile(silu_and_mul, dynamic=False)
        unfused_act = lambda: swiglu(gate_up)  # noqa: E731
        fused = lambda w, c: (gemv_swiglu(gate_up, w, None, c), None)  # noqa: E731
        want_res = None
    ref = lambda w: act32 @ w.float().T  # noqa: E731
    return ref, lambda w: _small_m_product(unfused_act(), w, None), fused, want_res


def _warm_one(job: tuple) -> tuple[tuple, str | None]:
    """Compile one fused configuration by launching it on the timed shape (so the JIT
    specializes as in the timing process; Triton's on-disk cache is shared)."""
    kind, m, n, k, fields, tiny = job
    if tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    dev = torch.device("cpu" if tiny else "cuda")
    cfg = GemvConfig(*fields)
    w = torch.zeros(n, k, device=dev, dtype=torch.bfloat16)
    try:
        if kind == "rms_norm":
            x = torch.zeros(m, k, device=dev, dtype=torch.bfloat16)
            gemv_rms_norm(x, x[0], EPS, w, None, x.clone(), cfg)
        elif kind == "attn_merge":
            gemv_attn_merge(*merge_case(m, k, dev, torch.Generator(device=dev), tiny), w, None, cfg)
        elif kind == "qkv_rope":
            QKRopeCase(m, n, k, dev, torch.Generator(device=dev), tiny).fused(w, cfg)
        else:
            gemv_swiglu(torch.zeros(m, 2 * k, device=dev, dtype=torch.bfloat16), w, None, cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return job, None
    except Exception as e:  # a tile the compiler refuses: reported again when timed
        return job, f"{type(e).__name__}: {str(e)[:120]}"


def warm_compile(jobs: list[tuple], workers: int, budget_s: float) -> None:
    """Compile ``jobs`` in ``workers`` spawned processes for at most ``budget_s`` seconds, so the
    timing process loads the kernels from Triton's cache instead of compiling them one by one;
    whatever is not reached compiles when first timed."""
    if workers < 1 or not jobs:
        return
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(min(workers, len(jobs)))
    done = 0
    try:
        it = pool.imap_unordered(_warm_one, jobs)
        for _ in jobs:
            left = budget_s - (time.perf_counter() - t0)
            try:
                job, err = it.next(timeout=max(0.0, left))
            except multiprocessing.TimeoutError:
                print(f"compile budget spent: {len(jobs) - done} of {len(jobs)} not compiled")
                break
            done += 1
            if err:
                print(f"compile of {job[:4]} {GemvConfig(*job[4])} failed: {err}", flush=True)
    finally:
        pool.terminate()
        pool.join()
    print(f"compiled {done} fused configurations in {time.perf_counter() - t0:.0f} s", flush=True)


def sweep_fused(args, dev, g) -> tuple[dict, list[dict]]:
    """Each fused kernel's best configuration per shape and M against the unfused pair."""
    t0 = time.perf_counter()
    table: dict = {}
    rows = []
    shapes = TINY_FUSED_SHAPES if args.tiny else FUSED_SHAPES
    names = args.fused_shapes or [s for s in shapes if s.startswith(("0.6B", "tiny"))]
    jobs = {
        (kind, m, n, k, tuple(c.__dict__.values()), args.tiny)
        for kind, n, k in (shapes[name] for name in names)
        for m in (1, 16)
        for c in fused_candidates(kind, k, args.tiny)
    }
    warm_compile(sorted(jobs), args.compile_workers, args.compile_budget_s)
    for name in names:
        kind, n, k = shapes[name]
        ws = weight_copies(n, k, dev, g, args.tiny)
        for m in (1, 16):
            ref_of, unfused, fused, want_res = fused_case(kind, m, n, k, dev, g, args.tiny)
            ref = ref_of(ws[0])
            unfused_err = rel(unfused(ws[0]), ref)
            unfused_ms = graph_ms([lambda w=w, f=unfused: f(w) for w in ws])
            best = None
            for i, cfg in enumerate(fused_candidates(kind, k, args.tiny)):
                if i and time.perf_counter() - t0 > args.budget_s:
                    print(f"{name} M={m}: time budget reached, {cfg} and later not timed")
                    break
                try:
                    y, new_res = fused(ws[0], cfg)
                    err = rel(y, ref)
                    res_ok = want_res is None or torch.equal(new_res, want_res)
                    if not (accurate(err, unfused_err) and res_ok):
                        print(
                            f"{name} M={m} {cfg}: wrong (rel err {err:.1e}, residual "
                            f"{'ok' if res_ok else 'WRONG'}), skipped",
                            flush=True,
                        )
                        continue
                    ms = graph_ms([lambda w=w, c=cfg, f=fused: f(w, c) for w in ws])
                except Exception as e:  # a tile the compiler refuses
                    print(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg, err)
            key = f"{kind}:{n},{k}"
            if best is None:
                print(f"{name} M={m}: no configuration compiled and passed; unfused kept")
                table.setdefault(key, {})[f"m{m}"] = {"fused_faster": False}
                continue
            ms, cfg, err = best
            row = {
                "shape": name,
                "kind": kind,
                "n": n,
                "k": k,
                "m": m,
                "fused_us": 1e3 * ms,
                "unfused_us": 1e3 * unfused_ms,
                "fused_rel_err": err,
                "unfused_rel_err": unfused_err,
                "config": cfg.__dict__,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            table.setdefault(key, {})[f"m{m}"] = {
                **cfg.__dict__,
                "fused_faster": ms < unfused_ms,
                "fused_us": round(1e3 * ms, 2),
                "unfused_us": round(1e3 * unfused_ms, 2),
            }
        del ws
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "\n| shape | M | fused us | unfused us (op + product) | fused / unfused | "
        "rel err fused / unfused | config (block_n, block_k, split, warps, stages) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["config"]
        print(
            f"| {r['shape']} {r['k']}->{r['n']} | {r['m']} | {r['fused_us']:.2f} "
            f"| {r['unfused_us']:.2f} | {r['fused_us'] / r['unfused_us']:.2f} "
            f"| {r['fused_rel_err']:.1e} / {r['unfused_rel_err']:.1e} "
            f"| {c['block_n']}, {c['block_k']}, {c['split_k']}, {c['num_warps']}, "
            f"{c['num_stages']} |"
        )
    print(f"fused sweep: {time.perf_counter() - t0:.0f} s")
    return table, rows


#: a fused-table row's key recording an end-to-end decode-step A/B (bench/decode_profile.py)
STEP_VERDICT = "decode_step_ab"


def keep_step_verdicts(table: dict, current: dict) -> list[str]:
    """Carry each ``current`` fused-table row's end-to-end verdict (``STEP_VERDICT``) into the
    newly swept ``table`` (in place), so a kernel-only re-sweep does not undo what a decode-step
    A/B decided: the kernel timing can favour a fusion that makes the step slower (the batch-1
    q/k/v + rotary fusion on the H200: faster alone, 1 % slower in the step). A "not fused"
    verdict is always kept; a "fused" one only where the sweep found tiles that passed (a row
    the sweep rejected stays off). ``current`` must be this device's own table, not one it
    borrows from its architecture (the A/B ran on another GPU). Returns one line per kept
    verdict."""
    notes = []
    for key, rows in table.items():
        for bucket, row in rows.items():
            old = current.get(key, {}).get(bucket, {})
            if STEP_VERDICT not in old:
                continue
            faster = bool(old.get("fused_faster", False))
            if faster and GemvConfig.from_row(row) is None:
                continue  # the sweep found no tiles that passed: no fusion to keep on
            row[STEP_VERDICT] = old[STEP_VERDICT]
            row["fused_faster"] = faster
            notes.append(f"{key} {bucket}: fused_faster {faster} kept from the decode-step A/B")
    return notes


def merge_partial(current: dict, swept: dict) -> dict:
    """A partial sweep's table: ``current`` (``{"<key>": {"<bucket>": row}}``) with each row
    ``swept`` timed replacing its own (key, bucket) only; neither argument is modified."""
    merged = {key: {**current.get(key, {}), **rows} for key, rows in swept.items()}
    return {**current, **merged}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="all plain tile configurations")
    ap.add_argument("--fused", action="store_true", help="the fused kernels (their own table)")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--shapes", nargs="*", help=f"plain shapes, of {list(SHAPES)}")
    ap.add_argument(
        "--ms", nargs="+", type=int, default=[1, 16, 64],
        help="plain sweep: the row counts timed, one per table row (m1, m16: 2-16, m64: 17-64)",
    )  # fmt: skip
    ap.add_argument("--fused-shapes", nargs="*", help=f"of {list(FUSED_SHAPES)}")
    ap.add_argument("--budget-s", type=float, default=50.0, help="fused sweep: stop timing")
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--compile-budget-s", type=float, default=30.0)
    args = ap.parse_args()
    if (
        max(args.ms) > GEMV_WIDE_MAX_M
        or min(args.ms) < 1
        or len(set(map(m_bucket, args.ms))) < len(args.ms)
    ):
        ap.error(f"--ms: 1 to {GEMV_WIDE_MAX_M} rows, one per table row (m1, m16: 2-16, m64)")
    if args.tiny and args.write_table:
        ap.error("--tiny measures the interpreter: its table is written to --out only")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("no CUDA device: run on the GPU, or with --tiny on the CPU")
    dev = torch.device("cpu" if args.tiny else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    kernel = "gemv_fused" if args.fused else "gemv"
    table, _ = (sweep_fused if args.fused else sweep_plain)(args, dev, g)
    name = device_name(dev)
    path = table_path(kernel, name)
    every_bucket = set(map(m_bucket, args.ms)) == {"m1", "m16", "m64"}
    partial = args.fused_shapes if args.fused else (args.shapes or not every_bucket)
    if partial and not args.tiny:
        # the shapes and row buckets it did not time keep the entries this device reads now
        # (its own table's, or its architecture's: an H100 without one reads the H200's)
        table = merge_partial(current_table(kernel, name), table)
    if args.fused and not args.tiny and path.exists():  # (this device's own table only)
        for note in keep_step_verdicts(table, json.loads(path.read_text())):
            print(note)
    blob = json.dumps(table, indent=1, sort_keys=True) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / path.name).write_text(blob)
    print(f"wrote {Path(args.out) / path.name}")
    if args.write_table:
        path.write_text(blob)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
