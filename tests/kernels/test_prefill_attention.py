"""prefill_attention (Triton) against prefill_attention_ref.

Random non-contiguous block tables, unused cache slots and block-table padding poisoned with
NaN, outputs NaN-filled before each launch, cached prefixes plus new tokens, the
Hq/Hkv ratios 1, 2, 4, 8, head_dim 64/128, block sizes 16/32, fp32/bf16/fp16. The parameter
grid is sampled (the interpreter is slow), every case draws fresh random inputs. The flat
query-tile grid (T // BLOCK_M + B slots) is checked for padding (tokens past cu_seqlens_q[B],
empty sequences: real rows as unpadded, padding rows of ``out`` untouched) and for mixed
decode-like / multi-tile / cached-prefix batches at several BLOCK_M.
"""

import os

import pytest
import torch

from kernels.prefill_attention import prefill_attention
from kernels.reference import prefill_attention_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_paged(seq_lens, h_kv, d, block_size, dtype, g):
    """Paged K/V holding random rows for each sequence; every other slot is NaN."""
    nblk = [(n + block_size - 1) // block_size for n in seq_lens]
    spare = 4
    num_blocks = sum(nblk) + spare
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.full((num_blocks, block_size, h_kv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    max_blocks = max(nblk) + 2
    # entries past a sequence's last block point at NaN-filled spare blocks
    block_tables = perm[-spare:][
        torch.randint(0, spare, (len(seq_lens), max_blocks), generator=g)
    ].to(torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        blocks = perm[used : used + nblk[b]]
        used += nblk[b]
        block_tables[b, : nblk[b]] = blocks.to(torch.int32)
        for i in range(n):
            k_cache[blocks[i // block_size], i % block_size] = torch.randn(h_kv, d, generator=g).to(
                dtype
            )
            v_cache[blocks[i // block_size], i % block_size] = torch.randn(h_kv, d, generator=g).to(
                dtype
            )
    return k_cache, v_cache, block_tables


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # q_lens, cached prefix lens, Hq, Hkv, D, block_size, dtype, causal
    ([1, 15, 17], [0, 0, 0], 4, 4, 64, 16, torch.float32, True),
    ([300], [0], 8, 2, 128, 32, torch.bfloat16, True),
    ([17, 40], [100, 0], 8, 1, 64, 16, torch.float16, True),
    ([15, 1, 130], [33, 200, 70], 8, 4, 128, 16, torch.float32, True),
    ([200, 17], [0, 15], 2, 1, 64, 32, torch.bfloat16, False),
    ([1, 1, 1], [16, 17, 299], 4, 2, 128, 32, torch.float32, True),
    ([64, 15], [0, 1], 8, 8, 128, 16, torch.bfloat16, False),
    ([257], [31], 2, 2, 64, 32, torch.float16, False),
    ([33, 5], [47, 0], 16, 2, 64, 16, torch.float32, True),
    ([120], [180], 8, 1, 128, 16, torch.float32, False),
]


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,d,block_size,dtype,causal", CASES)
def test_prefill_matches_reference(device, q_lens, ctx_lens, hq, hkv, d, block_size, dtype, causal):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, block_size, dtype, g)
    t = sum(q_lens)
    # q as a non-contiguous view of a fused QKV projection output
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(dtype)
    q = qkv[:, :hq]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5
    ref = torch.empty(t, hq, d)
    prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_tables, cu, sl, ref, scale, causal
    )

    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    res = prefill_attention(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        cu.to(device),
        sl.to(device),
        out,
        scale,
        causal,
    )
    assert res is out
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out.cpu(), ref)
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_prefill_rejects_bad_inputs(device):
    q = torch.zeros(5, 6, 64, device=device)
    kc = torch.zeros(4, 16, 4, 64, device=device)  # 6 % 4 != 0
    bt = torch.zeros(1, 4, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    sl = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError):
        prefill_attention(q, kc, kc, bt, cu, sl, torch.empty_like(q), 0.1)
    q = torch.zeros(5, 8, 48, device=device)  # head_dim not a power of two
    kc = torch.zeros(4, 16, 4, 48, device=device)
    with pytest.raises(ValueError):
        prefill_attention(q, kc, kc, bt, cu, sl, torch.empty_like(q), 0.1)
    q = torch.zeros(5, 8, 64, device=device)
    kc = torch.zeros(4, 16, 4, 64, device=device)
    with pytest.raises(ValueError):  # int64 block table
        prefill_attention(q, kc, kc, bt.long(), cu, sl, torch.empty_like(q), 0.1)
    with pytest.raises(ValueError):  # output dtype
        prefill_attention(q, kc, kc, bt, cu, sl, torch.empty_like(q).half(), 0.1)


def _cu(q_lens):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0)
    return cu


@pytest.mark.parametrize(
    "q_lens,ctx_lens,pad_tokens,pad_seq_lens,hq,hkv,d,dtype,causal",
    [
        # padding tokens alone, enough of them to add whole spare tile slots past cu_seqlens_q[B]
        ([17, 40], [5, 0], 75, [], 4, 2, 64, torch.float32, True),
        # padding sequences (seq_lens 0 and 1) and padding tokens, as a captured graph would pad
        ([1, 33, 64], [20, 0, 7], 30, [0, 1, 1], 4, 1, 64, torch.bfloat16, True),
        ([50, 1], [0, 40], 14, [1, 0], 2, 2, 128, torch.float32, False),
    ],
)
@pytest.mark.parametrize("page", [16, 64], ids=["page16", "page64-kv-tma"])
def test_prefill_padding_matches_unpadded(
    device, q_lens, ctx_lens, pad_tokens, pad_seq_lens, hq, hkv, d, dtype, causal, page
):
    """Rows past cu_seqlens_q[B] and sequences with q_len 0 (the padding of a CUDA graph captured
    at a bucketed T and B) change no real row and leave their own rows of ``out`` untouched;
    page64: pages of whole key tiles, where the interpreter (like the GPU) takes the KV_TMA
    loads."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, page, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5

    def dev(*xs):
        return [x.to(device) for x in xs]

    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    prefill_attention(*dev(q, k_cache, v_cache, block_tables, cu, sl), out, scale, causal)
    ref = torch.empty(t, hq, d)
    prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_tables, cu, sl, ref, scale, causal
    )
    assert rel_err(out.cpu(), ref) <= TOL[dtype], f"seed={seed}"

    # padded: NaN query rows past the real tokens, empty sequences with zero block-table rows
    q_pad = torch.cat([q, torch.full((pad_tokens, hq, d), float("nan"), dtype=dtype)])
    cu_pad = torch.cat([cu, cu[-1:].repeat(len(pad_seq_lens))])
    sl_pad = torch.cat([sl, torch.tensor(pad_seq_lens, dtype=torch.int32)])
    bt_pad = torch.cat(
        [block_tables, torch.zeros(len(pad_seq_lens), block_tables.shape[1], dtype=torch.int32)]
    )
    sentinel = 7.0
    out_pad = torch.full((t + pad_tokens, hq, d), sentinel, dtype=dtype, device=device)
    prefill_attention(*dev(q_pad, k_cache, v_cache, bt_pad, cu_pad, sl_pad), out_pad, scale, causal)
    assert torch.equal(out_pad[:t], out), f"real rows differ from the unpadded launch (seed={seed})"
    assert (out_pad[t:] == sentinel).all(), f"padding rows of out were written (seed={seed})"


def test_prefill_all_padding_writes_nothing(device):
    """Every sequence empty (a graph replayed with no prefill work): no row of ``out`` changes."""
    q = torch.randn(40, 4, 64, device=device)
    kc = torch.randn(3, 16, 2, 64, device=device)
    cu = torch.zeros(4, dtype=torch.int32, device=device)
    sl = torch.tensor([0, 1, 0], dtype=torch.int32, device=device)
    bt = torch.zeros(3, 2, dtype=torch.int32, device=device)
    out = torch.full_like(q, 7.0)
    prefill_attention(q, kc, kc, bt, cu, sl, out, 0.125)
    assert (out == 7.0).all()


@pytest.mark.parametrize(
    "block_m,causal,zigzag", [(16, True, False), (32, False, False), (64, True, False),
                              (16, True, True), (32, False, True)]
)  # fmt: skip
def test_prefill_mixed_batch_matches_reference(device, block_m, causal, zigzag):
    """Decode-like rows (q_len 1), rows crossing several query tiles and rows with a cached
    prefix in one launch, each sequence starting at an arbitrary offset of the flat tile axis;
    also with the slots walked zigzag (``ZIGZAG``: every tile computed once, in another order)."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q_lens = [1, 70, 1, 33, 1, 100, 5, 1]
    ctx_lens = [40, 0, 0, 20, 129, 10, 3, 16]
    hq, hkv, d, dtype = 4, 2, 64, torch.float32
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, 16, dtype, g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape)
    prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, sl, ref, d**-0.5, causal)
    out = torch.full(q.shape, float("nan"), device=device)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "ZIGZAG": zigzag}
    prefill_attention(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        cu.to(device),
        sl.to(device),
        out,
        d**-0.5,
        causal,
        config=cfg,
    )
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out.cpu(), ref)
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_one_wave_tiles_only_where_the_grid_leaves_sms_idle(monkeypatch):
    """The lone-prompt policy (host ints only): a causal grid under the SM count takes the split
    row's 64-row tiles and ZIGZAG where they fit two programs per SM; a grid that fills the GPU,
    a split row of one program per SM, or the CPU keeps its tiles."""
    import kernels.prefill_attention as pa

    causal = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "KV_TMA": True}
    split = dict(causal, BLOCK_M=64, BLOCK_N=64, num_warps=4, BT_PREFETCH=True, GQA_PACK=False)
    split.update(PROGRAMS_PER_SM=2, MAX_SPLITS=16)
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "prefill_config", lambda *a, **k: dict(split))
    cuda, bf = torch.device("cuda", 0), torch.bfloat16

    def choose(t, b=1, cfg=causal, device=cuda):
        return pa.one_wave_tiles(cfg, t, b, 16, 8, 128, bf, device, 128)

    got = choose(1024)  # 8 x 16 = 128 programs < 132 SMs; 16 x 16 = 256 <= 2 x 132
    assert got["BLOCK_M"] == 64 and got["ZIGZAG"] is True and got["num_warps"] == 4
    assert "PROGRAMS_PER_SM" not in got and "MAX_SPLITS" not in got
    assert choose(512)["BLOCK_M"] == 64  # 64 programs -> 128
    assert choose(2048) == {}  # 256 programs fill the GPU already
    assert choose(1024, b=2) == {}  # 9 x 16 = 144 tile slots at most: not under 132
    assert choose(1024, device=torch.device("cpu")) == {}
    split["PROGRAMS_PER_SM"] = 1
    assert choose(1024) == {}  # the split row runs one program per SM: no pairing


