"""One-token decode steps of a dense bf16 Qwen3 model through the persistent launch
(``engine/models/persistent_decode.py``) against the model's own layer loop, on the CPU under
the Triton interpreter (one program runs every phase): the hidden states after a prompt, the
token's k/v in every layer's cache, the fallback of batched decode and prompt steps, and the
models it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.loader.dummy import init_random_weights
from engine.models import persistent_decode
from engine.models.qwen3 import Qwen3ForCausalLM
from kernels.interpreter import interpreting
from tests.unit.test_model_compile import (
    BLOCK,
    NUM_BLOCKS,
    _config,
    _step,
    tiny_qwen3_dir,  # noqa: F401 (the checkpoint fixture)
)


def _bf16_config(**over):
    return dataclasses.replace(_config(), dtype="bfloat16", **over)


def _model(cfg, seed=0):
    with torch.device("cpu"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            m = Qwen3ForCausalLM(cfg, 512, "torch", compile_mode="none")
        finally:
            torch.set_default_dtype(prev)
    init_random_weights(m, seed, std=0.08)
    return m.eval()


def _caches(cfg):
    shape = (NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [
        (torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
        for _ in range(cfg.num_hidden_layers)
    ]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative error ``|got - want| / |want|`` (Frobenius norms, float32)."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture
def interpreter():
    if not interpreting():
        pytest.skip("the CPU path of the persistent kernel needs TRITON_INTERPRET=1")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "pre_kv": True, "pre_w": True, "early_res": True, "late_r": False, "block_k": 16,
            "block_k_h": 64, "merge_c": True, "dot_attn": False,
        },
        {"pre_kv": True, "row_sm": True, "late_r": True, "block_t": 16},
        {"row_sm_after": 23},
        {"row_sm": False, "dot_attn": False},
        {"row_sm": False},
        {"dot_attn": False, "row_sm_after": 23},
    ],
    ids=["default", "layout", "rows", "rows-by-context", "heads", "dot-heads", "cuda-by-context"],
)  # fmt: skip
def test_decode_steps_match_the_layer_loop(interpreter, monkeypatch, options):
    """``options``: :func:`persistent_decode.build`'s layout options, passed on to every launch
    (the first K/V tile, weight chunks and residual rows loaded early, a narrower K chunk, a
    wider one for the o and down projections, the splits merged by the last one: the same
    arithmetic, bit-equal; the attention's softmax per row and the norm scales applied late --
    the default --, 16-token tiles: float32 sums in another order, close); the softmax per row
    for every step, for none, or by
    context (the steps at contexts over ``row_sm_after``: here 24 and 25 of 22-25), the
    per-head loop on tensor cores (``dot_attn``, the default: its steps only, not the per-row
    ones) or on CUDA cores (``dot_attn`` off).
    ``build`` compiles (launches once) each layout it will run: both by context, one when
    forced."""
    # DOT by default (the test shape takes it: a GQA group of 2, 16-dim heads)
    dot_on = options.get("dot_attn", persistent_decode.DEFAULT_FLAGS["dot_attn"])
    exact = options.get("late_r") is False and not (options.get("row_sm") or dot_on)
    cfg = _bf16_config()
    loop, fast = _model(cfg), _model(cfg)
    fast.load_state_dict(loop.state_dict())
    caches_loop = _caches(cfg)
    caches_fast = [(k.clone(), v.clone()) for k, v in caches_loop]
    launched = []  # each launch's row_sm (build's, then the steps': the layout their context chose)
    dots = []  # and its dot_attn
    merges = set()  # and its merge_c
    real = persistent_decode.persistent_layers

    def recorded(*args, **kw):
        launched.append(kw["row_sm"])
        dots.append(kw["dot_attn"])
        merges.add(kw.get("merge_c", False))
        return real(*args, **kw)

    monkeypatch.setattr(persistent_decode, "persistent_layers", recorded)
    assert fast.enable_persistent_decode(caches_fast, BLOCK, **options) is None
    row_sm = options.get("row_sm")
    assert launched == ([False, True] if row_sm is None else [row_sm])
    assert dots == [dot_on and not r for r in launched]
    launched.clear()
    dots.clear()
    state = fast.persistent_decode
    assert state is not None
    given = {k: v for k, v in options.items() if k in persistent_decode.LAYOUT_FLAGS}
    given.pop("row_sm", None)
    assert state.flags == {**persistent_decode.DEFAULT_FLAGS, **given}
    assert state.row_sm_after == (
        options.get("row_sm_after", persistent_decode.ROW_SM_AFTER) if row_sm is None
        else 0 if row_sm else persistent_decode.NEVER
    )  # fmt: skip
    assert state.block_t == options.get("block_t", 32)
    # (no width given: the widest power of two up to BLOCK_K_H dividing FF = 128 and HQ D = 64)
    assert state.block_k_h == options.get("block_k_h", 64)
    assert state.block_k == options.get("block_k", persistent_decode._widest(
        persistent_decode._BLOCK_KS, cfg.hidden_size, cfg.intermediate_size,
        cfg.num_attention_heads * cfg.head_dim,
    ))  # fmt: skip
    calls = [0]
    forward = fast.persistent_decode.forward

    def counted(*args):
        calls[0] += 1
        return forward(*args)

    fast.persistent_decode.forward = counted
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        # a prompt (the layer loop in both), then decode steps of one sequence
        ids, pos, meta = _step(gen, [21], [0])
        torch.testing.assert_close(
            fast(ids, pos, caches_fast, meta), loop(ids, pos, caches_loop, meta)
        )
        for n in range(21, 25):
            ids, pos, meta = _step(gen, [1], [n])
            want = loop(ids, pos, caches_loop, meta)
            got = fast(ids, pos, caches_fast, meta)
            assert got.shape == want.shape == (1, cfg.hidden_size)
            # the kernel rounds where eager torch does and, under the interpreter, sums in
            # the layer loop's order: the same bits (unless the options reorder the sums)
            if exact:
                assert torch.equal(got, want), n
            else:  # (bf16 roundings of other values: compared as a whole)
                assert _rel(got, want) < 2e-2, n
            for (kf, vf), (kl, vl) in zip(caches_fast, caches_loop):
                if exact:
                    assert torch.equal(kf, kl) and torch.equal(vf, vl)
                else:
                    assert _rel(kf, kl) < 2e-2 and _rel(vf, vl) < 2e-2, n
        assert calls == [4]
        want_rows = {None: [False] * 4, True: [True] * 4, False: [False] * 4}[row_sm]
        if "row_sm_after" in options:
            want_rows = [False, False, True, True]  # contexts 22, 23 | 24, 25 (over 23)
        assert launched == want_rows
        assert dots == [dot_on and not r for r in want_rows]
        assert merges == {bool(options.get("merge_c"))}
        # two sequences decoding: the layer loop (the persistent path not called)
        ids, pos, meta = _step(gen, [1, 1], [25, 3])
        fast_out = fast(ids, pos, caches_fast, meta)
        assert calls == [4]
        assert torch.equal(fast_out, fast._forward_impl(ids, pos, caches_fast, meta))


def test_refuses_models_it_cannot_run(interpreter):
    caches = _caches(_bf16_config())
    qwen2 = _model(_bf16_config(qk_norm=False, attention_bias=True))
    assert "Qwen3" in qwen2.enable_persistent_decode(caches, BLOCK)
    assert qwen2.persistent_decode is None
    f32 = Qwen3ForCausalLM(_config(), 512, "torch", compile_mode="none")
    f32_caches = [(k.float(), v.float()) for k, v in caches]
    assert "bf16" in f32.enable_persistent_decode(f32_caches, BLOCK)
    odd = _model(_bf16_config(num_attention_heads=6, num_key_value_heads=3))
    assert "powers of two" in persistent_decode.unsupported_reason(odd, caches)
    with pytest.raises(ValueError, match="unavailable: head counts"):
        persistent_decode.build(odd, caches, BLOCK)


def test_layout_options_from_the_environment_and_a_bad_block_k(interpreter):
    from engine.layers import kernel_switches

    assert kernel_switches.PERSISTENT_FLAGS == persistent_decode.LAYOUT_FLAGS
    assert kernel_switches.persistent_options({}) == {}  # unset: build's defaults
    flags = {"QWEN_SERVE_PERSISTENT_PRE_W": "0", "QWEN_SERVE_PERSISTENT_ROW_SM": "on"}
    assert kernel_switches.persistent_options(flags) == {"pre_w": False, "row_sm": True}
    dot = {"QWEN_SERVE_PERSISTENT_DOT_ATTN": "1", "QWEN_SERVE_PERSISTENT_MERGE_C": "1"}
    assert kernel_switches.persistent_options(dot) == {"dot_attn": True, "merge_c": True}
    with pytest.raises(ValueError, match="QWEN_SERVE_PERSISTENT_LATE_R"):
        kernel_switches.persistent_options({"QWEN_SERVE_PERSISTENT_LATE_R": "maybe"})
    env = {
        "QWEN_SERVE_PERSISTENT_MAX_CONTEXT": "2048", "QWEN_SERVE_PERSISTENT_BLOCK_K": "64",
        "QWEN_SERVE_PERSISTENT_ROW_SM_AFTER": "300",
    }  # fmt: skip
    got = kernel_switches.persistent_options(env)
    assert got == {"max_context": 2048, "block_k": 64, "row_sm_after": 300}
    with pytest.raises(ValueError, match="QWEN_SERVE_PERSISTENT_BLOCK_K"):
        kernel_switches.persistent_options({"QWEN_SERVE_PERSISTENT_BLOCK_K": "0"})
    cfg = _bf16_config()
    m = _model(cfg)
    reason = m.enable_persistent_decode(_caches(cfg), BLOCK, block_k=48)
    assert "block_k 48 must divide" in reason and m.persistent_decode is None
    assert "power of two" in m.enable_persistent_decode(_caches(cfg), BLOCK, block_t=24)
    assert "unknown layout options ['pre_q']" in m.enable_persistent_decode(
        _caches(cfg), BLOCK, pre_q=True
    )
    assert "block_k_h 48 must be a power of two" in m.enable_persistent_decode(
        _caches(cfg), BLOCK, block_k_h=48
    )
    assert "row_sm_after -1 must be" in m.enable_persistent_decode(
        _caches(cfg), BLOCK, row_sm_after=-1
    )
    # no o/down K chunk given: the widest power of two dividing FF (here 96: 32) and HQ x D (64)
    narrow = _model(_bf16_config(intermediate_size=96))
    assert narrow.enable_persistent_decode(_caches(cfg), BLOCK) is None
    assert narrow.persistent_decode.block_k_h == 32
    assert m.enable_persistent_decode(_caches(cfg), BLOCK, max_context=77) is None
    assert m.persistent_decode.max_context == 77
    # the context bounds of the two layouts (the decode graphs' batch-1 twins)
    pd = m.persistent_decode
    assert (pd.row_sm_after, pd.context_bounds) == (persistent_decode.ROW_SM_AFTER, (77,))
    pd.max_context = 2048
    assert pd.context_bounds == (persistent_decode.ROW_SM_AFTER, 2048)
    assert [pd.launch_flags(n)["row_sm"] for n in (1, 512, 513, 2048)] == [0, 0, 1, 1]
    # DOT by default: the per-head loop's option, so not with the per-row softmax
    assert pd.flags["dot_attn"] is True
    assert [pd.launch_flags(n)["dot_attn"] for n in (1, 512, 513, 2048)] == [1, 1, 0, 0]
    assert pd.dot_attn_contexts() == f"up to {persistent_decode.ROW_SM_AFTER} tokens"
    n = persistent_decode.ROW_SM_AFTER
    assert pd.layout_summary() == (  # (the start-up line's and engine_check's words)
        f"attention softmax per row: over {n} tokens; attention on tensor cores: up to {n} "
        "tokens; splits merged by the last one: no"
    )
    pd.flags["dot_attn"] = False
    assert pd.dot_attn_contexts() == "never" and not pd.launch_flags(1)["dot_attn"]
    assert pd.row_sm_contexts() == f"over {persistent_decode.ROW_SM_AFTER} tokens"
    pd.row_sm_after = 0
    assert pd.context_bounds == (2048,) and pd.row_sm_contexts() == "always"
    pd.flags["dot_attn"] = True
    assert pd.dot_attn_contexts() == "never" and not pd.launch_flags(1)["dot_attn"]
    # forced off: no step runs the per-row layout, whatever the bound becomes
    assert m.enable_persistent_decode(_caches(cfg), BLOCK, max_context=77, row_sm=False) is None
    pd = m.persistent_decode
    pd.max_context = 4096
    assert pd.context_bounds == (4096,) and not pd.launch_flags(4096)["row_sm"]
    assert pd.row_sm_contexts() == "never"
    pd.flags["dot_attn"] = True
    assert pd.dot_attn_contexts() == "always" and pd.launch_flags(4096)["dot_attn"]


def test_tensor_core_attention_only_where_the_shape_takes_it(interpreter):
    """``DOT`` is on by default where ``tl.dot`` takes the shape (heads of 16 dims or more, a
    GQA group of at most 16): a model with 8-dim heads gets the per-head loop on CUDA cores,
    and asking for ``DOT`` there is refused with the reason."""
    from kernels.persistent_decode import dot_attn_fits

    assert dot_attn_fits(16, 8, 128, 32) and dot_attn_fits(32, 2, 16, 16)
    assert not dot_attn_fits(34, 2, 128, 32)  # a group of 17
    assert not dot_attn_fits(16, 8, 8, 32) and not dot_attn_fits(16, 8, 128, 8)
    cfg = _bf16_config(head_dim=8)
    m = _model(cfg)
    assert m.enable_persistent_decode(_caches(cfg), BLOCK) is None
    assert m.persistent_decode.flags["dot_attn"] is False
    assert "dot_attn needs" in m.enable_persistent_decode(_caches(cfg), BLOCK, dot_attn=True)


def test_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(persistent_decode, "interpreting", lambda: False)
    m = _model(_bf16_config())
    assert "CUDA" in persistent_decode.unsupported_reason(m, _caches(_bf16_config()))


def _tiny_engine(monkeypatch, model_dir, persistent: bool, asked: bool | None = None):
    """The tiny bf16 checkpoint's engine (32 KV blocks) built with
    ``QWEN_SERVE_PERSISTENT_DECODE``'s value patched to ``persistent``, set explicitly
    (``asked``; None: when ``persistent``) or left at its default."""
    from engine.core.config import EngineConfig
    from engine.layers import kernel_switches
    from engine.worker.build import build_engine

    monkeypatch.setattr(kernel_switches, "PERSISTENT_DECODE", persistent)
    asked = persistent if asked is None else asked
    monkeypatch.setattr(kernel_switches, "PERSISTENT_DECODE_ASKED", asked)
    return build_engine(
        EngineConfig(model=model_dir, num_kv_blocks=32, block_size=BLOCK, dtype="bfloat16"),
        eos_token_ids=frozenset(),
    )


def test_engine_greedy_outputs_equal_with_the_switch(
    interpreter,
    monkeypatch,
    tiny_qwen3_dir,  # noqa: F811 (the imported fixture)
):
    """The whole engine (``QWEN_SERVE_PERSISTENT_DECODE``'s value patched in): one sequence's
    greedy tokens are the same with the persistent path as with the layer loop, two at once
    (batched decode: the layer loop) too, and the runner says it applied it."""
    from engine.core.request import SamplingParams

    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (13, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = {}
    for on in (False, True):
        eng = _tiny_engine(monkeypatch, tiny_qwen3_dir, on)
        assert (eng.executor.model.persistent_decode is not None) is on
        outs[on] = (eng.generate(prompts[:1], params), eng.generate(prompts, params))
    assert outs[True] == outs[False]


def test_default_is_cuda_only_and_spilling_kernels_are_refused(
    interpreter,
    monkeypatch,
    tiny_qwen3_dir,  # noqa: F811 (the imported fixture)
):
    """The switch at its default (on, not set): an engine off CUDA (here the interpreter) keeps
    the layer loop; asked for, it takes the path. A kernel that spills more than the bound the
    default passes is refused (the larger models' shapes, never measured), with any bound off
    when asked for; where only the layout with ``DOT`` spills, the default drops ``DOT``, not
    the path, and ``DOT`` asked for is refused."""
    eng = _tiny_engine(monkeypatch, tiny_qwen3_dir, True, asked=False)
    assert eng.executor.model.persistent_decode is None
    eng = _tiny_engine(monkeypatch, tiny_qwen3_dir, True, asked=True)
    assert eng.executor.model.persistent_decode is not None
    real = persistent_decode.persistent_layers

    def spilling(*args, info=None, **kw):  # the compiled kernel's report, as on a GPU
        out = real(*args, info=info, **kw)
        if info is not None:
            info["spills"] = 1400
        return out

    monkeypatch.setattr(persistent_decode, "persistent_layers", spilling)
    cfg = _bf16_config()
    m = _model(cfg)
    reason = m.enable_persistent_decode(_caches(cfg), BLOCK, max_spill_bytes=64)
    assert "spills 1400 B per thread" in reason and m.persistent_decode is None
    assert m.enable_persistent_decode(_caches(cfg), BLOCK, max_spill_bytes=None) is None

    def spilling_dot(*args, info=None, **kw):  # only the layout with DOT spills
        out = real(*args, info=info, **kw)
        if info is not None:
            info["spills"] = 1400 if kw["dot_attn"] else 0
        return out

    monkeypatch.setattr(persistent_decode, "persistent_layers", spilling_dot)
    # DOT by default: dropped rather than the path; asked for: refused
    assert m.enable_persistent_decode(_caches(cfg), BLOCK, max_spill_bytes=64) is None
    assert m.persistent_decode.flags["dot_attn"] is False
    reason = m.enable_persistent_decode(_caches(cfg), BLOCK, max_spill_bytes=64, dot_attn=True)
    assert "spills 1400 B per thread" in reason and m.persistent_decode is None


def _decode_meta(table: list[int], n_before: int, slot_override: int | None = None):
    """A one-token decode step of one sequence with ``n_before`` cached tokens over blocks
    ``table`` (any order): ``(positions, meta)``."""
    pos = n_before
    slot = table[pos // BLOCK] * BLOCK + pos % BLOCK if slot_override is None else slot_override
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot], dtype=torch.int64),
        block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=pos + 1,
        is_decode=True,
    )
    return torch.tensor([pos], dtype=torch.int64), meta


@pytest.mark.parametrize("slot_override", [None, -1])
def test_scattered_blocks_and_a_padding_slot(interpreter, slot_override):
    """Blocks of the sequence out of order in the cache (the pages the kernel gathers), and a
    negative slot (a padding row: nothing stored, by either path; its output is not used, and
    the two paths differ there: the loop attends to whatever the cache holds at the new
    position, the kernel to the new key from registers). The norm scales applied where eager
    torch applies them (``late_r`` off) and the attention on CUDA cores (``dot_attn`` off): the
    same bits."""
    cfg = _bf16_config()
    loop, fast = _model(cfg, seed=5), _model(cfg)
    fast.load_state_dict(loop.state_dict())
    caches_loop = _caches(cfg)  # random keys/values: every block holds "earlier tokens"
    caches_fast = [(k.clone(), v.clone()) for k, v in caches_loop]
    before = [(k.clone(), v.clone()) for k, v in caches_loop]
    assert fast.enable_persistent_decode(caches_fast, BLOCK, late_r=False, dot_attn=False) is None
    table = [37, 5, 22, 11]
    pos, meta = _decode_meta(table, 3 * BLOCK + 6, slot_override)
    ids = torch.tensor([17])
    with torch.inference_mode():
        want = loop(ids, pos, caches_loop, meta)
        got = fast(ids, pos, caches_fast, meta)
    assert torch.equal(got, want) or slot_override == -1
    for (kf, vf), (kl, vl), (kb, vb) in zip(caches_fast, caches_loop, before):
        assert torch.equal(kf, kl) and torch.equal(vf, vl)
        assert (torch.equal(kf, kb) and torch.equal(vf, vb)) is (slot_override == -1)


@pytest.mark.parametrize(
    "options", [{}, {"dot_attn": False}, {"merge_c": True}, {"row_sm": True}],
    ids=["default", "cuda-cores", "merge-c", "rows"],
)  # fmt: skip
@pytest.mark.parametrize("context", [21, 300])
def test_decode_steps_close_to_the_layer_loop_on_gpu(context, options):
    """On a GPU of compute capability 9.0+ (compiled kernels, the SM count's programs, the
    splits merged across programs, by phase D or by their last split's atomics with
    ``merge_c``; the attention's per-head loop on tensor cores by default, on CUDA cores with
    ``dot_attn`` off, per row with ``row_sm``):
    hidden states and each written key and value close to the layer loop's by relative norm
    (the sums run in another order than cuBLAS's and the fused GEMVs': a lone element of a
    row that cancels, amplified by the q/k norm, can differ by several bf16 ulps, so elements
    are not compared one by one), every other cache slot untouched, with the blocks
    scattered."""
    if not torch.cuda.is_available() or interpreting():
        pytest.skip("needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the persistent path needs compute capability 9.0+")
    cfg = _bf16_config()
    loop, fast = _model(cfg, seed=11), _model(cfg)
    fast.load_state_dict(loop.state_dict())
    loop, fast = loop.cuda(), fast.cuda()
    caches_loop = [(k.cuda(), v.cuda()) for k, v in _caches(cfg)]
    caches_fast = [(k.clone(), v.clone()) for k, v in caches_loop]
    assert fast.enable_persistent_decode(caches_fast, BLOCK, **options) is None
    table = torch.randperm(NUM_BLOCKS)[: -(-(context + 4) // BLOCK)].tolist()
    with torch.inference_mode():
        for n in range(context, context + 4):
            pos, meta = _decode_meta(table, n)
            meta = AttentionMetadata(*(
                getattr(meta, f.name).cuda() if torch.is_tensor(getattr(meta, f.name))
                else getattr(meta, f.name) for f in dataclasses.fields(meta)
            ))  # fmt: skip
            ids = torch.tensor([n % 300], device="cuda")
            want = loop(ids, pos.cuda(), caches_loop, meta)
            got = fast(ids, pos.cuda(), caches_fast, meta)
            rel = _rel(got, want)
            assert rel < 2e-2, (n, rel)
            block, offset = table[n // BLOCK], n % BLOCK
            for layer, ((kf, vf), (kl, vl)) in enumerate(zip(caches_fast, caches_loop)):
                for name, f, lp in (("k", kf, kl), ("v", vf, vl)):
                    rel = _rel(f[block, offset], lp[block, offset])
                    assert rel < 2e-2, (n, layer, name, rel)
    untouched = torch.ones(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for n in range(context, context + 4):
        untouched[table[n // BLOCK], n % BLOCK] = False
    untouched = untouched.cuda()
    for (kf, vf), (kl, vl) in zip(caches_fast, caches_loop):  # nothing else written
        for f, lp in ((kf, kl), (vf, vl)):
            assert torch.equal(f[untouched], lp[untouched])


def test_long_contexts_take_the_layer_loop(interpreter):
    """A one-token step whose context exceeds the persistent path's ``max_context`` runs the
    layer loop (the kernel's attention phase grows faster with the context than the decode
    kernel's); within it, the persistent launch."""
    cfg = _bf16_config()
    m = _model(cfg, seed=2)
    caches = _caches(cfg)
    assert m.enable_persistent_decode(caches, BLOCK) is None
    m.persistent_decode.max_context = 2 * BLOCK
    calls = []
    forward = m.persistent_decode.forward
    m.persistent_decode.forward = lambda *a: calls.append(a[3].max_seq_len) or forward(*a)
    table = [9, 3, 14, 6]
    with torch.inference_mode():
        for n_before in (2 * BLOCK - 1, 2 * BLOCK, 3 * BLOCK + 5):
            pos, meta = _decode_meta(table, n_before)
            got = m(torch.tensor([5]), pos, caches, meta)
            assert got.shape == (1, cfg.hidden_size)
            if n_before >= 2 * BLOCK:  # the layer loop's own output
                assert torch.equal(got, m._forward_impl(torch.tensor([5]), pos, caches, meta))
    assert calls == [2 * BLOCK]  # context 2 * BLOCK only (the others: 2 * BLOCK + 1, ...)


def test_decode_graphs_route_batch_one_by_context(
    interpreter,
    monkeypatch,
    tiny_qwen3_dir,  # noqa: F811 (the imported fixture)
):
    """The decode graphs' batch-1 twins (``(1, bound)`` for the persistent path's two layouts'
    context bounds, here 15 and 17) serve one-sequence steps up to each bound (the smallest
    that fits) and batch 1's own graph (the layer loop) the longer ones, the padded forwards
    run eagerly on the CPU: a request whose context crosses the bounds while decoding gets the
    layer loop's greedy tokens, and the persistent launch runs only for the steps within the
    bounds, in the per-head layout up to 15 and the per-row one above."""
    from engine.core.request import SamplingParams
    from engine.worker.cuda_graph import DecodeGraphs

    prompt = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=9)
    outs, seen = {}, []
    for on in (False, True):
        eng = _tiny_engine(monkeypatch, tiny_qwen3_dir, on)
        r = eng.executor
        if on:
            pd = r.model.persistent_decode
            pd.max_context, pd.row_sm_after = 17, 15
            pd.forward = lambda *a, f=pd.forward: seen.append(a[3].max_seq_len) or f(*a)
        graphs = DecodeGraphs(
            r.model, r.kv_caches, eng.config.max_num_seqs, r.block_tables.width,
            r.cache_info.max_model_len,
        )  # fmt: skip
        assert graphs.twin_keys == ([(1, 15), (1, 17)] if on else [])
        r.graphs = graphs
        outs[on] = eng.generate([prompt], params)
    assert outs[True] == outs[False]
    # a model length between the bounds: one twin (batch 1's own graph holds the longer layout)
    graphs = DecodeGraphs(r.model, r.kv_caches, eng.config.max_num_seqs, r.block_tables.width, 16)
    assert graphs.twin_keys == [(1, 15)]
    # decode steps at contexts 14..21 (the prompt's 13, then one more each): a twin's bound
    # is the persistent launch's metadata for the steps up to it, the rest ran the loop
    assert seen == [15, 15, 17, 17]  # contexts 14, 15 | 16, 17
