"""GQA packing of prefill_attention (config key ``GQA_PACK``) against prefill_attention_ref.

Every case runs packed and unpacked (``GQA_PACK`` on / off) on fresh random inputs (the seed in
the failure message): the paged caches of tests/kernels/test_prefill_attention.py (NaN in unused
slots and block-table padding), NaN-filled outputs, ragged lengths with cached prefixes (chunked
prefill, q_len < seq_len), causal and non-causal, G = 2 and 4 packed, G = 1, 7 and a tile of too
few tokens falling back to the unpacked kernel; padding (q_len 0 sequences, tokens past
cu_seqlens_q[B]), skip_decode_rows, and the split-KV mode with its merge. Tiles are small
(BLOCK_M 32 / 64, BLOCK_N 16) so each case takes seconds under the interpreter.
"""

import os

import pytest
import torch

import kernels.prefill_attention as pa
import kernels.prefill_split as ps
from kernels.prefill_attention import MIN_PACK_TOKENS, prefill_attention, prefill_tiling
from kernels.prefill_split import prefill_num_splits, prefill_scratch, scratch_numel
from kernels.reference import prefill_attention_ref

from .test_prefill_attention import TOL, _cu, make_paged, rel_err


def _cfg(block_m: int, pack: bool, **kw) -> dict:
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": 16,
        "num_warps": 4,
        "num_stages": 1,
        "BT_PREFETCH": True,
        "GQA_PACK": pack,
        **kw,
    }


def _inputs(q_lens, ctx_lens, hq, hkv, d, dtype, g, pad_tokens=0, block_size=16):
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    # padding sequences (q_len 0) may have seq_len 0: give make_paged one row for them
    k_cache, v_cache, bt = make_paged([max(n, 1) for n in seq_lens], hkv, d, block_size, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t + pad_tokens, hq, d, generator=g).to(dtype)
    if pad_tokens:
        q[t:] = float("nan")  # never read
    return q, k_cache, v_cache, bt, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)


def _run(device, q, kc, vc, bt, cu, sl, causal, cfg, splits=1, out=None, **kw):
    t, hq, d = q.shape
    po = plse = None
    if splits > 1:
        buf = torch.full((scratch_numel(splits * t, hq, d),), float("nan"), device=device)
        po, plse = prefill_scratch(buf, splits, t, hq, d)
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    res = prefill_attention(
        *(x.to(device) for x in (q, kc, vc, bt, cu, sl)),
        out,
        d**-0.5,
        causal,
        config=cfg,
        num_splits=splits,
        partial_out=po,
        partial_lse=plse,
        **kw,
    )
    assert res is out
    return out.cpu()


def _ref(q, kc, vc, bt, cu, sl, causal):
    ref = torch.empty(q.shape)
    prefill_attention_ref(
        q.float(), kc.float(), vc.float(), bt, cu, sl, ref, q.shape[-1] ** -0.5, causal
    )
    return ref


def test_prefill_tiling():
    """Packed only for a power-of-two G >= 2 with BLOCK_M // G >= MIN_PACK_TOKENS and the key
    on; the grid's head axis is then H_kv and a tile holds BLOCK_M // G tokens."""
    on, off = _cfg(64, True), _cfg(64, False)
    assert MIN_PACK_TOKENS == 16
    assert prefill_tiling(on, 16, 8) == (True, 32, 8)  # Qwen3-0.6B, G = 2
    assert prefill_tiling(on, 32, 8) == (True, 16, 8)  # G = 4
    assert prefill_tiling(on, 64, 8) == (False, 64, 64)  # G = 8: 8 tokens per tile, too few
    assert prefill_tiling(_cfg(128, True), 64, 8) == (True, 16, 8)
    assert prefill_tiling(off, 16, 8) == (False, 64, 16)  # key off
    assert prefill_tiling({"BLOCK_M": 64}, 16, 8) == (False, 64, 16)  # key absent
    assert prefill_tiling(on, 8, 8) == (False, 64, 8)  # MHA
    assert prefill_tiling(on, 14, 2) == (False, 64, 14)  # G = 7 (Qwen2.5-0.5B)
    assert prefill_tiling(on, 12, 2) == (False, 64, 12)  # G = 6
    assert prefill_tiling(_cfg(32, True), 8, 2) == (False, 32, 8)  # G = 4, 8 tokens


