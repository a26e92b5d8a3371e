"""The tiny Qwen3-MoE served over HTTP (openai client): 8 concurrent greedy completions of 32
tokens through a KV cache small enough to preempt, each equal to transformers' generate of its
prompt alone; the model in /v1/models, the info metric and the start-up log."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from tests.conftest import hf_greedy, write_tiny_moe_checkpoint
from tests.metricsutil import scrape
from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe-tiny")
    hf = write_tiny_moe_checkpoint(path)
    embedded = ensure_embedded_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ids < 384 are byte tokens
        shutil.copy(embedded / name, path / name)
    srv = ServerProcess(
        "--model",
        str(path),
        "--num-kv-blocks",
        "16",
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "512",
        "--no-prefix-caching",
    ).wait_ready()
    yield srv, hf, path
    srv.stop()


def test_concurrent_greedy_completions_match_transformers(moe_server):
    srv, hf, path = moe_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list().data]
    assert model == path.name
    gen = torch.Generator().manual_seed(23)
    prompts = [
        torch.randint(0, 384, (n,), generator=gen).tolist() for n in (3, 9, 17, 24, 31, 40, 12, 5)
    ]

    def complete(p):
        r = client.completions.create(model=model, prompt=p, max_tokens=32, temperature=0.0)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(complete, prompts))
    tok = Tokenizer(path)
    for p, (text, n) in zip(prompts, answers, strict=True):
        assert n == 32 and text == tok.decode(hf_greedy(hf, p, 32))

    m = scrape(srv.base_url)
    assert m["qwen_serve:num_preemptions_total"] >= 1
    info = next(k for k in m if k.startswith("qwen_serve:model_info{"))
    assert "architecture=Qwen3MoeForCausalLM" in info and "num_experts=8" in info
    assert "load_format=auto" in info
    assert "3 sparse layers x 8 experts" in srv.log()
