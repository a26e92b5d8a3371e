"""Serving GGUF files directly (engine/loader/gguf_loader.py) against transformers reading the
same file (``from_pretrained(dir, gguf_file=...)``, which dequantizes with gguf-py too).

The files are tiny random Qwen3/Qwen2 models written by transformers and then by gguf-py's
``GGUFWriter`` (tests/gguf_helpers.py) in F32, F16 and the quantized Q8_0 / Q4_0 (gguf-py's
``quantize``). The tiny Qwen3 has ``head_dim`` 128: transformers' GGUF config mapping ignores
``qwen3.attention.key_length`` and assumes Qwen3Config's default 128 (true of every released
Qwen3), so a smaller head would make transformers, not the engine, build the wrong model.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from engine.loader.gguf_loader import prepare_gguf_model_dir
from engine.worker.build import build_engine
from tests.conftest import hf_greedy, tiny_hf_model
from tests.engine_helpers import logits_for
from tests.gguf_helpers import write_tiny_gguf

CASES = [
    ("qwen3", "F32"),
    ("qwen3", "Q8_0"),
    ("qwen2", "F16"),
    ("qwen2", "Q8_0"),
    ("qwen2", "Q4_0"),
]


def _tiny_hf(arch: str, tie: bool):
    # head_dim 128: transformers' GGUF reader ignores qwen3.attention.key_length
    return tiny_hf_model(arch, 1234, tie, head_dim=128, random_norms=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Prepared GGUF folders go to the test's temporary directory."""
    monkeypatch.setenv("QWEN_SERVE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{q}" for a, q in CASES])
def gguf_case(request, tmp_path_factory):
    """(gguf path, transformers model read from that GGUF, the original model, qtype)."""
    from transformers import AutoModelForCausalLM

    arch, qtype = request.param
    d = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    original = _tiny_hf(arch, tie=arch == "qwen3")
    path = write_tiny_gguf(d / "tiny.gguf", original, arch, qtype)
    ref = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="tiny.gguf", dtype=torch.float32)
    return path, ref.eval(), original, qtype


def _engine(path):
    return build_engine(
        EngineConfig(model=str(path), num_kv_blocks=64, block_size=16, max_num_batched_tokens=4096),
        eos_token_ids=frozenset(),
    )


def test_prefill_logits_equal_transformers_reading_the_gguf(gguf_case):
    path, ref, original, qtype = gguf_case
    eng = _engine(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 266, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
    logits = logits_for(eng, eng.scheduler.schedule())
    offset = 0
    for p in prompts:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0].float()
            unquantized = original(torch.tensor([p])).logits[0].float()
        got = logits[offset : offset + len(p)]
        offset += len(p)
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-4, f"relative error {rel:.2e} against transformers (length {len(p)})"
        if qtype not in ("F32", "F16"):  # the quantized file is another model: it shows
            assert ((got - unquantized).norm() / unquantized.norm()).item() > 1e-3


def test_greedy_ids_equal_transformers(gguf_case):
    path, ref, _, _ = gguf_case
    eng = _engine(path)
    prompt = [257, 40, 263, 70, 266, 12]
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out == hf_greedy(ref, prompt, 12)


def test_tokenizer_config_and_eos_from_the_metadata(tmp_path):
    """The prepared tokenizer encodes like transformers' tokenizer of the same GGUF; the chat
    template, EOS and config come from the file."""
    import json

    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tok.gguf", _tiny_hf("qwen2", tie=False), "qwen2", "F32")
    d = prepare_gguf_model_dir(path)
    tok = Tokenizer(d)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ("The cat sat", "the  cat\n\tThe", "<|im_start|>user\nhi<|im_end|>", "é 你 🙂"):
        assert tok.encode(text) == ref(text)["input_ids"], text
    assert tok.decode(tok.encode("the  cat\n\tThe é")) == "the  cat\n\tThe é"
    messages = [{"role": "user", "content": "The cat"}]
    want = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)) == want
    # <|im_end|> (the file's eos_token_id) and <|endoftext|> (llama.cpp's end-of-generation
    # texts); <|im_start|> is a CONTROL token that ends nothing
    assert tok.eos_token_ids == {256 + 8 + 2, 256 + 8}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is True and cfg["num_key_value_heads"] == 2
    assert prepare_gguf_model_dir(path) == d  # cached


def test_refuses_other_architectures(tmp_path):
    path = write_tiny_gguf(tmp_path / "llama.gguf", _tiny_hf("qwen2", tie=False), "llama", "F32")
    with pytest.raises(ValueError, match="architecture 'llama' is not supported"):
        _engine(path)


def test_refuses_tensor_types_gguf_py_cannot_dequantize(tmp_path):
    path = write_tiny_gguf(tmp_path / "q81.gguf", _tiny_hf("qwen2", tie=False), "qwen2", "Q8_1")
    with pytest.raises(ValueError, match=r"type Q8_1, which gguf-py cannot dequantize"):
        _engine(path)
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (p / "config.json").exists() for p in (tmp_path / "cache" / "gguf").iterdir()
    )


def test_build_script_conversion_equals_transformers_reading_the_gguf(gguf_case, tmp_path):
    """scripts/build_real_checkpoint.py converts with the same functions: its float32
    directory, loaded by transformers, equals transformers' model of the GGUF."""
    import importlib.util
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path, ref, _, _ = gguf_case
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_real_checkpoint.py"
    spec = importlib.util.spec_from_file_location("build_real_checkpoint", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "converted"
    out.mkdir()
    facts = mod.convert_model(Path(path), out, "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert "gguf_file" not in cfg and cfg["torch_dtype"] == "float32"
    assert facts["tied"] == ref.config.tie_word_embeddings
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["temperature"] == mod.DEFAULT_SAMPLING["temperature"]  # the script's policy
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[257, 40, 263, 70, 266, 12, 300]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_quantization_fp8_of_a_gguf_equals_fp8_of_the_same_safetensors(tmp_path):
    """``--quantization fp8`` on a GGUF: block FP8 of its dequantized weights, the same
    engine logits as ``--quantization fp8`` on a safetensors directory holding those weights
    (the tiny FP8 shape of tests/fp8_checkpoint.py: whole 128-blocks)."""
    from tests.fp8_checkpoint import write_hf_qwen3

    hf = write_hf_qwen3(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "fp8.gguf", hf, "qwen3", "F32")

    def logits(model):
        eng = build_engine(
            EngineConfig(model=str(model), num_kv_blocks=32, block_size=16, quantization="fp8"),
            eos_token_ids=frozenset(),
        )
        assert eng.executor.model_config.quantization is not None
        eng.add_request("r", [257, 40, 263, 70, 266, 12], SamplingParams(max_tokens=1))
        return logits_for(eng, eng.scheduler.schedule())

    from_gguf, from_dir = logits(path), logits(tmp_path / "hf")
    torch.testing.assert_close(from_gguf, from_dir, rtol=0, atol=1e-5)
    with torch.no_grad():
        full = hf(torch.tensor([[257, 40, 263, 70, 266, 12]])).logits[0]
    assert ((from_gguf - full).norm() / full.norm()).item() > 1e-4  # it is quantized
