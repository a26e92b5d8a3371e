"""Shared fixtures: tiny random Qwen3/Qwen2/Qwen3-MoE checkpoints written by transformers (no
download)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on the CPU under the interpreter

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on the 2-core machine: one torch thread each, or their
    # OpenMP pools (two threads each) would spin-wait for each other's cores
    torch.set_num_threads(1)

#: the modules of `make test`'s parallel run that take longest (40-100 s each on the 2-core
#: machine, 2026-12), longest first: under xdist they are handed out first, so that neither
#: worker is left running one of them alone at the end (only the run time depends on this list)
LONGEST_FIRST = (
    "tests/reliability/test_security_and_shutdown.py",
    "tests/reliability/test_fuzz.py",
    "tests/integration/test_structured_outputs.py",
    "tests/unit/test_tensor_parallel.py",
    "tests/kernels/test_prefill_gqa_pack.py",
    "tests/kernels/test_fp8_gemm.py",
    "tests/integration/test_api_sampling.py",
    "tests/integration/test_prometheus.py",
    "tests/kernels/test_triton_backend.py",
    "tests/unit/test_model_compile.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`'s parallel run: ``--dist loadfile
    --no-loadscope-reorder`` hands out whole modules in collection order, where xdist would
    otherwise start with the modules of the most tests): the modules of :data:`LONGEST_FIRST`
    first, every other test in pytest's order (after its grouping by parametrized session
    fixtures)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def tiny_hf_model(
    model_type: str, seed: int, tie: bool, head_dim: int = 32, random_norms: bool = False
):
    """A random tiny ``model_type`` ("qwen3" or "qwen2") transformers model in float32: weights
    drawn N(0, 0.08) so greedy choices are well separated, and with ``random_norms`` norm
    weights U(0.8, 1.2) (a dropped norm then shows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            elif random_norms and name.endswith("weight"):
                p.uniform_(0.8, 1.2)
    return model


def write_tiny_checkpoint(path, model_type: str, seed: int, tie: bool):
    """Write a random tiny ``model_type`` checkpoint with transformers (:func:`tiny_hf_model`);
    returns the HF model (float32)."""
    model = tiny_hf_model(model_type, seed, tie)
    model.save_pretrained(path)
    return model


#: the tiny Qwen3-MoE of the tests: 4 layers (layer 2 dense through mlp_only_layers), hidden
#: 128, 8 experts of 64 features, top-2 renormalised, untied embeddings
TINY_MOE = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=160,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[2],
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def write_tiny_moe_checkpoint(path, seed: int = 4321, **overrides):
    """Write a random tiny Qwen3-MoE checkpoint with transformers' ``save_pretrained`` (one
    tensor per expert, the Hub layout); returns the HF model (float32, eval)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_MOE, **overrides})).float().eval()
    # std 0.2: greedy runs of 32 tokens use ~28 distinct ids (0.08 repeats 2-10 ids), so the
    # generation tests compare varied sequences
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of transformers' ``generate`` for one prompt (no EOS stop). The
    attention mask is explicit: generate would otherwise mask prompt tokens equal to the pad
    id."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    """(path, transformers model) of the tiny Qwen3-MoE (:data:`TINY_MOE`)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    return str(path), write_tiny_moe_checkpoint(path)


@pytest.fixture(
    scope="session", params=[("qwen3", True), ("qwen2", False)], ids=["qwen3-tied", "qwen2-untied"]
)
def tiny_checkpoint(request, tmp_path_factory):
    model_type, tie = request.param
    path = tmp_path_factory.mktemp(model_type)
    model = write_tiny_checkpoint(path, model_type, seed=1234, tie=tie)
    return str(path), model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's small tensor work on one torch thread: faster than two, and the suite
    shares 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_served_checkpoint(tiny_checkpoint, tmp_path_factory):
    """``tiny_checkpoint``'s weights with a tiny byte-level BPE tokenizer (vocab 384), so the
    server (and transformers' AutoTokenizer) can load it: (directory, HF model)."""
    from tests.tiny_tokenizer import servable_copy

    path, model = tiny_checkpoint
    return servable_copy(path, tmp_path_factory.mktemp("served")), model
