"""Shared fixtures: tiny random Qwen3/Qwen2 checkpoints written by transformers (no download)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on the CPU under the interpreter

import pytest
import torch


def write_tiny_checkpoint(path, model_type: str, seed: int, tie: bool):
    """Write a random tiny ``model_type`` checkpoint with transformers; returns the HF model
    (float32)."""
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
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model = model.float().eval()
    with torch.no_grad():  # make the random model less flat so greedy choices are well separated
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model


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
