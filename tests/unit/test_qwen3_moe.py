"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM on a tiny random checkpoint it writes
(4 layers, hidden 128, 8 experts, top-2 renormalised, layer 2 dense through mlp_only_layers),
float32 on the CPU: logits, chunked prefill, greedy generation under preemption (sync and async
scheduling), prefix caching, the padded steps of prefill CUDA graphs, the fused Triton MoE kernel
inside the engine (interpreter), both checkpoint layouts of the experts, tensor-parallel slices
of the expert loader, and ``load_format="dummy"``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.core.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.layers.moe import FusedMoE, SparseMoE
from engine.worker.build import build_engine
from engine.worker.cuda_graph import PrefillGraphs
from tests.conftest import hf_greedy
from tests.engine_helpers import logits_for

VOCAB = 384


def _engine(path, **kw):
    cfg = dict(model=path, num_kv_blocks=64, block_size=16, max_num_batched_tokens=4096)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


def _prompts(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _prefill_rel_errors(eng, hf, prompts):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
    batch = eng.scheduler.schedule()
    assert len(batch.requests) == len(prompts)
    logits = logits_for(eng, batch)
    errors, offset = [], 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        got = logits[offset : offset + len(p)]
        offset += len(p)
        errors.append(((got - ref).norm() / ref.norm()).item())
    return errors


def test_config_reads_the_moe_fields(tiny_moe_checkpoint, tmp_path):
    path, _ = tiny_moe_checkpoint
    cfg = ModelConfig.from_hf(path)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
    assert cfg.norm_topk_prob and cfg.mlp_only_layers == (2,)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    # the Hub's spelling (num_experts) and a sparse step of 2
    raw = json.loads((tmp_path.parent / path / "config.json").read_text())
    raw.pop("num_local_experts", None)
    raw.update(num_experts=16, decoder_sparse_step=2, mlp_only_layers=[])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg2 = ModelConfig.from_hf(tmp_path)
    assert cfg2.num_experts == 16
    assert [cfg2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    raw.update(num_experts_per_tok=17)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(tmp_path)


def test_model_layout(tiny_moe_checkpoint):
    path, _ = tiny_moe_checkpoint
    model = _engine(path).executor.model
    mlps = [layer.mlp for layer in model.model.layers]
    assert [isinstance(m, SparseMoE) for m in mlps] == [True, True, False, True]
    assert mlps[0].experts.w13_weight.shape == (8, 128, 128)
    assert mlps[0].experts.w2_weight.shape == (8, 128, 64)
    assert mlps[0].experts.backend == "torch"  # the CPU engine runs the reference
    assert "3 sparse layers x 8 experts" in model.weight_summary()


def test_prefill_logits_match_transformers(tiny_moe_checkpoint, one_torch_thread):
    path, hf = tiny_moe_checkpoint
    errors = _prefill_rel_errors(_engine(path), hf, _prompts(7, [1, 7, 16, 33, 50]))
    assert max(errors) < 1e-4, errors


def test_chunked_prefill_and_decode_logits_match(tiny_moe_checkpoint, one_torch_thread):
    """A 41-token prompt over three 16-token chunks, then decoded."""
    path, hf = tiny_moe_checkpoint
    eng = _engine(path, max_num_batched_tokens=16)
    (prompt,) = _prompts(3, [41])
    req = eng.add_request("r", prompt, SamplingParams(max_tokens=4))
    chunks = []
    while req.num_computed_tokens < len(prompt):
        batch = eng.scheduler.schedule()
        chunks.append(logits_for(eng, batch))
        eng.scheduler.update_after_launch(batch, [])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    got = torch.cat(chunks)
    assert len(chunks) == 3
    assert ((got - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_generation_with_preemption_matches_transformers(
    tiny_moe_checkpoint, one_torch_thread, async_scheduling
):
    """8 concurrent prompts, 32 greedy tokens each, 16 KV blocks for up to 40 needed: the ids
    equal transformers' generate of one prompt at a time."""
    path, hf = tiny_moe_checkpoint
    prompts = _prompts(11, [3, 9, 17, 24, 31, 40, 12, 5])
    eng = _engine(
        path,
        num_kv_blocks=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert eng.scheduler.num_preemptions >= 1
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    for p, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(hf, p, 32)


def test_generation_equal_with_and_without_prefix_cache(tiny_moe_checkpoint, one_torch_thread):
    path, _ = tiny_moe_checkpoint
    (shared,) = _prompts(5, [37])
    prompts = [shared + t for t in _prompts(6, [1, 6, 20])] + [shared]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = _engine(path, enable_prefix_caching=False).generate(prompts, params)
    eng = _engine(path, enable_prefix_caching=True, async_scheduling=True)
    assert eng.generate(prompts[:1], params) + eng.generate(prompts[1:], params) == base
    assert eng.kv_cache_manager.prefix_hits >= 3 * 32


def test_padded_graph_steps_equal_eager_steps(tiny_moe_checkpoint, one_torch_thread):
    """The padded forward a prefill/mixed-step CUDA graph replays (run eagerly on the CPU):
    padding tokens go through the router and experts too, and change no real row."""
    path, _ = tiny_moe_checkpoint
    prompts = _prompts(13, [5, 30, 47, 2, 19])
    params = SamplingParams(temperature=0.0, max_tokens=6)
    eager = _engine(path, max_num_batched_tokens=40, max_num_seqs=4).generate(prompts, params)
    eng = _engine(path, max_num_batched_tokens=40, max_num_seqs=4)
    r = eng.executor
    r.prefill_graphs = PrefillGraphs(
        r.model, r.kv_caches, 40, 4, r.block_tables.width, r.cache_info.max_model_len, r.device
    )
    r.prefill_graphs.inputs.input_ids.random_(0, VOCAB)  # stale ids in the padding rows
    calls = []
    run = r.prefill_graphs.run
    r.prefill_graphs.run = lambda step: calls.append(step.num_tokens) or run(step)
    assert eng.generate(prompts, params) == eager
    assert calls and any(t % 16 for t in calls)  # padded steps ran


def test_triton_moe_kernel_in_the_engine_matches_transformers(tiny_moe_checkpoint):
    """Triton attention and the fused Triton MoE kernel (interpreter) inside the engine:
    prefill logits of two prompts, then a greedy continuation, against transformers."""
    path, hf = tiny_moe_checkpoint
    eng = _engine(path, attention_backend="triton", num_kv_blocks=16)
    assert eng.executor.model.model.layers[0].mlp.experts.backend == "triton"
    prompts = _prompts(17, [5, 19])
    errors = _prefill_rel_errors(eng, hf, prompts)
    assert max(errors) < 1e-4, errors
    eng = _engine(path, attention_backend="triton", num_kv_blocks=16)
    (out,) = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3))
    assert out == hf_greedy(hf, prompts[0], 3)


def test_stacked_expert_layout_loads_the_same_weights(tiny_moe_checkpoint, tmp_path):
    """transformers' in-memory names (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj``)
    load into the same parameters as the Hub's one tensor per expert."""
    path, hf = tiny_moe_checkpoint
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    a = _engine(path).executor.model.state_dict()
    b = _engine(str(tmp_path)).executor.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    experts = hf.model.layers[0].mlp.experts
    assert torch.equal(a["model.layers.0.mlp.experts.w13_weight"], experts.gate_up_proj)


def test_expert_loader_slices_tensor_parallel_ranks():
    """Rank r of 2 holds gate/up rows and down columns ``r * I/2 .. (r+1) * I/2``."""
    e, h, i = 4, 8, 6
    gate, up, down = torch.randn(i, h), torch.randn(i, h), torch.randn(h, i)
    for rank in (0, 1):
        m = FusedMoE(e, 2, h, i, True, "torch", tp_rank=rank, tp_size=2)
        m.weight_loader(m.w13_weight, gate, ("gate", 3))
        m.weight_loader(m.w13_weight, up, ("up", 3))
        m.weight_loader(m.w2_weight, down, ("down", 3))
        rows = slice(rank * 3, rank * 3 + 3)
        assert torch.equal(m.w13_weight[3], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(m.w2_weight[3], down[:, rows])
    with pytest.raises(ValueError, match="expert 4"):
        m.weight_loader(m.w2_weight, down, ("down", 4))
    with pytest.raises(ValueError, match="shard"):
        m.weight_loader(m.w2_weight, gate, ("gate", 0))
    with pytest.raises(ValueError, match="divisible"):
        FusedMoE(e, 2, h, 5, True, "torch", tp_size=2)


def test_dummy_load_format_needs_only_the_config(tiny_moe_checkpoint, tmp_path):
    """``load_format="dummy"``: built from config.json alone, weights a function of the seed."""
    path, _ = tiny_moe_checkpoint
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    prompts = _prompts(19, [9, 4])
    params = SamplingParams(temperature=0.0, max_tokens=5)

    def run(seed):
        eng = _engine(str(tmp_path), load_format="dummy", seed=seed)
        return eng.executor.model, eng.generate(prompts, params)

    (m0, out0), (m1, out1), (m2, _) = run(0), run(0), run(1)
    w = "model.layers.1.mlp.experts.w13_weight"
    assert torch.equal(m0.state_dict()[w], m1.state_dict()[w]) and out0 == out1
    assert not torch.equal(m0.state_dict()[w], m2.state_dict()[w])
    assert m0.state_dict()["model.norm.weight"].eq(1).all()
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model=str(tmp_path), load_format="pt")