CASES = [
    # q_lens, cached prefix lens, Hq, Hkv, D, dtype, causal, BLOCK_M, packs
    ([1, 37, 16, 50], [0, 20, 45, 0], 4, 2, 64, torch.float32, True, 32, True),  # G=2, TOK 16
    ([70, 3], [33, 100], 8, 2, 64, torch.bfloat16, True, 64, True),  # G=4, TOK 16
    ([40, 17], [60, 0], 4, 2, 64, torch.float16, False, 32, True),  # G=2 non-causal
    ([20, 35], [50, 7], 8, 2, 32, torch.float32, False, 64, True),  # G=4 non-causal
    ([45], [30], 8, 2, 128, torch.bfloat16, True, 32, False),  # G=4 at BLOCK_M 32: 8 tokens
    ([30, 19], [17, 0], 2, 2, 64, torch.float32, True, 32, False),  # MHA
    ([25, 9], [40, 3], 7, 1, 64, torch.float32, True, 32, False),  # G=7
    ([90], [0], 4, 2, 64, torch.float32, True, 128, True),  # G=2, TOK 64 (Qwen3-0.6B's tiling)
    ([70, 20], [40, 0], 8, 2, 64, torch.bfloat16, False, 128, True),  # G=4, TOK 32
]


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,d,dtype,causal,block_m,packs", CASES)
def test_gqa_pack_matches_reference(
    device, pack, q_lens, ctx_lens, hq, hkv, d, dtype, causal, block_m, packs
):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, bt, cu, sl = _inputs(q_lens, ctx_lens, hq, hkv, d, dtype, g)
    cfg = _cfg(block_m, pack)
    assert prefill_tiling(cfg, hq, hkv)[0] == (pack and packs)
    out = _run(device, q, kc, vc, bt, cu, sl, causal, cfg)
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out, _ref(q, kc, vc, bt, cu, sl, causal))
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_gqa_pack_equals_unpacked(device):
    """fp32: the packed and the unpacked launch agree to rounding on every row (the same keys
    in the same order per row; only the tile a row lives in differs)."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, bt, cu, sl = _inputs([33, 1, 64], [70, 5, 0], 8, 2, 64, torch.float32, g)
    a = _run(device, q, kc, vc, bt, cu, sl, True, _cfg(64, True))
    b = _run(device, q, kc, vc, bt, cu, sl, True, _cfg(64, False))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
def test_gqa_pack_padding(device, pack):
    """Padding sequences (q_len 0) and tokens past cu_seqlens_q[B]: real rows equal the unpadded
    launch's, padding rows of ``out`` keep their sentinel."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens, pad = [1, 0, 40, 17, 0], [30, 0, 9, 60, 0], 37
    hq, hkv, d, dtype = 8, 2, 64, torch.bfloat16
    q, kc, vc, bt, cu, sl = _inputs(q_lens, ctx_lens, hq, hkv, d, dtype, g, pad_tokens=pad)
    t = sum(q_lens)
    cfg = _cfg(64, pack)
    sentinel = 7.0
    out0 = torch.full(q.shape, sentinel, dtype=dtype, device=device)
    out = _run(device, q, kc, vc, bt, cu, sl, True, cfg, out=out0)
    assert (out[t:] == sentinel).all(), f"padding rows of out were written (seed={seed})"
    err = rel_err(out[:t], _ref(q, kc, vc, bt, cu, sl, True)[:t])
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"
    # the same sequences without padding (empty sequences dropped)
    keep = [i for i, n in enumerate(q_lens) if n]
    q2, bt2 = q[:t], bt[keep]
    cu2, sl2 = _cu([q_lens[i] for i in keep]), sl[keep]
    plain = _run(device, q2, kc, vc, bt2, cu2, sl2, True, cfg)
    assert torch.equal(out[:t], plain), f"real rows differ from the unpadded launch (seed={seed})"


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
def test_gqa_pack_skip_decode_rows(device, pack):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens, pad = [1, 37, 1, 0, 20], [80, 12, 9, 0, 0], 5
    hq, hkv, d, dtype = 4, 2, 64, torch.float32
    q, kc, vc, bt, cu, sl = _inputs(q_lens, ctx_lens, hq, hkv, d, dtype, g, pad_tokens=pad)
    t = sum(q_lens)
    sentinel = 7.0
    out0 = torch.full(q.shape, sentinel, dtype=dtype, device=device)
    out = _run(device, q, kc, vc, bt, cu, sl, True, _cfg(32, pack), out=out0, skip_decode_rows=True)
    computed = torch.zeros(t + pad, dtype=torch.bool)
    for i, n in enumerate(q_lens):
        if n > 1:
            computed[int(cu[i]) : int(cu[i + 1])] = True
    assert (out[~computed] == sentinel).all(), f"decode or padding rows written (seed={seed})"
    ref = _ref(q, kc, vc, bt, cu, sl, True)
    err = rel_err(out[computed], ref[computed])
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


