"""The split-KV mode of prefill_attention against prefill_attention_ref, its host policy
(choose_prefill_splits, prefill_scratch) and the per-device tile table of prefill_config.

Split launches get NaN-poisoned outputs and scratch, paged caches whose unused slots are NaN,
random lengths, prompt chunks over cached prefixes, GQA, several split counts and split lengths
that end inside KV blocks (BLOCK_N smaller than the block size) or span several of them; every
case draws fresh random inputs, its seed in the failure message.
"""

import os

import pytest
import torch

import kernels.prefill_attention as pa
from kernels.prefill_attention import prefill_attention, prefill_config
from kernels.prefill_split import (
    choose_prefill_splits,
    prefill_num_splits,
    prefill_scratch,
    scratch_numel,
)
from kernels.reference import prefill_attention_ref

from .test_prefill_attention import TOL, _cu, make_paged, rel_err

SPLIT_CASES = [
    # q_lens, cached prefix lens, Hq, Hkv, D, block size, dtype, causal, splits, tiles (M, N)
    ([40, 17], [150, 90], 4, 2, 64, 32, torch.float32, True, 3, (32, 16)),  # splits end mid-block
    ([24], [300], 8, 2, 64, 16, torch.bfloat16, True, 5, (16, 32)),  # splits span 2 blocks
    ([1, 33, 5, 64], [60, 200, 0, 31], 4, 1, 64, 16, torch.float32, True, 4, (32, 32)),
    ([50, 20], [70, 130], 4, 4, 128, 16, torch.float16, False, 2, (32, 16)),
    ([16, 3], [257, 40], 2, 1, 64, 32, torch.bfloat16, True, 16, (16, 16)),  # some splits empty
]


def _launch(device, q, k_cache, v_cache, bt, cu, sl, causal, splits, cfg, **kw):
    t, hq, d = q.shape
    buf = torch.full(
        (scratch_numel(splits * t, hq, d),), float("nan"), dtype=torch.float32, device=device
    )
    po, plse = prefill_scratch(buf, splits, t, hq, d)
    out = kw.pop("out", None)
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    res = prefill_attention(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        bt.to(device),
        cu.to(device),
        sl.to(device),
        out,
        q.shape[-1] ** -0.5,
        causal,
        config=cfg,
        num_splits=splits,
        partial_out=po,
        partial_lse=plse,
        **kw,
    )
    assert res is out
    return out.cpu(), buf.cpu()


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hkv,d,block_size,dtype,causal,splits,tiles", SPLIT_CASES
)
def test_split_matches_reference(
    device, q_lens, ctx_lens, hq, hkv, d, block_size, dtype, causal, splits, tiles
):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, bt = make_paged(seq_lens, hkv, d, block_size, dtype, g)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape)
    prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), bt, cu, sl, ref, d**-0.5, causal
    )
    block_m, block_n = tiles
    # one-tile minimum split length: the split boundaries fall every BLOCK_N keys at most
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    cfg["MIN_SPLIT_KEYS"] = block_n
    out, buf = _launch(device, q, k_cache, v_cache, bt, cu, sl, causal, splits, cfg)
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"
    assert torch.isfinite(buf).any(), f"no split wrote its partials (seed={seed})"