@pytest.mark.parametrize(
    "q_lens,ctx_lens,pad,hq,hkv,d,dtype,block_m",
    [
        ([1, 70, 1, 0, 33, 1, 0], [40, 0, 0, 0, 20, 129, 0], 5, 4, 2, 64, torch.float32, 32),
        ([2, 1, 1, 17], [30, 15, 0, 3], 0, 8, 2, 128, torch.bfloat16, 16),
    ],
)
def test_prefill_skip_decode_rows(device, q_lens, ctx_lens, pad, hq, hkv, d, dtype, block_m):
    """skip_decode_rows: rows of sequences with one new token (left to the decode kernel) and
    padding rows keep their sentinel; every other row matches the reference."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, 16, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t + pad, hq, d, generator=g).to(dtype)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(t + pad, hq, d)
    prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_tables, cu, sl, ref, d**-0.5
    )
    sentinel = 7.0
    out = torch.full(q.shape, sentinel, dtype=dtype, device=device)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    prefill_attention(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        cu.to(device),
        sl.to(device),
        out,
        d**-0.5,
        config=cfg,
        skip_decode_rows=True,
    )
    out = out.cpu()
    computed = torch.zeros(t + pad, dtype=torch.bool)
    for i, n in enumerate(q_lens):
        if n > 1:
            computed[int(cu[i]) : int(cu[i + 1])] = True
    assert (out[~computed] == sentinel).all(), f"decode or padding rows written (seed={seed})"
    err = rel_err(out[computed], ref[computed])
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"
