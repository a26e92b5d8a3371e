"""Whole-model ``torch.compile`` (``compile_mode="model"``) against the eager model, on the CPU.

Inductor compiles C++ here. The model is tiny (2 layers, hidden 64, 4/2 heads, head_dim 16,
vocab 300, float32); all tests of this module share one architecture, so Dynamo's cache (per
code object, shared by model instances) holds one set of graphs per attention backend.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.core.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.loader.dummy import init_random_weights
from engine.models.compile import EXPECTED_GRAPHS, compiled_graph_count
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.worker.build import build_engine

BLOCK = 16
NUM_BLOCKS = 48
VOCAB = 300


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo(one_torch_thread):
    """Start and leave Dynamo's cache empty (the recompile limit is per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        dtype="float32",
    )


def _models(backend: str = "torch"):
    """(eager, compiled) with the same random weights, attention through ``backend``."""
    eager = Qwen3ForCausalLM(_config(), 512, backend, compile_mode="none")
    init_random_weights(eager, 0, std=0.08)
    compiled = Qwen3ForCausalLM(_config(), 512, backend, compile_mode="model")
    compiled.load_state_dict(eager.state_dict())
    return eager.eval(), compiled.eval()


def _caches():
    shape = (NUM_BLOCKS, BLOCK, 2, 16)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]