def test_split_single_range_tiles_write_out_directly(device):
    """Tiles whose keys fit one split (MIN_SPLIT_KEYS above every range) are written by the
    first launch: the scratch stays untouched and the output equals the unsplit launch."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens, hq, hkv, d = [20, 45], [30, 100], 4, 2, 64
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, bt = make_paged(seq_lens, hkv, d, 16, torch.float32, g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "MIN_SPLIT_KEYS": 256}
    out, buf = _launch(device, q, k_cache, v_cache, bt, cu, sl, True, 4, cfg)
    assert torch.isnan(buf).all(), f"scratch written for one-split tiles (seed={seed})"
    plain = torch.full(q.shape, float("nan"), device=device)
    prefill_attention(
        *(x.to(device) for x in (q, k_cache, v_cache, bt, cu, sl)), plain, d**-0.5, config=cfg
    )
    # the same loops in the same order (bitwise equal under the interpreter; a GPU compiles the
    # two variants separately)
    torch.testing.assert_close(out, plain.cpu(), rtol=1e-6, atol=1e-6, msg=f"seed={seed}")


def test_split_padding_and_decode_rows(device):
    """Split mode with skip_decode_rows, padding tokens past cu_seqlens_q[B] and empty padding
    sequences: decode and padding rows keep their sentinel, the others match the reference."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens, pad = [1, 37, 1, 0, 20, 0], [80, 120, 9, 0, 0, 0], 6
    hq, hkv, d, dtype = 4, 2, 64, torch.bfloat16
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, bt = make_paged([max(n, 1) for n in seq_lens], hkv, d, 16, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t + pad, hq, d, generator=g).to(dtype)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape)
    prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, cu, sl, ref, d**-0.5)
    sentinel = 7.0
    out0 = torch.full(q.shape, sentinel, dtype=dtype, device=device)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "MIN_SPLIT_KEYS": 32}
    out, _ = _launch(
        device, q, k_cache, v_cache, bt, cu, sl, True, 3, cfg, out=out0, skip_decode_rows=True
    )
    computed = torch.zeros(t + pad, dtype=torch.bool)
    for i, n in enumerate(q_lens):
        if n > 1:
            computed[int(cu[i]) : int(cu[i + 1])] = True
    assert (out[~computed] == sentinel).all(), f"decode or padding rows written (seed={seed})"
    err = rel_err(out[computed], ref[computed])
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


def test_split_rejects_bad_scratch(device):
    q = torch.zeros(8, 4, 64, device=device)
    kc = torch.zeros(2, 16, 2, 64, device=device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    sl = torch.tensor([8], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="needs partial_out"):
        prefill_attention(q, kc, kc, bt, cu, sl, out, 0.1, num_splits=2)
    po = torch.empty(2, 8, 4, 64, device=device)
    with pytest.raises(ValueError, match="scratch must be"):  # too few splits
        prefill_attention(
            q, kc, kc, bt, cu, sl, out, 0.1, num_splits=3, partial_out=po, partial_lse=po[..., 0]
        )
    with pytest.raises(ValueError, match="scratch must be"):  # too few rows
        prefill_attention(
            q,
            kc,
            kc,
            bt,
            cu,
            sl,
            out,
            0.1,
            num_splits=2,
            partial_out=po[:, :4],
            partial_lse=po[:, :4, :, 0].contiguous(),
        )
    with pytest.raises(ValueError, match="num_splits"):
        prefill_attention(q, kc, kc, bt, cu, sl, out, 0.1, num_splits=0)


def test_choose_prefill_splits():
    kw = {"block_n": 128}
    # a 256-row chunk (2 tiles x 16 heads = 32 programs) over 32k keys on 132 SMs: 4 splits fill
    # one wave (128 programs, 64 + 2 tile times) where 8 would take two (2 x 34)
    assert choose_prefill_splits(2, 16, 32768 + 256, 132, **kw) == 4
    # a grid that fills the GPU, short keys, no work: no split
    assert choose_prefill_splits(8, 16, 32768, 132, **kw) == 1
    assert choose_prefill_splits(2, 16, 128, 132, **kw) == 1
    assert choose_prefill_splits(0, 16, 32768, 132, **kw) == 1
    # bounded by the scratch rows, by max_splits, and by the key tiles
    assert choose_prefill_splits(1, 16, 32768, 132, num_tokens=2048, **kw) == 2
    assert choose_prefill_splits(1, 16, 32768, 132, max_splits=3, **kw) == 3
    assert choose_prefill_splits(1, 1, 8 * 128, 132, **kw) == 8  # one tile per split at most
    assert choose_prefill_splits(1, 1, 3 * 128, 132, **kw) == 1  # 1 + 2 overhead: no gain
    assert choose_prefill_splits(1, 1, 32768, 132, max_splits=1, **kw) == 1
    # two programs per SM: the same chunk needs twice the splits to fill the GPU
    assert choose_prefill_splits(2, 16, 32768, 132, programs_per_sm=2, **kw) == 8
    for tiles in range(1, 12):
        for keys in (0, 100, 4096, 40960):
            s = choose_prefill_splits(tiles, 16, keys, 132, num_tokens=128 * tiles, **kw)
            assert 1 <= s <= 16 and s * 128 * tiles <= 4096
    with pytest.raises(ValueError):
        choose_prefill_splits(1, 0, 100, 132, **kw)
    with pytest.raises(ValueError):
        choose_prefill_splits(1, 16, 100, 0, **kw)


def test_prefill_num_splits_uses_split_config(monkeypatch):
    """The host wrapper counts tiles with the split row's BLOCK_M and takes its policy."""
    monkeypatch.setattr(pa, "device_name", lambda device: "Fake GPU")
    table = {"bfloat16,128": {"split": {"BLOCK_M": 64, "BLOCK_N": 64, "PROGRAMS_PER_SM": 2}}}
    monkeypatch.setattr(pa, "kernel_table", lambda kernel, name: table)
    cuda = torch.device("cuda")
    # 256 rows / 64 = 4 tiles x 16 heads = 64 programs, 264 slots: 4 splits (256 programs)
    assert prefill_num_splits(256, 16, 128, torch.bfloat16, cuda, 32768, 132) == 4
    table["bfloat16,128"]["split"]["MAX_SPLITS"] = 1  # split mode off
    assert prefill_num_splits(256, 16, 128, torch.bfloat16, cuda, 32768, 132) == 1


def test_prefill_scratch_views():
    h, d = 4, 8
    buf = torch.zeros(scratch_numel(10, h, d))
    po, plse = prefill_scratch(buf, 2, 5, h, d)
    assert po.shape == (2, 5, h, d) and plse.shape == (2, 5, h)
    po.fill_(1.0)
    plse.fill_(2.0)
    assert (buf == 1.0).sum() == po.numel() and (buf == 2.0).sum() == plse.numel()
    po, plse = prefill_scratch(buf, 3, 3, h, d)  # a smaller launch: views of the same memory
    assert po.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="exceed"):
        prefill_scratch(buf, 3, 4, h, d)
    with pytest.raises(ValueError, match="flat float32"):
        prefill_scratch(buf.view(2, -1), 1, 1, h, d)


