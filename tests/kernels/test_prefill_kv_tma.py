"""The prefill kernel's ``KV_TMA`` path (K/V tiles loaded through tensor descriptors, one box per
tile within one page) against ``prefill_attention_ref``, and the config rules that select it.

Under the interpreter the descriptors are emulated, so these tests check the path's indexing:
the row of a tile (``block * page + pos % page``), the column of a KV head, tails that end inside
a page whose unused slots hold NaN (scores masked, V rows zeroed), cached prefixes, the split-KV
mode and its merge, GQA packing, skipped decode rows and padding. Fresh random inputs each run.
"""

import os

import pytest
import torch

import kernels.prefill_attention as pa
from kernels.prefill_attention import prefill_attention, prefill_config
from kernels.reference import prefill_attention_ref
from tests.kernels.test_prefill_attention import TOL, _cu, make_paged, rel_err

pytestmark = pytest.mark.skipif(pa.TensorDescriptor is None, reason="triton without descriptors")


def _run(device, q_lens, ctx_lens, hq, hkv, d, page, dtype, causal, cfg, **kw):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, page, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(t, hq, d)
    prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_tables, cu, sl, ref, d**-0.5, causal
    )
    sentinel = 7.0
    out = torch.full((t, hq, d), sentinel, dtype=dtype, device=device)
    extra = {}
    if kw.get("num_splits", 1) > 1:
        s = kw["num_splits"]
        extra = dict(
            partial_out=torch.empty(s, t, hq, d, device=device),
            partial_lse=torch.empty(s, t, hq, device=device),
        )
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
        config={**cfg, "KV_TMA": True},
        **kw,
        **extra,
    )
    return out.cpu(), ref, q_lens, seed


TILES = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "BT_PREFETCH": True}


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hkv,d,page,dtype,causal,cfg",
    [
        # tails inside a page, a cached prefix, several sequences
        ([37, 5, 64], [0, 29, 50], 4, 2, 64, 32, torch.float32, True, TILES),
        # one tile per page, GQA 4, bf16 (upcast in the interpreter)
        ([70], [33], 8, 2, 64, 16, torch.bfloat16, True, TILES),
        # non-causal, MHA, pages of two tiles, no block-id prefetch
        ([20, 45], [13, 0], 2, 2, 32, 32, torch.float32, False, {**TILES, "BT_PREFETCH": False}),
        # larger key tiles, head_dim 128
        ([50], [90], 4, 1, 128, 64, torch.float16, True, {**TILES, "BLOCK_N": 32}),
        # GQA-packed rows (G = 2: 16 tokens x 2 heads per tile)
        ([40, 3], [17, 60], 4, 2, 64, 32, torch.float32, True, {**TILES, "GQA_PACK": True}),
    ],
)
def test_kv_tma_matches_reference(device, q_lens, ctx_lens, hq, hkv, d, page, dtype, causal, cfg):
    out, ref, _, seed = _run(device, q_lens, ctx_lens, hq, hkv, d, page, dtype, causal, cfg)
    assert torch.isfinite(out).all(), f"unwritten or NaN output (seed={seed})"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"rel err {err:.2e} (seed={seed})"


@pytest.mark.parametrize("splits", [2, 3])
def test_kv_tma_split_mode(device, splits):
    """Split-KV launches (partials and merge) over a long cached prefix through the TMA loads."""
    out, ref, _, seed = _run(
        device,
        [20, 9],
        [150, 97],
        4,
        2,
        64,
        32,
        torch.float32,
        True,
        {**TILES, "MIN_SPLIT_KEYS": 16},
        num_splits=splits,
    )
    assert torch.isfinite(out).all(), f"seed={seed}"
    assert rel_err(out, ref) <= TOL[torch.float32], f"seed={seed}"


def test_kv_tma_skip_decode_rows(device):
    """Decode rows (q_len 1) keep their sentinel with skip_decode_rows; the others match."""
    out, ref, q_lens, seed = _run(
        device,
        [1, 30, 1, 17],
        [40, 3, 77, 0],
        4,
        2,
        64,
        32,
        torch.float32,
        True,
        TILES,
        skip_decode_rows=True,
    )
    cu = _cu(q_lens)
    decode_rows = [int(cu[i]) for i, n in enumerate(q_lens) if n == 1]
    keep = [r for r in range(out.shape[0]) if r not in decode_rows]
    assert (out[decode_rows] == 7.0).all(), f"decode rows written (seed={seed})"
    assert rel_err(out[keep], ref[keep]) <= TOL[torch.float32], f"seed={seed}"


