"""The persistent batch-1 decode kernel for whole Qwen3 decoder layers
(:mod:`kernels.persistent_decode`, its seven phases per layer between grid barriers) timed
against the engine's seven launches per layer, and checked against torch.

Usage (GPU, sm_90+): ``python3 bench/persistent_layer_probe.py [--layers 28] [--context 1024]``

``bench/grid_barrier_probe.py`` measured (H100, 2026-12-06) a grid barrier at ~1.05 us and the
same GEMV tiles 4.8 us per GEMV inside one persistent launch against 6.4-7.2 us as one PDL
launch each (the engine's tuned GEMVs: 5.35); this probe takes the step from GEMVs to whole
layers (Hazy Research's "No Bubbles" megakernel, 2025). Random Qwen3-shaped weights, one tensor
per layer and kind, reached through the kernel's pointer table; the layouts (phases folded
into others, K/V loaded during a wait) and ``--phase-costs`` (each phase's work left out) are
the kernel's options. The oracle is :func:`layer_ref`, the composition of
:mod:`kernels.reference`'s operations in torch.
Prints the persistent launch's time for ``L`` layers (with its registers and spills) and the
LM head's (cuBLAS) the engine adds; the engine's step to compare with comes from
``bench/decode_profile.py`` (stage ``layer`` of ``bench/pending_ab.sh`` runs both in one call).
Its TPOT is a host-clock step time that also holds the embedding, the final norm, the sampler
and any host gap, so ``layers + LM head`` against it flatters the persistent kernel by those.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels import persistent_decode as pd  # noqa: E402
from kernels.persistent_decode import Scratch  # noqa: E402
from kernels.reference import (  # noqa: E402
    decode_attention_ref,
    qk_norm_rope_store_ref,
    rms_norm_ref,
)


class Weights:
    """Random Qwen3-shaped weights of ``layers`` layers, one bf16 tensor per layer and kind on
    ``device`` (as the engine holds them; lists indexed by layer): ``wqkv [(HQ + 2 HKV) D, H]``,
    ``wo [H, HQ D]``, ``wgu [2 FF, H]``, ``wd [H, FF]``, ``ln1``/``ln2 [H]``, ``qn``/``kn [D]``
    (norm weights near 1)."""

    def __init__(self, layers, h, hq, hkv, d, ff, device, gen=None):
        def rnd(*shape, scale=1.0, base=0.0):
            out = []
            for _ in range(layers):
                t = torch.randn(*shape, generator=gen) * scale + base
                out.append(t.to(torch.bfloat16).to(device))
            return out

        self.dims = (h, hq, hkv, d, ff)
        self.layers = layers
        self.wqkv = rnd((hq + 2 * hkv) * d, h, scale=h**-0.5)
        self.wo = rnd(h, hq * d, scale=(hq * d) ** -0.5)
        self.wgu = rnd(2 * ff, h, scale=h**-0.5)
        self.wd = rnd(h, ff, scale=ff**-0.5)
        self.ln1 = rnd(h, scale=0.1, base=1.0)
        self.ln2 = rnd(h, scale=0.1, base=1.0)
        self.qn = rnd(d, scale=0.1, base=1.0)
        self.kn = rnd(d, scale=0.1, base=1.0)


def layer_table(wt: Weights, k_caches, v_caches) -> torch.Tensor:
    """:func:`kernels.persistent_decode.layer_table` of ``wt``'s layers and their caches."""
    names = ("wqkv", "wo", "wgu", "wd", "ln1", "ln2", "qn", "kn")
    return pd.layer_table(
        [[getattr(wt, n)[i] for n in names] + [k_caches[i], v_caches[i]] for i in range(wt.layers)]
    )