# the configuration of issue 3, which every device/dtype/head_dim without a table row keeps
TODAY = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "BT_PREFETCH": True}


def test_prefill_config_table(monkeypatch):
    monkeypatch.setattr(pa, "device_name", lambda device: "Fake GPU")
    seen = []
    table = {
        "bfloat16,128": {
            "causal": {"BLOCK_N": 64, "num_stages": 3, "tflops": 500.0},
            "split": {"BLOCK_M": 64, "num_warps": 4, "PROGRAMS_PER_SM": 2},
        }
    }

    def fake_table(kernel, name):
        seen.append((kernel, name))
        return table

    monkeypatch.setattr(pa, "kernel_table", fake_table)
    cuda = torch.device("cuda")
    causal = prefill_config(128, torch.bfloat16, cuda, True)
    assert seen[-1] == ("prefill_attention", "Fake GPU")
    assert causal == {**TODAY, "BLOCK_N": 64, "num_stages": 3}  # timings are not config keys
    split = prefill_config(128, torch.bfloat16, cuda, True, split=True)
    assert split == {
        **TODAY,
        "BLOCK_N": 64,
        "num_stages": 3,
        "BLOCK_M": 64,
        "num_warps": 4,
        "PROGRAMS_PER_SM": 2,
        "MIN_SPLIT_KEYS": 512,
        "MAX_SPLITS": 16,
    }
    # rows missing: today's tiles exactly (non-causal, fp16, another head_dim, another device)
    assert prefill_config(128, torch.bfloat16, cuda, False) == TODAY
    assert prefill_config(128, torch.float16, cuda, True) == TODAY
    assert prefill_config(64, torch.bfloat16, cuda, True) == {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "num_warps": 4,
        "num_stages": 3,
        "BT_PREFETCH": True,
    }
    table.clear()
    assert prefill_config(128, torch.bfloat16, cuda, True) == TODAY
    split = prefill_config(128, torch.bfloat16, cuda, True, split=True)
    assert split == {**TODAY, "MIN_SPLIT_KEYS": 512, "PROGRAMS_PER_SM": 1, "MAX_SPLITS": 16}


def test_prefill_config_interpreter_ignores_table(monkeypatch):
    def no_table(kernel, name):
        raise AssertionError("the CPU config must not read a device table")

    monkeypatch.setattr(pa, "kernel_table", no_table)
    cpu = prefill_config(64, torch.float32, torch.device("cpu"), True)
    assert cpu == {
        "BLOCK_M": 32,
        "BLOCK_N": 32,
        "num_warps": 4,
        "num_stages": 1,
        "BT_PREFETCH": True,
    }
    assert (
        prefill_config(64, torch.float32, torch.device("cpu"), split=True)["MIN_SPLIT_KEYS"] == 32
    )