def test_kv_tma_rejects_pages_that_split_a_tile(device):
    q = torch.randn(8, 4, 64, device=device)
    kc = torch.randn(4, 16, 2, 64, device=device)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    sl = torch.tensor([8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        prefill_attention(
            q,
            kc,
            kc,
            bt,
            cu,
            sl,
            torch.empty_like(q),
            0.1,
            config={**TILES, "BLOCK_N": 32, "KV_TMA": True},
        )


def test_prefill_config_selects_kv_tma_by_page(monkeypatch):
    """On a TMA-capable CUDA device the TMA rows apply when the page holds whole BLOCK_N tiles;
    16-token pages (or no page size) keep the pointer path's tiles without a ``KV_TMA`` key."""
    table = {
        "bfloat16,128": {
            "causal": {"BLOCK_N": 128, "num_stages": 2},
            "tma_causal": {"num_stages": 4},
            "tma_split": {"PROGRAMS_PER_SM": 2},
        }
    }
    monkeypatch.setattr(pa, "kernel_table", lambda kernel, name: table)
    monkeypatch.setattr(pa, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(pa, "kv_tma_available", lambda device: True)
    cuda = torch.device("cuda")
    tma = prefill_config(128, torch.bfloat16, cuda, True, page_size=128)
    assert tma["KV_TMA"] is True and tma["BLOCK_N"] == 64 and tma["num_stages"] == 4
    split = prefill_config(128, torch.bfloat16, cuda, True, split=True, page_size=64)
    assert split["KV_TMA"] is True and split["PROGRAMS_PER_SM"] == 2
    for page in (16, 32, None):
        ptr = prefill_config(128, torch.bfloat16, cuda, True, page_size=page)
        assert "KV_TMA" not in ptr and ptr["BLOCK_N"] == 128 and ptr["num_stages"] == 2
    # no measured TMA default for this head_dim / dtype: the pointer path
    assert "KV_TMA" not in prefill_config(64, torch.bfloat16, cuda, True, page_size=128)
    assert "KV_TMA" not in prefill_config(128, torch.float32, cuda, True, page_size=128)
    monkeypatch.setattr(pa, "kv_tma_available", lambda device: False)
    assert "KV_TMA" not in prefill_config(128, torch.bfloat16, cuda, True, page_size=128)


def test_interpreter_takes_the_tma_path_on_whole_tile_pages():
    cpu = torch.device("cpu")
    assert prefill_config(64, torch.float32, cpu, True, page_size=64)["KV_TMA"] is True
    assert "KV_TMA" not in prefill_config(64, torch.float32, cpu, True, page_size=16)
    assert "KV_TMA" not in prefill_config(64, torch.float32, cpu, True)


def test_tables_choice_falls_back_on_a_strided_cache(device):
    """A TMA path chosen by the page size alone runs the pointer gather on a cache that is not
    contiguous (here: every other KV head of a wider cache); an explicit KV_TMA is refused."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    seq_lens, q_lens, hq, d = [70, 40], [30, 40], 4, 64
    k_wide, v_wide, block_tables = make_paged(seq_lens, 4, d, 32, torch.float32, g)
    k_cache, v_cache = k_wide[:, :, ::2], v_wide[:, :, ::2]  # H_kv 2, strided
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape)
    prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, sl, ref, d**-0.5, True)
    # sliced on the device: a copy of the strided view to another device would be contiguous
    k_dev, v_dev = k_wide.to(device)[:, :, ::2], v_wide.to(device)[:, :, ::2]
    assert not k_dev.is_contiguous()
    args = [q.to(device), k_dev, v_dev] + [t.to(device) for t in (block_tables, cu, sl)]
    out = torch.full(q.shape, float("nan"), device=device)
    prefill_attention(*args, out, d**-0.5, True)  # the interpreter's choice: KV_TMA at page 32
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]
    with pytest.raises(ValueError, match="contiguous"):
        prefill_attention(*args, out, d**-0.5, True, config={**TILES, "KV_TMA": True})


def test_block_table_exactly_as_wide_as_the_sequence(device):
    """Block tables of exactly cdiv(seq_len, page) columns (as the engine gathers them): the
    block-id prefetch must not read past the row (its load is masked at the key range's end)."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    seq_lens, q_lens, hq, hkv, d, page = [96, 64], [40, 64], 4, 2, 64, 32
    k_cache, v_cache, wide = make_paged(seq_lens, hkv, d, page, torch.float32, g)
    # one table row per sequence, no spare columns; the next sequence's row follows directly
    block_tables = wide[:, : max(-(-n // page) for n in seq_lens)].contiguous()
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu, sl = _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape)
    prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, sl, ref, d**-0.5, False)
    out = torch.full(q.shape, float("nan"), device=device)
    prefill_attention(
        *[t.to(device) for t in (q, k_cache, v_cache, block_tables, cu, sl)],
        out,
        d**-0.5,
        False,
        config={**TILES, "KV_TMA": True},
    )
    assert torch.isfinite(out).all() and rel_err(out.cpu(), ref) <= TOL[torch.float32]


def test_split_count_uses_the_launch_tiles(monkeypatch):
    """prefill_num_splits with the cache's page size sees the tiles the launch will run (the
    tma_split row here has BLOCK_M 32, so more query tiles, so fewer splits than the pointer
    row's BLOCK_M 128 would give)."""
    import kernels.prefill_split as ps

    table = {
        "bfloat16,128": {
            "split": {"BLOCK_M": 128, "BLOCK_N": 64},
            "tma_split": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4},
        }
    }
    monkeypatch.setattr(pa, "kernel_table", lambda kernel, name: table)
    monkeypatch.setattr(pa, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(pa, "kv_tma_available", lambda device: True)
    cuda = torch.device("cuda")
    args = (512, 16, 128, torch.bfloat16, cuda, 32768, 132)
    pointer = ps.prefill_num_splits(*args, num_kv_heads=8, page_size=16)
    tma = ps.prefill_num_splits(*args, num_kv_heads=8, page_size=128)
    assert tma < pointer, (tma, pointer)