def persistent_layers(
    x, wt: Weights, k_caches, v_caches, block_table, seq_len, cos, sin, eps, scratch: Scratch,
    programs=1, block_k=64, block_t=32, num_warps=4, fuse_b=False, merge_e=False, pre_kv=False,
    merge_c=False, skip=0, table=None, info=None, slot=None, prefetch=0, pre_w=False,
    late_r=False, early_res=False, row_sm=False, block_k_h=None, dot_attn=False,
):  # fmt: skip
    """:func:`kernels.persistent_decode.persistent_layers` over ``wt``'s layers and the caches
    ``k_caches``/``v_caches`` (one ``[blocks, BS, HKV, D]`` tensor per layer); ``table``: their
    :func:`layer_table`, made here when None (not inside a graph capture); ``slot``: the new
    token's cache slot (an int64 ``[1]`` device tensor inside a graph; None: from the block
    table and an int ``seq_len``); ``prefetch``: the kernel's ``PF`` mask of L2 prefetches;
    ``pre_w``: its ``PRE_W`` (each GEMV's first weight chunk loaded during the wait);
    ``late_r``, ``early_res``, ``row_sm``: its ``LATE_R``, ``EARLY_RES`` and ``ROW_SM`` (the
    norm scales applied after the dot products; the residual rows loaded before the K loops;
    the attention's online softmax per row); ``block_k_h``: its ``BK_H`` (the o and down
    projections' K chunk; None: ``block_k``); ``dot_attn``: its ``DOT`` (the attention's
    per-head loop on tensor cores)."""
    if table is None:
        table = layer_table(wt, k_caches, v_caches)
    bs = k_caches[0].shape[1]
    if slot is None:  # the new token's slot from the block table (host side: not in a capture)
        pos = int(seq_len) - 1
        slot = int(block_table[pos // bs]) * bs + pos % bs
    return pd.persistent_layers(
        x, table, wt.dims, bs, block_table, slot, seq_len, cos, sin, eps, scratch, programs,
        block_k, block_t, num_warps, fuse_b, merge_e, pre_kv, merge_c, skip, info,
        prefetch=prefetch, pre_w=pre_w, late_r=late_r, early_res=early_res, row_sm=row_sm,
        block_k_h=block_k_h, dot_attn=dot_attn,
    )  # fmt: skip


def layer_ref(x, wt: Weights, layer, k_cache, v_cache, block_table, seq_len, cos, sin, eps):
    """One Qwen3 decoder layer for one decode token from :mod:`kernels.reference`'s operations
    (eager torch, bf16 roundings between ops): returns the new hidden state ``[H]`` (bf16) and
    stores the token's k/v into ``k_cache``/``v_cache`` (``[blocks, BS, HKV, D]``) in place."""
    h, hq, hkv, d, ff = wt.dims
    n = rms_norm_ref(x[None], wt.ln1[layer], eps)
    qkv = (n.float() @ wt.wqkv[layer].float().T).to(torch.bfloat16)[0]
    q = qkv[: hq * d].view(1, hq, d)
    k = qkv[hq * d : (hq + hkv) * d].view(1, hkv, d)
    v = qkv[(hq + hkv) * d :].view(1, hkv, d)
    bs = k_cache.shape[1]
    pos = seq_len - 1
    slot = torch.tensor([int(block_table[pos // bs]) * bs + pos % bs], device=x.device)
    q = qk_norm_rope_store_ref(
        q, k, v, k_cache, v_cache, slot, cos[None], sin[None], wt.qn[layer], wt.kn[layer], eps
    )
    attn = torch.empty_like(q)
    seq = torch.tensor([seq_len], dtype=torch.int32, device=x.device)
    decode_attention_ref(q, k_cache, v_cache, block_table[None], seq, attn, d**-0.5)
    o = (attn.reshape(1, -1).float() @ wt.wo[layer].float().T).to(torch.bfloat16)[0]
    h2 = x + o
    n2 = rms_norm_ref(h2[None], wt.ln2[layer], eps)
    gu = (n2.float() @ wt.wgu[layer].float().T).to(torch.bfloat16)[0]
    act = F.silu(gu[:ff]) * gu[ff:]
    dn = (act[None].float() @ wt.wd[layer].float().T).to(torch.bfloat16)[0]
    return h2 + dn


def rotary_row(pos: int, d: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotate-half rotary ``cos``/``sin`` rows ``[D]`` (bf16) of position ``pos``."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos * inv
    emb = torch.cat([ang, ang])
    return emb.cos().to(torch.bfloat16).to(device), emb.sin().to(torch.bfloat16).to(device)


def setup(layers, dims, context, block_size, device, seed=0):
    """Weights, per-layer K/V caches ``[blocks, BS, HKV, D]`` (lists, as the engine's) filled
    with random keys/values for the ``context - 1`` earlier tokens, a shuffled block table, the
    new token's rotary row and hidden state."""
    gen = torch.Generator().manual_seed(seed)
    h, hq, hkv, d, ff = dims
    wt = Weights(layers, h, hq, hkv, d, ff, device, gen)
    blocks = -(-context // block_size) + 2
    shape = (blocks, block_size, hkv, d)
    kc = [torch.randn(shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(layers)]
    vc = [torch.randn(shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(layers)]
    bt = torch.randperm(blocks, generator=gen)[: -(-context // block_size)].to(torch.int32)
    cos, sin = rotary_row(context - 1, d, 1e6, device)
    x = torch.randn(h, generator=gen).to(torch.bfloat16)
    return wt, kc, vc, bt.to(device), cos, sin, x.to(device)


def main() -> int:
    from bench.pdl_probe import time_or_report

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--programs", type=int, default=0, help="0: the SM count")
    ap.add_argument("--warps", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--block-t", type=int, default=32)
    ap.add_argument(
        "--block-k-h", type=int, nargs="*", default=[0],
        help="the o and down projections' K chunks to time with each layout (0: --block-k)",
    )  # fmt: skip
    ap.add_argument("--splits", type=int, nargs="*", default=[0], help="0: programs / H_kv")
    ap.add_argument(
        "--phase-costs", action="store_true",
        help="also time the first layout and warp count with each phase's work left out",
    )  # fmt: skip
    ap.add_argument(
        "--layouts", nargs="*", default=["0000", "1000", "1010", "1011"],
        help="phase layouts to time, each four to nine 0/1 digits: fuse_b, merge_e, pre_kv, "
        "merge_c, pre_w, late_r, early_res, row_sm, dot_attn (missing: 0)",
    )  # fmt: skip
    ap.add_argument(
        "--prefetch", type=int, nargs="*", default=[0],
        help="the kernel's PF masks of L2 prefetches to time with each layout (1: o and "
        "gate/up tiles after A; 2: down and the next q/k/v tiles after C; 4: the next layer's "
        "keys/values after E)",
    )  # fmt: skip
    ap.add_argument(
        "--hot-l2", action="store_true",
        help="also time the first layout with every layer's table row pointing at layer 0's "
        "tensors (weights and caches L2-resident: the bound a prefetch could reach; its "
        "output is not checked)",
    )  # fmt: skip
    args = ap.parse_args()
    args.layouts = [tuple(c == "1" for c in lay.ljust(9, "0")) for lay in args.layouts]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("persistent_layer_probe: needs a CUDA device of compute capability 9.0+; skipped")
        return 0
    dev = torch.device("cuda")
    programs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    dims = (1024, 16, 8, 128, 3072)  # Qwen3-0.6B
    eps = 1e-6
    wt, kc, vc, bt, cos, sin, x0 = setup(args.layers, dims, args.context, 128, dev)
    # correctness: the kernel against the reference, layer by layer, on copies of the caches
    kr, vr = [t.clone() for t in kc], [t.clone() for t in vc]
    ref = x0.clone()
    for layer in range(args.layers):
        ref = layer_ref(ref, wt, layer, kr[layer], vr[layer], bt, args.context, cos, sin, eps)
    seq_t = torch.tensor([args.context], dtype=torch.int32, device=dev)  # read on the device
    pos = args.context - 1
    slot_t = torch.tensor([int(bt[pos // 128]) * 128 + pos % 128], dtype=torch.int64, device=dev)
    table = layer_table(wt, kc, vc)  # made once: a graph capture cannot copy from the host
    hot_table = table[:1].expand_as(table).contiguous()
    print(f"{args.layers} layers, context {args.context}, {programs} programs")
    print("| variant | us per launch | us per layer | rel err vs torch layers |")
    print("|---|---|---|---|")
    bad = 0
    for sp in args.splits:
        splits = sp or triton.next_power_of_2(max(1, programs // dims[2]))
        scratch = Scratch(dims, splits, dev)
        for warps in args.warps:
            variants = [
                (lay, pf, False, bkh)
                for lay in args.layouts for pf in args.prefetch for bkh in args.block_k_h
            ]  # fmt: skip
            variants += (
                [(args.layouts[0], args.prefetch[0], True, args.block_k_h[0])]
                if args.hot_l2 else []
            )  # fmt: skip
            for lay_flags, pf, hot, bkh in variants:
                fuse_b, merge_e, pre_kv, merge_c, pre_w, late_r, early_res, row_sm, dot = lay_flags
                x = x0.clone()

                info: dict = {}

                def run(
                    warps=warps, x=x, sc=scratch, lay=(fuse_b, merge_e, pre_kv, merge_c), info=info,
                    pf=pf, tab=hot_table if hot else table, pw=pre_w, lr=late_r, er=early_res,
                    rs=row_sm, bkh=bkh or None, dot=dot,
                ):  # fmt: skip
                    x.copy_(x0)
                    return persistent_layers(
                        x, wt, kc, vc, bt, seq_t, cos, sin, eps, sc, programs,
                        args.block_k, args.block_t, warps, *lay, table=tab, info=info,
                        slot=slot_t, prefetch=pf, pre_w=pw, late_r=lr, early_res=er, row_sm=rs,
                        block_k_h=bkh, dot_attn=dot,
                    )  # fmt: skip

                label = (
                    f"{splits} splits, {warps} warps, "
                    f"{7 - fuse_b - (merge_e or merge_c)} phases{' (B in C)' if fuse_b else ''}"
                    f"{' (D in E)' if merge_e else ''}{' (D in C)' if merge_c else ''}"
                    f"{', K/V during the wait' if pre_kv else ''}"
                    f"{', first weight chunks during the wait' if pre_w else ''}"
                    f"{', norm scales late' if late_r else ''}"
                    f"{', residual early' if early_res else ''}"
                    f"{', softmax per row' if row_sm else ''}"
                    f"{', attention on tensor cores' if dot else ''}"
                    f"{f', o/down K chunk {bkh}' if bkh else ''}"
                    f"{f', L2 prefetch {pf}' if pf else ''}"
                    f"{', every layer on layer 0 tensors (hot L2)' if hot else ''}"
                )
                timed = time_or_report(label, run, args.reps)
                if timed is None:
                    continue
                us, out = timed
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                flag = " **over 5e-2**" if not err < 5e-2 and not hot else ""
                bad += bool(flag)
                label += f"; {info.get('usage') or 'registers not reported'}"
                print(
                    f"| {label} | {us:.1f} | {us / args.layers:.2f} | {err:.2e}{flag} |", flush=True
                )
    if args.phase_costs:  # each phase's work: the launch's time less the time without it
        splits = args.splits[0] or triton.next_power_of_2(max(1, programs // dims[2]))
        scratch = Scratch(dims, splits, dev)
        lay = args.layouts[0]
        base = None
        bkh = args.block_k_h[0] or None  # (the first o/down K chunk, as the layouts' first row)
        print(
            f"\nphase costs, layout {''.join(str(int(f)) for f in lay)}, {args.warps[0]} warps, "
            f"{splits} splits, o/down K chunk {bkh or args.block_k} (us per layer)"
        )
        print("| phase left out | us per launch | its work, us per layer |")
        print("|---|---|---|")
        fuse_b, merge_e, _pre, merge_c = lay[:4]
        phases = [("none", 0), ("A", 1)] + ([] if fuse_b else [("B", 2)])
        phases += [("C (and B's folded work)" if fuse_b else "C", 4)]
        phases += [] if (merge_e or merge_c) else [("D", 8)]
        phases += [("E", 16), ("F", 32), ("G", 64), ("all", 127)]
        for name, bit in phases:
            x = x0.clone()

            def run(x=x, bit=bit):
                x.copy_(x0)
                return persistent_layers(
                    x, wt, kc, vc, bt, seq_t, cos, sin, eps, scratch, programs, args.block_k,
                    args.block_t, args.warps[0], *lay[:4], skip=bit, table=table, slot=slot_t,
                    pre_w=lay[4], late_r=lay[5], early_res=lay[6], row_sm=lay[7],
                    dot_attn=lay[8], block_k_h=bkh,
                )  # fmt: skip

            timed = time_or_report(f"skip {name}", run, args.reps)
            if timed is None:
                continue
            base = timed[0] if bit == 0 else base
            work = (base - timed[0]) / args.layers if base is not None and bit else float("nan")
            print(f"| {name} | {timed[0]:.1f} | {work:.2f} |", flush=True)
    # the LM head the engine adds to its layers (cuBLAS, as the engine runs it; not in the above)
    head = torch.randn(151936, 1024, device=dev, dtype=torch.bfloat16) * 0.03
    timed = time_or_report("lm head", lambda: F.linear(x0[None], head), args.reps)
    if timed is not None:
        print(f"| LM head (cuBLAS, 151,936 x 1,024) | {timed[0]:.1f} | - | - |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
