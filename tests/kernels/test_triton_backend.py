"""TritonAttentionBackend against the torch backend over a chunked-prefill + decode sequence, and
against the reference on padded mixed steps (decode rows through the decode kernel)."""

import os

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.registry import default_backend_name, get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels.decode_attention import choose_mixed_splits, choose_num_splits
from kernels.reference import prefill_attention_ref, rms_norm_ref, rope_ref, store_kv_cache_ref

from .test_prefill_attention import make_paged, rel_err


def _meta(block_tables, ctx_lens, q_lens, block_size, device, pad=0):
    slots, cu = [], [0]
    for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c, c + n):
            slots.append(int(block_tables[b, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + n)
    slots += [-1] * pad  # padding tokens are not stored
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode=max(q_lens) == 1 and min(q_lens) == 1,
    )


def test_backend_selection():
    assert get_attention_backend("triton").name == "triton"
    assert isinstance(get_attention_backend("triton"), TritonAttentionBackend)
    assert get_attention_backend(default_backend_name("cpu")).name == "torch"
    assert default_backend_name("cuda") == "triton"
    assert get_attention_backend("torch") is get_attention_backend("torch")  # one instance per name
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


@pytest.mark.parametrize(
    "dtype,bs",
    # 64-token pages hold whole key tiles: the prefill launches take the KV_TMA loads
    [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 64)],
)
def test_triton_backend_matches_torch_backend(device, dtype, bs):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, num_blocks = 8, 2, 64, 24
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    block_tables = torch.randperm(num_blocks, generator=g)[:16].view(2, 8).to(torch.int32)
    # the torch backend (the oracle) runs in float32 on the CPU on upcast copies of the inputs
    ref_k = torch.zeros(num_blocks, bs, hkv, d)
    ref_v = torch.zeros(num_blocks, bs, hkv, d)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    torch_be, triton_be = TorchAttentionBackend(), TritonAttentionBackend()
    # two chunks of prefill (the second attends to the cached first chunk), then 3 decode steps
    steps = [
        ([0, 0], [20, 33]),
        ([20, 33], [17, 1]),
        ([37, 34], [1, 1]),
        ([38, 35], [1, 1]),
        ([39, 36], [1, 1]),
    ]
    scratch_ids = set()
    for ctx_lens, q_lens in steps:
        t = sum(q_lens)
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
        ref = torch_be.forward(
            q.float(),
            k.float(),
            v.float(),
            ref_k,
            ref_v,
            _meta(block_tables, ctx_lens, q_lens, bs, "cpu"),
            d**-0.5,
        )
        meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
        out = triton_be.forward(
            q.to(device), k.to(device), v.to(device), k_cache, v_cache, meta, d**-0.5
        )
        assert out.shape == (t, hq, d) and out.dtype == dtype
        err = ((out.cpu().float() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"step {ctx_lens}+{q_lens}: rel err {err:.2e} (seed={seed})"
        assert torch.equal(k_cache.cpu(), ref_k.to(dtype)) and torch.equal(
            v_cache.cpu(), ref_v.to(dtype)
        )
        scratch_ids |= {id(buf[0]) for buf in triton_be._scratch.values()}
    assert len(scratch_ids) <= 1  # decode scratch allocated once and reused


@pytest.mark.parametrize(
    "dtype,num_sms,max_seq_len,split_mixed",
    [
        (torch.float32, 4, None, True),  # one decode split
        (
            torch.bfloat16,
            64,
            2048,
            True,
        ),  # several splits (max_seq_len as a captured graph passes it)
        (torch.float32, 4, None, False),  # the single prefill launch
    ],
)
def test_triton_backend_mixed_step_matches_reference(
    device, dtype, num_sms, max_seq_len, split_mixed
):
    """A mixed step (decodes + prompt chunks, cached prefixes, padding tokens past cu_seqlens_q[B]
    and padding sequences with stale block tables) equals prefill_attention_ref on every real row,
    whether the decode rows go through the decode kernel or the prefill kernel."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 8, 2, 64, 16
    q_lens = [1, 20, 1, 1, 3, 1, 0, 0]  # the last two: padding sequences
    # 1,100 cached keys: with several splits, the mixed step's decode launch fills 3 splits of
    # MIXED_MIN_SPLIT_KEYS (512) keys for that row and one for the others
    ctx_lens = [1100, 5, 0, 60, 0, 16, 0, 0]
    pad_tokens = 7
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, bs, dtype, g)
    num_blocks = k_cache.shape[0]
    pad_seqs = [i for i, n in enumerate(q_lens) if not n]
    # stale values of earlier steps in the padding sequences' rows (a graph's static buffers)
    block_tables[pad_seqs] = torch.randint(
        0, num_blocks, (len(pad_seqs), block_tables.shape[1]), generator=g, dtype=torch.int32
    )
    t = sum(q_lens)
    q = torch.randn(t + pad_tokens, hq, d, generator=g).to(dtype)
    k = torch.randn(t + pad_tokens, hkv, d, generator=g).to(dtype)
    v = torch.randn(t + pad_tokens, hkv, d, generator=g).to(dtype)
    meta = _meta(block_tables, ctx_lens, q_lens, bs, "cpu", pad=pad_tokens)
    meta.seq_lens[pad_seqs] = torch.randint(1, 40, (len(pad_seqs),), generator=g, dtype=torch.int32)
    if max_seq_len is not None:
        meta.max_seq_len = max_seq_len
    if num_sms == 64:
        assert choose_mixed_splits(len(q_lens), hkv, meta.max_seq_len, num_sms)[0] > 2

    ref_k, ref_v = k_cache.float(), v_cache.float()
    store_kv_cache_ref(k.float(), v.float(), ref_k, ref_v, meta.slot_mapping)
    ref = torch.zeros(t, hq, d)
    prefill_attention_ref(
        q[:t].float(), ref_k, ref_v, block_tables, meta.cu_seqlens_q, meta.seq_lens, ref, d**-0.5
    )

    be = TritonAttentionBackend(split_mixed_steps=split_mixed)
    be._num_sms[torch.device(device)] = num_sms
    dev_meta = AttentionMetadata(
        **{f: (x.to(device) if isinstance(x, torch.Tensor) else x) for f, x in vars(meta).items()}
    )
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    out = be.forward(
        q.to(device), k.to(device), v.to(device), k_cache, v_cache, dev_meta, d**-0.5
    ).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dec_rows = [int(meta.cu_seqlens_q[i]) for i, n in enumerate(q_lens) if n == 1]
    for name, rows in (("all rows", list(range(t))), ("decode rows", dec_rows)):
        err = rel_err(out[rows], ref[rows])
        assert err <= tol, f"{name}: rel err {err:.2e} (seed={seed})"


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "qwen2"])
@pytest.mark.parametrize("fused_decode", [False, True], ids=["store-launch", "decode-prologue"])
def test_forward_qk_rope_matches_torch_backend(device, norm, fused_decode, monkeypatch):
    """forward_qk_rope (one Triton launch for q/k norm, rotary and the store) against the torch
    backend's reference composition over prefill chunks and decode steps, q/k/v strided views
    of one projection output; and the fused torch path equals the unfused one step for step.
    decode-prologue: the pure decode steps do that work in the decode launch itself."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, num_blocks = 8, 2, 64, 16, 24
    block_tables = torch.randperm(num_blocks, generator=g)[:16].view(2, 8).to(torch.int32)
    ref_k = torch.zeros(num_blocks, bs, hkv, d)
    ref_v = torch.zeros_like(ref_k)
    unf_k, unf_v = ref_k.clone(), ref_v.clone()
    k_cache, v_cache = ref_k.clone().to(device), ref_v.clone().to(device)
    q_w, k_w = 1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g)
    weights = (q_w, k_w) if norm else (None, None)
    torch_be = TorchAttentionBackend()
    triton_be = TritonAttentionBackend(fused_decode_qk_rope=fused_decode)
    steps = [([0, 0], [20, 33]), ([20, 33], [17, 1]), ([37, 34], [1, 1]), ([38, 35], [1, 1])]
    calls = []  # per decode launch: did it take the raw projections?
    import engine.attention.triton_backend as tb

    real = tb.decode_attention

    def counted(*a, **kw):
        calls.append(kw.get("qk_rope") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(tb, "decode_attention", counted)
    for ctx_lens, q_lens in steps:
        t = sum(q_lens)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        pos = torch.tensor([p for c, n in zip(ctx_lens, q_lens) for p in range(c, c + n)])
        freqs = torch.outer(pos.float(), 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        meta = _meta(block_tables, ctx_lens, q_lens, bs, "cpu")
        ref = torch_be.forward_qk_rope(
            q, k, v, ref_k, ref_v, meta, d**-0.5, cos, sin, *weights, 1e-6
        )
        # the unfused path: the model's norm + rotary, then forward
        qn, kn = (rms_norm_ref(q, q_w, 1e-6), rms_norm_ref(k, k_w, 1e-6)) if norm else (q, k)
        qr, kr = rope_ref(qn, kn, cos, sin)
        unfused = torch_be.forward(qr, kr, v.contiguous(), unf_k, unf_v, meta, d**-0.5)
        assert torch.equal(ref_k, unf_k), (ref_k - unf_k).abs().max()
        assert torch.equal(ref, unfused), (ref - unfused).abs().max()
        dev = lambda x: None if x is None else x.to(device)  # noqa: E731
        out = triton_be.forward_qk_rope(
            dev(q),
            dev(k),
            dev(v),
            k_cache,
            v_cache,
            _meta(block_tables, ctx_lens, q_lens, bs, device),
            d**-0.5,
            dev(cos),
            dev(sin),
            *map(dev, weights),
            1e-6,
        )
        assert out.shape == (t, hq, d)
        err = rel_err(out.cpu(), ref)
        assert err <= 1e-5, f"step {ctx_lens}+{q_lens}: rel err {err:.2e} (seed={seed})"
        torch.testing.assert_close(k_cache.cpu(), ref_k, rtol=1e-5, atol=1e-5)
        assert torch.equal(v_cache.cpu(), ref_v)
    # prefill, mixed (its decode rows), then two pure decode steps
    assert calls == [False, False, fused_decode, fused_decode]


def test_triton_backend_split_prefill_over_long_prefix(device):
    """A prompt chunk over a long cached prefix with decodes beside it (the step that underfills
    the GPU) takes the prefill kernel's split-KV mode: the output equals the reference on every
    real row, and two steps share one scratch buffer; split_prefill=False gives the same rows."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, dtype = 4, 2, 64, 16, torch.float32
    steps = [([1, 40, 1], [90, 300, 17]), ([1, 25, 1], [91, 340, 18])]
    seq_lens = [c + n for c, n in zip(*steps[-1][::-1])]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, bs, dtype, g)
    be, plain = TritonAttentionBackend(), TritonAttentionBackend(split_prefill=False)
    be._num_sms[torch.device(device)] = 64
    buffers = set()
    for q_lens, ctx_lens in steps:
        t = sum(q_lens)
        q = torch.randn(t, hq, d, generator=g)
        k = torch.randn(t, hkv, d, generator=g)
        v = torch.randn(t, hkv, d, generator=g)
        meta = _meta(block_tables, ctx_lens, q_lens, bs, "cpu")
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        store_kv_cache_ref(k, v, ref_k, ref_v, meta.slot_mapping)
        ref = torch.zeros(t, hq, d)
        prefill_attention_ref(
            q, ref_k, ref_v, block_tables, meta.cu_seqlens_q, meta.seq_lens, ref, d**-0.5
        )
        dev_meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
        splits, _, _ = be.prefill_splits(q.to(device), dev_meta)
        assert splits > 1
        outs = []
        for backend in (be, plain):
            kc, vc = k_cache.to(device), v_cache.to(device)
            outs.append(
                backend.forward(
                    q.to(device), k.to(device), v.to(device), kc, vc, dev_meta, d**-0.5
                ).cpu()
            )
        for out in outs:
            err = rel_err(out, ref)
            assert err <= 1e-5, f"step {ctx_lens}+{q_lens}: rel err {err:.2e} (seed={seed})"
        buffers |= {buf.data_ptr() for buf in be._prefill_scratch.values()}
        k_cache, v_cache = ref_k, ref_v
    assert len(buffers) == 1 and not plain._prefill_scratch


@pytest.mark.parametrize("slots", [3, 20], ids=["few-slots", "many-slots"])
def test_mixed_and_decode_steps_take_their_split_rules(device, monkeypatch, slots):
    """The decode launch of a mixed step of at most 16 sequence slots takes
    ``choose_mixed_splits`` (long-context splits, ``min_split_keys`` 512); a wider mixed step
    and a pure decode step take ``choose_num_splits`` of their slots with ``min_split_keys`` 0."""
    import engine.attention.triton_backend as tb

    calls = []
    real = tb.decode_attention

    def recording(*args, **kwargs):
        calls.append((args[9], kwargs.get("min_split_keys", 0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(tb, "decode_attention", recording)
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs, sms, max_len = 4, 2, 32, 16, 132, 40960
    be = TritonAttentionBackend()
    be._num_sms[torch.device(device)] = sms
    for q_lens in ([1] * (slots - 1) + [5], [1] * slots):  # mixed, then pure decode
        ctx_lens = [3] * slots
        seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
        k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, bs, torch.float32, g)
        meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
        meta.max_seq_len = max_len  # as a captured graph passes it
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, d, generator=g).to(device) for h in (hq, hkv, hkv))
        be.forward(q, k, v, k_cache.to(device), v_cache.to(device), meta, d**-0.5)
    mixed = choose_mixed_splits(slots, hkv, max_len, sms)
    if slots <= 16:
        assert mixed[1] == 512 and mixed[0] > choose_num_splits(slots, hkv, max_len, sms)
    else:
        assert mixed == (choose_num_splits(slots, hkv, max_len, sms), 0)
    assert calls == [mixed, (choose_num_splits(slots, hkv, max_len, sms), 0)]


@pytest.mark.parametrize("q_len", [7, 1], ids=["prompt-chunk", "one-token-chunk"])
def test_one_slot_step_launches_no_decode_kernel(device, monkeypatch, q_len):
    """A step of one sequence slot (a lone prompt, or a chunk of it, in the lone prefill graphs)
    has no mixed decode rows to split off: no decode launch, and the prefill launch computes
    every row -- a one-token chunk that samples nothing included -- equal to the reference."""
    import engine.attention.triton_backend as tb

    calls = []
    monkeypatch.setattr(tb, "decode_attention", lambda *a, **kw: calls.append(a) or 1 / 0)
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, pad = 4, 2, 32, 16, 5
    ctx_lens, q_lens = [40], [q_len]
    k_cache, v_cache, block_tables = make_paged([40 + q_len], hkv, d, bs, torch.float32, g)
    meta = _meta(block_tables, ctx_lens, q_lens, bs, "cpu", pad=pad)
    meta.max_seq_len = 4096  # as a captured graph passes it
    meta.max_query_len = q_len + pad  # (the padded token count: not a decode step)
    meta.is_decode = False
    q, k, v = (torch.randn(q_len + pad, h, d, generator=g) for h in (hq, hkv, hkv))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_cache_ref(k, v, ref_k, ref_v, meta.slot_mapping)
    ref = torch.zeros(q_len, hq, d)
    prefill_attention_ref(
        q[:q_len], ref_k, ref_v, block_tables, meta.cu_seqlens_q, meta.seq_lens, ref, d**-0.5
    )
    be = TritonAttentionBackend()
    dev_meta = AttentionMetadata(
        **{f: (x.to(device) if isinstance(x, torch.Tensor) else x) for f, x in vars(meta).items()}
    )
    out = be.forward(
        q.to(device), k.to(device), v.to(device), k_cache.to(device), v_cache.to(device),
        dev_meta, d**-0.5,
    ).cpu()  # fmt: skip
    assert not calls
    err = rel_err(out[:q_len], ref)
    assert err <= 1e-5, f"rel err {err:.2e} (seed={seed})"


def test_wide_mixed_step_of_short_contexts_runs_the_prefill_unsplit(device):
    """More than 16 sequence slots with every context within UNSPLIT_MAX_KEYS: the prefill
    launch takes no split (its grid would be slots x heads x splits of mostly empty programs);
    the same step at a long max_seq_len (a graph of the model length), or with 3 slots, splits;
    the unsplit output equals the reference."""
    from kernels.prefill_split import UNSPLIT_MAX_KEYS

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    hq, hkv, d, bs = 4, 2, 64, 16
    be = TritonAttentionBackend()
    be._num_sms[torch.device(device)] = 64
    for slots, max_len, want_split in (
        (20, None, False), (20, 40960, True), (3, UNSPLIT_MAX_KEYS, True),
    ):  # fmt: skip
        q_lens, ctx_lens = [1] * (slots - 1) + [40], [90] * (slots - 1) + [300]
        seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
        k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, bs, torch.float32, g)
        meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
        if max_len is not None:
            meta.max_seq_len = max_len
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
        splits, _, _ = be.prefill_splits(q.to(device), meta)
        assert (splits > 1) == want_split, (slots, max_len, splits)
        if not want_split:
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            cpu_meta = _meta(block_tables, ctx_lens, q_lens, bs, "cpu")
            store_kv_cache_ref(k, v, ref_k, ref_v, cpu_meta.slot_mapping)
            ref = torch.zeros(t, hq, d)
            prefill_attention_ref(
                q, ref_k, ref_v, block_tables, cpu_meta.cu_seqlens_q, cpu_meta.seq_lens, ref,
                d**-0.5,
            )  # fmt: skip
            out = be.forward(
                q.to(device), k.to(device), v.to(device), k_cache.to(device),
                v_cache.to(device), meta, d**-0.5,
            ).cpu()  # fmt: skip
            assert rel_err(out, ref) <= 1e-5


def test_max_decode_splits_caps_pure_decode_launches(device, monkeypatch):
    """``max_decode_splits`` (``QWEN_SERVE_DECODE_MAX_SPLITS``) caps the split count of a pure
    decode launch, the decode partials' included; with 1 the launch writes the output without
    a merge, equal to the uncapped backend's result."""
    import engine.attention.triton_backend as tb

    calls = []
    real = tb.decode_attention

    def recording(*args, **kwargs):
        calls.append(args[9])
        return real(*args, **kwargs)

    monkeypatch.setattr(tb, "decode_attention", recording)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    hq, hkv, d, bs = 4, 2, 32, 16
    ctx_lens, q_lens = [300, 70], [1, 1]
    seq_lens = [c + 1 for c in ctx_lens]
    k_cache, v_cache, block_tables = make_paged(seq_lens, hkv, d, bs, torch.float32, g)
    meta = _meta(block_tables, ctx_lens, q_lens, bs, device)
    q = torch.randn(2, hq, d, generator=g).to(device)
    kv = [torch.randn(2, hkv, d, generator=g).to(device) for _ in range(2)]
    outs = []
    monkeypatch.setenv("QWEN_SERVE_DECODE_MAX_SPLITS", "1")
    for be in (TritonAttentionBackend(max_decode_splits=64), TritonAttentionBackend()):
        be._num_sms[torch.device(device)] = 132
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        outs.append(be.forward(q, *kv, kc, vc, meta, d**-0.5))
        want = 1 if len(outs) == 2 else choose_num_splits(2, hkv, 1 << 30, 132)
        assert be.partial_splits(2, hkv, torch.device(device)) == want
    assert calls[0] > 1 and calls[1] == 1
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("QWEN_SERVE_DECODE_MAX_SPLITS", "0")
    with pytest.raises(ValueError, match="QWEN_SERVE_DECODE_MAX_SPLITS='0'"):
        TritonAttentionBackend()
    with pytest.raises(ValueError, match="max_decode_splits must be >= 1"):
        TritonAttentionBackend(max_decode_splits=0)
