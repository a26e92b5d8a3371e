"""``python -m server --model file.gguf``: a tiny Qwen2 GGUF (Q8_0, written by gguf-py's
GGUFWriter) served over HTTP answers with transformers' greedy tokens for the same file."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.frontend.tokenizer import Tokenizer
from engine.loader.gguf_loader import prepare_gguf_model_dir
from tests.conftest import hf_greedy
from tests.gguf_helpers import write_tiny_gguf
from tests.serverproc import ServerProcess
from tests.unit.test_gguf import _tiny_hf


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("gguf-http")
    path = write_tiny_gguf(d / "tiny-q8_0.gguf", _tiny_hf("qwen2", tie=False), "qwen2", "Q8_0")
    ref = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32)
    cache = d / "cache"
    srv = ServerProcess(
        "--model",
        str(path),
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        env={"QWEN_SERVE_CACHE": str(cache)},
    ).wait_ready(180)
    yield srv, path, ref.eval(), cache
    srv.stop()


def test_served_under_the_file_name_with_transformers_greedy_tokens(gguf_server, monkeypatch):
    srv, path, ref, cache = gguf_server
    models = httpx.get(srv.base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-q8_0.gguf"]
    monkeypatch.setenv("QWEN_SERVE_CACHE", str(cache))
    tok = Tokenizer(prepare_gguf_model_dir(path))  # the folder the server prepared
    prompt = tok.encode("The cat sat on the")
    r = httpx.post(
        srv.base_url + "/v1/completions",
        json={"model": "tiny-q8_0.gguf", "prompt": prompt, "max_tokens": 10, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_greedy(ref, prompt, 10)
    eos = [i for i, t in enumerate(want) if t in tok.eos_token_ids]
    if eos:
        want = want[: eos[0] + 1]
    assert body["usage"]["completion_tokens"] == len(want)
    assert body["choices"][0]["text"] == tok.decode(want)