SPLIT_CASES = [
    # q_lens, cached prefix lens, Hq, Hkv, dtype, causal, BLOCK_M, splits, skip_decode, pad
    ([40, 1, 17], [150, 60, 90], 8, 2, torch.float32, True, 64, 3, False, 0),  # G=4
    ([24, 33], [200, 0], 4, 2, torch.bfloat16, True, 32, 4, False, 0),  # G=2, some splits empty
    ([50, 20], [70, 130], 4, 2, torch.float32, False, 32, 2, False, 0),  # non-causal
    ([1, 37, 1, 0, 20, 0], [80, 120, 9, 0, 0, 0], 8, 2, torch.bfloat16, True, 64, 3, True, 6),
    ([70, 1, 45], [150, 60, 90], 4, 2, torch.float32, True, 64, 3, False, 0),  # G=2, TOK 32
    ([130, 33], [40, 200], 4, 2, torch.float32, True, 128, 4, False, 0),  # TOK 64: 2 merge blocks
]


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,dtype,causal,block_m,splits,skip,pad", SPLIT_CASES)
def test_gqa_pack_split_matches_reference(
    device, pack, q_lens, ctx_lens, hq, hkv, dtype, causal, block_m, splits, skip, pad
):
    """Split-KV mode packed: the first launch's tiles of BLOCK_M // G tokens and the merge (per
    query head, blocks of min(MERGE_M, TOK) tokens) agree on which tiles were split."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    d = 64
    q, kc, vc, bt, cu, sl = _inputs(q_lens, ctx_lens, hq, hkv, d, dtype, g, pad_tokens=pad)
    t = sum(q_lens)
    cfg = _cfg(block_m, pack, MIN_SPLIT_KEYS=16)
    assert prefill_tiling(cfg, hq, hkv)[0] == pack
    sentinel = 7.0
    out0 = torch.full(q.shape, sentinel, dtype=dtype, device=device)
    out = _run(device, q, kc, vc, bt, cu, sl, causal, cfg, splits, out=out0, skip_decode_rows=skip)
    computed = torch.zeros(t + pad, dtype=torch.bool)
    for i, n in enumerate(q_lens):
        if n > (1 if skip else 0):
            computed[int(cu[i]) : int(cu[i + 1])] = True
    assert (out[~computed] == sentinel).all(), f"skipped or padding rows written (seed={seed})"
    assert torch.isfinite(out[computed]).all(), f"unwritten or NaN output (seed={seed})"
    ref = _ref(q, kc, vc, bt, cu, sl, causal)
    err = rel_err(out[computed], ref[computed])
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_split_model_counts_packed_programs(monkeypatch):
    """prefill_num_splits counts a packed split row's programs as H_kv x cdiv(T, BLOCK_M // G),
    an unpacked one's (or without num_kv_heads) as H_q x cdiv(T, BLOCK_M)."""
    monkeypatch.setattr(pa, "device_name", lambda device: "Fake GPU")
    row = {"BLOCK_M": 128, "BLOCK_N": 64, "GQA_PACK": True}
    monkeypatch.setattr(pa, "kernel_table", lambda kernel, name: {"bfloat16,128": {"split": row}})
    seen = []

    def fake_choose(num_query_tiles, num_heads, *args, **kw):
        seen.append((num_query_tiles, num_heads))
        return 1

    monkeypatch.setattr(ps, "choose_prefill_splits", fake_choose)
    cuda = torch.device("cuda")
    args = (256, 32, 128, torch.bfloat16, cuda, 32768, 132)
    prefill_num_splits(*args, num_kv_heads=8)  # G = 4: tiles of 32 tokens
    prefill_num_splits(*args)  # H_kv unknown: unpacked count
    row["GQA_PACK"] = False
    prefill_num_splits(*args, num_kv_heads=8)
    assert seen == [(8, 8), (2, 32), (2, 32)]


def test_backend_passes_kv_heads(device, monkeypatch):
    """The engine's backend gives the split model H_kv (the cache's head axis)."""
    import engine.attention.triton_backend as tb

    seen = []

    def fake(*args, **kw):
        seen.append(kw.get("num_kv_heads"))
        return 1

    monkeypatch.setattr(tb, "prefill_num_splits", fake)
    be = tb.TritonAttentionBackend()

    class Meta:
        max_seq_len = 1000
        block_tables = torch.zeros(2, 4, dtype=torch.int32)

    be._num_sms[torch.device(device)] = 64
    q = torch.zeros(10, 8, 64, device=device)
    assert be.prefill_splits(q, Meta(), 2)[0] == 1
    assert seen == [2]
