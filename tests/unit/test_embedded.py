"""The embedded random-weight Qwen3 checkpoint: files, config, weights, concurrent first build."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.loader.embedded import (
    ADDED_TOKENS,
    CHECKPOINT_FILES,
    CHECKPOINT_NAME,
    FIRST_ADDED_TOKEN_ID,
    STAMP_FILE,
    ensure_embedded_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return ensure_embedded_checkpoint()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_concurrent_builds_replace_stale_cache_and_match_default(tmp_path, ckpt):
    stale = tmp_path / CHECKPOINT_NAME  # as left by an older version of engine/embedded.py
    stale.mkdir()
    for name in CHECKPOINT_FILES:
        (stale / name).write_text("{}")
    (stale / STAMP_FILE).write_text(json.dumps({"fingerprint": "older code"}))
    code = (
        "import sys; from engine.loader.embedded import ensure_embedded_checkpoint as e; "
        "print(e(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert paths == {str(tmp_path / CHECKPOINT_NAME)}
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]  # no temp dirs left
    built = tmp_path / CHECKPOINT_NAME
    for name in (*CHECKPOINT_FILES, STAMP_FILE):
        assert _sha(built / name) == _sha(ckpt / name), name  # deterministic (fixed seed)
    assert ensure_embedded_checkpoint(tmp_path) == built  # cached: returns at once


def test_env_var_sets_cache_root(tmp_path, monkeypatch, ckpt):
    monkeypatch.setenv("QWEN_SERVE_CACHE", str(tmp_path))
    (tmp_path / CHECKPOINT_NAME).symlink_to(ckpt)  # pretend it is built there
    assert ensure_embedded_checkpoint() == tmp_path / CHECKPOINT_NAME


def test_config_files(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    expect = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 151936,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expect} == expect
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643
    assert (gen["do_sample"], gen["temperature"], gen["top_p"], gen["top_k"]) == (
        True,
        0.6,
        0.95,
        20,
    )
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>"
    assert tc["bos_token"] is None and tc["model_max_length"] == 4096
    assert "<|im_start|>" in tc["chat_template"]
    dec = tc["added_tokens_decoder"]
    assert len(dec) == len(ADDED_TOKENS) == 26
    assert dec["151643"]["content"] == "<|endoftext|>" and dec["151645"]["content"] == "<|im_end|>"
    assert dec["151656"]["content"] == "<|video_pad|>" and dec["151656"]["special"] is True
    assert dec["151657"] == {
        "content": "<tool_call>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": False,
    }
    assert dec["151664"]["content"] == "<|file_sep|>"
    assert dec["151667"]["content"] == "<think>" and dec["151668"]["content"] == "</think>"
    assert all(v["special"] == (int(k) <= 151656) for k, v in dec.items())
    assert FIRST_ADDED_TOKEN_ID == 151643


def test_weights_names_shapes_and_init(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k_norm = f.get_tensor("model.layers.3.self_attn.k_norm.weight")
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert len(names) == 2 + 4 * 11 and "lm_head.weight" not in names  # tied
    assert shapes["model.embed_tokens.weight"] == (151936, 256)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (256, 256)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (128, 256)
    assert shapes["model.layers.2.self_attn.v_proj.weight"] == (128, 256)
    assert shapes["model.layers.2.self_attn.o_proj.weight"] == (256, 256)
    assert shapes["model.layers.2.self_attn.q_norm.weight"] == (64,)
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == (768, 256)
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (256, 768)
    assert shapes["model.norm.weight"] == (256,)
    assert emb.dtype == torch.float32
    assert abs(emb[:151669].std().item() - 0.02) < 0.001
    assert torch.all(emb[151669:] == 0)  # vocabulary padding rows
    assert 0.05 < q.std().item() < 0.11 and torch.all(k_norm == 1)


def test_loads_in_transformers_and_greedy_output_varies(ckpt):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(ckpt).eval()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        expected = set(f.keys())
    assert set(model.state_dict()) - {"lm_head.weight"} == expected
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[151644, 872, 198, 9707, 1879, 151645, 198, 151644, 77091, 198]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=151643)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 32 and len(set(new)) >= 16, new
