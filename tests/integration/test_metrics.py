"""/metrics after a known set of requests: every counter, gauge and histogram count checked."""

from __future__ import annotations

import time

import httpx
import pytest

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess

P = "qwen_serve:"


@pytest.fixture(scope="module")
def fresh_server():
    srv = ServerProcess("--max-model-len", "512", "--num-kv-blocks", "64").wait_ready()
    yield srv
    srv.stop()


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _settle(base: str) -> dict:
    for _ in range(50):
        m = scrape(base)
        if m[P + "num_requests_running"] == 0 and m[P + "num_free_kv_blocks"] == num_kv_blocks(m):
            return m
        time.sleep(0.1)
    return m


def test_gauges_have_values_before_the_first_request(fresh_server):
    """A fresh, idle server (the in-thread engine, the CPU default) shows its whole KV cache
    free: the engine loop publishes its state before any step (it read 0 free blocks until the
    first request; found by a new-user trial)."""
    m = scrape(fresh_server.base_url)
    assert m[P + "num_free_kv_blocks"] == num_kv_blocks(m) == 64
    assert m[P + "num_requests_running"] == 0 and m[P + "num_requests_waiting"] == 0


def test_metrics_match_what_was_sent(fresh_server):
    base = fresh_server.base_url
    tok = Tokenizer(ensure_embedded_checkpoint())
    m0 = scrape(base)
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 can be cached

    # A, B: same prompt, 7 tokens each (length); B reuses A's two full blocks from the prefix cache
    for _ in range(2):
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 7, "ignore_eos": True, "temperature": 0},
            timeout=60,
        )
        assert r.json()["usage"]["completion_tokens"] == 7
    # C: forced first token that is also a stop token -> finish "stop" after 1 token
    forced = tok.encode(" blue")[0]
    chat = {
        "messages": [{"role": "user", "content": "colour?"}],
        "max_tokens": 5,
        "temperature": 0,
        "logit_bias": {str(forced): 100},
        "stop_token_ids": [forced],
    }
    rc = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
    assert rc["choices"][0]["finish_reason"] == "stop" and rc["usage"]["completion_tokens"] == 1
    prompt_c = rc["usage"]["prompt_tokens"]
    m1 = _settle(base)

    assert _delta(m1, m0, P + "request_success_total{finished_reason=length}") == 2
    assert _delta(m1, m0, P + "request_success_total{finished_reason=stop}") == 1
    assert _delta(m1, m0, P + "e2e_request_latency_seconds_count") == 3
    assert _delta(m1, m0, P + "time_to_first_token_seconds_count") == 3
    assert _delta(m1, m0, P + "request_queue_time_seconds_count") == 3
    assert _delta(m1, m0, P + "request_prompt_tokens_count") == 3
    assert _delta(m1, m0, P + "request_prompt_tokens_sum") == 40 + 40 + prompt_c
    assert _delta(m1, m0, P + "request_generation_tokens_sum") == 7 + 7 + 1
    assert _delta(m1, m0, P + "generation_tokens_total") == 15
    # prompt tokens as vLLM counts them: every prompt token, B's 32 cached ones included
    assert _delta(m1, m0, P + "prompt_tokens_total") == 40 + 40 + prompt_c
    assert _delta(m1, m0, P + "prefix_cache_hits_total") == 32
    assert _delta(m1, m0, P + "prefix_cache_queries_total") == 40 + 40 + prompt_c
    assert _delta(m1, m0, P + "inter_token_latency_seconds_count") == 6 + 6 + 0
    # the tokens the engine computed: A's 40, B's 8 after its 32 cached ones, C's whole prompt
    assert _delta(m1, m0, P + "iteration_tokens_total_sum") == 40 + 8 + prompt_c + 15
    assert _delta(m1, m0, P + "num_preemptions_total") == 0
    assert m1[P + "num_requests_running"] == 0 and m1[P + "num_requests_waiting"] == 0
    assert m1[P + "kv_cache_usage_perc"] == 0.0
    assert m1[P + "num_free_kv_blocks"] == 64 == num_kv_blocks(m1)
    assert m1["process_resident_memory_bytes"] > 0
    info = next(k for k in m1 if k.startswith(P + "model_info{"))
    assert "max_model_len=512" in info and "block_size=16" in info and "dtype=float32" in info

    # D: a stream the client abandons -> one abort, blocks freed
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 300, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    m2 = _settle(base)
    assert _delta(m2, m1, P + "request_success_total{finished_reason=abort}") == 1
    assert _delta(m2, m1, P + "e2e_request_latency_seconds_count") == 1
    assert m2[P + "num_free_kv_blocks"] == 64
    assert _delta(m2, m1, P + "generation_tokens_total") < 300


@pytest.mark.parametrize(
    "prompts",
    [[[1, 2, 3], [4, 5], [999999999]], [[1, 2], [5] * 600], [[7, 8], []]],
    ids=["bad-token-id", "too-long", "empty"],
)
def test_a_bad_prompt_in_a_list_queues_none(fresh_server, prompts):
    """A list of prompts with a bad one after good ones is refused before any is queued: a 400
    naming ``prompt``, and no request counted (none started, none aborted)."""
    base = fresh_server.base_url
    m0 = _settle(base)
    r = httpx.post(base + "/v1/completions", json={"prompt": prompts, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    m1 = _settle(base)
    for key in (
        "request_success_total{finished_reason=abort}",
        "e2e_request_latency_seconds_count",
        "prompt_tokens_total",
    ):
        assert _delta(m1, m0, P + key) == 0, key