def _step(gen: torch.Generator, q_lens: list[int], cached: list[int]):
    """Inputs of one step: sequence i has ``cached[i]`` tokens in the cache and ``q_lens[i]`` new
    ones; its blocks are 8*i, 8*i+1, ... (disjoint between sequences)."""
    tables, slots, positions, seq_lens, cu = [], [], [], [], [0]
    for i, (n_new, n_old) in enumerate(zip(q_lens, cached)):
        n = n_old + n_new
        table = list(range(8 * i, 8 * i + -(-n // BLOCK)))
        tables.append(table)
        for p in range(n_old, n):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        seq_lens.append(n)
        cu.append(cu[-1] + n_new)
    block_tables = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode=max(q_lens) == 1,
    )
    ids = torch.randint(0, VOCAB, (len(positions),), generator=gen)
    return ids, torch.tensor(positions, dtype=torch.int64), meta


def _random_shapes(gen: torch.Generator, i: int) -> tuple[list[int], list[int]]:
    """Step ``i`` of a mixed sequence: every third step a decode of 1-4 sequences, else
    prefill chunks of 2-24 tokens (a 1-token row sometimes mixed in) after 0-60 cached tokens."""
    b = 1 + i % 4
    cached = torch.randint(0, 60, (b,), generator=gen).tolist()
    if i % 3 == 2:
        return [1] * b, [c + 1 for c in cached]
    q = torch.randint(2, 25, (b,), generator=gen).tolist()
    if b > 1 and i % 2:
        q[0] = 1
    return q, cached


def _compare(backend_name: str, steps: int, seed: int) -> None:
    eager, compiled = _models(backend_name)
    caches_e, caches_c = _caches(), _caches()
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for i in range(steps):
            q_lens, cached = _random_shapes(gen, i)
            ids, pos, meta = _step(gen, q_lens, cached)
            want = eager(ids, pos, caches_e, meta)
            got = compiled(ids, pos, caches_c, meta)
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, i=i, q_lens=q_lens: f"step {i} {q_lens}: {m}",
            )
            for (ke, ve), (kc, vc) in zip(caches_e, caches_c):
                torch.testing.assert_close(kc, ke, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(vc, ve, rtol=1e-5, atol=1e-5)
    assert compiled._compiled._compiled is not None, "compilation failed and fell back to eager"


def test_compiled_model_matches_eager_torch_backend():
    _compare("torch", steps=12, seed=0)


def test_compiled_model_matches_eager_triton_backend():
    """The Triton kernels run inside the custom op under TRITON_INTERPRET=1 (set by conftest)."""
    _compare("triton", steps=5, seed=1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "qwen2"])
def test_fused_qk_rope_matches_unfused(backend, qk_norm):
    """``fuse_qk_rope`` (q/k norm + rotary + store inside the attention backend) against the
    model's own norm + rotary before the attention layer, eager: bit for bit with the torch
    backend (the same reference functions), within float32 rounding with the Triton kernel."""
    cfg = dataclasses.replace(_config(), qk_norm=qk_norm, attention_bias=not qk_norm)
    unfused = Qwen3ForCausalLM(cfg, 512, backend, compile_mode="none", fuse_qk_rope=False)
    init_random_weights(unfused, 0, std=0.08)
    fused = Qwen3ForCausalLM(cfg, 512, backend, compile_mode="none", fuse_qk_rope=True)
    fused.load_state_dict(unfused.state_dict())
    assert fused.fuse_qk_rope and not unfused.fuse_qk_rope
    default = Qwen3ForCausalLM(cfg, 512, backend, compile_mode="none")
    from engine.layers import kernel_switches

    assert default.fuse_qk_rope == (backend == "triton" and kernel_switches.FUSED_QK_ROPE)
    caches_u, caches_f = _caches(), _caches()
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for i in range(4):
            ids, pos, meta = _step(gen, *_random_shapes(gen, i))
            want = unfused(ids, pos, caches_u, meta)
            got = fused(ids, pos, caches_f, meta)
            if backend == "torch":
                assert torch.equal(got, want), f"step {i}"
                assert all(
                    torch.equal(a, b) for cu, cf in zip(caches_u, caches_f) for a, b in zip(cu, cf)
                )
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                for (ku, vu), (kf, vf) in zip(caches_u, caches_f):
                    torch.testing.assert_close(kf, ku, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(vf, vu, rtol=1e-5, atol=1e-5)  # from layer 2 on


def test_no_recompiles_across_varying_shapes():
    """After one prefill, one decode of 2+ sequences and one 1-token decode, 20 steps with new
    T, batch size, block-table width, max_query_len and max_seq_len compile nothing."""
    _, compiled = _models()
    caches = _caches()
    gen = torch.Generator().manual_seed(2)
    before = compiled_graph_count()
    with torch.inference_mode():
        for q_lens, cached in (([7, 3], [0, 20]), ([1, 1], [5, 40]), ([1], [9])):
            ids, pos, meta = _step(gen, q_lens, cached)
            compiled(ids, pos, caches, meta)
        warm = compiled_graph_count()
        assert warm - before <= EXPECTED_GRAPHS
        for i in range(20):
            ids, pos, meta = _step(gen, *_random_shapes(gen, i + 100))
            compiled(ids, pos, caches, meta)
    assert compiled_graph_count() == warm, "a step with new sizes recompiled the model"
    assert compiled._compiled._compiled is not None


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    """A compiler error logs a warning and the model runs (and keeps running) eagerly."""
    import torch._inductor.compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    eager, compiled = _models()
    eager.double()
    compiled.double()  # a dtype never compiled in this module: Dynamo must compile, and fails
    gen = torch.Generator().manual_seed(3)
    ids, pos, meta = _step(gen, [5, 9], [0, 17])
    caches = [(k.double(), v.double()) for k, v in _caches()]
    with (
        torch.inference_mode(),
        caplog.at_level(logging.WARNING, logger="engine.models.compile"),
        torch._dynamo.config.patch(suppress_errors=False),
    ):
        got = compiled(ids, pos, caches, meta)
        want = eager(ids, pos, [(k.double(), v.double()) for k, v in _caches()], meta)
    assert compiled._compiled._compiled is None
    assert any("running eagerly" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, want)


def test_unknown_compile_mode():
    with pytest.raises(ValueError, match="compile_mode"):
        Qwen3ForCausalLM(_config(), 64, "torch", compile_mode="yes")


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """A checkpoint of this module's architecture written by transformers."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    torch.manual_seed(4321)
    model = HFQwen3(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("qwen3-compile")
    model.float().save_pretrained(path)
    return str(path)


def test_engine_greedy_outputs_equal_with_and_without_compile(tiny_qwen3_dir):
    """Chunked prefill (token budget 24), mixed and pure decode steps: identical greedy ids."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    outs = {}
    for mode in ("none", "model"):
        eng = build_engine(
            EngineConfig(
                model=tiny_qwen3_dir,
                num_kv_blocks=32,
                block_size=BLOCK,
                max_num_batched_tokens=24,
                compile_mode=mode,
            ),
            eos_token_ids=frozenset(),
        )
        outs[mode] = eng.generate(prompts, params)
        if mode == "model":
            assert eng.executor.model._compiled._compiled is not None
    assert outs["model"] == outs["none"]
