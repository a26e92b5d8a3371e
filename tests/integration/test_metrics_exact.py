"""Token counters agree exactly with the per-request histograms after a mix of finished,
stopped-by-string, stopped-by-token, length-capped, aborted (an abort storm of streams closed
mid-way, some while queued), preempted, ``n > 1``, prefix-cached and score-only requests.

``prompt_tokens_total`` counts as vLLM does: every prompt token of every engine request, cache
hits included, once whatever the preemptions; so it is also known on the client side here (the
prompts are token ids). ``generation_tokens_total`` counts the tokens delivered to clients.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess

P = "qwen_serve:"
APPLE = 23268  # " apple", one token
IM_END = 151645


@pytest.fixture(scope="module")
def small_server():
    # 24 blocks x 16 tokens: six 150-token sequences at once do not fit -> preemption
    srv = ServerProcess(
        "--max-model-len", "512", "--num-kv-blocks", "24", "--max-num-seqs", "8"
    ).wait_ready()
    yield srv
    srv.stop()


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


async def _stream_then_close(client: httpx.AsyncClient, body: dict, chunks: int) -> None:
    """A client that reads ``chunks`` SSE events of a stream and goes away."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if seen >= chunks:
                break
            if line.startswith("data: "):
                seen += 1


def test_token_counters_equal_the_request_histograms_after_any_mix(small_server):
    base = small_server.base_url
    rng = random.Random(11)
    m0 = scrape(base)
    prompt_tokens = 0  # every engine request's prompt, known on the client side
    engine_requests = 0

    async def run():
        nonlocal prompt_tokens, engine_requests
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:

            async def complete(prompt, n=1, **kw):
                nonlocal prompt_tokens, engine_requests
                prompt_tokens += len(prompt) * n
                engine_requests += n
                body = {"prompt": prompt, "temperature": 0, "n": n, **kw}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            # the same prompt twice: the second takes prefix-cache hits (counted all the same)
            shared = _ids(rng, 70)
            await complete(shared, max_tokens=4, ignore_eos=True)
            await complete(shared, max_tokens=4, ignore_eos=True)

            work = []
            # length-capped long requests: together they exceed the KV cache -> preemptions
            for _ in range(6):
                work.append(complete(_ids(rng, 60), max_tokens=90, ignore_eos=True))
            # stopped by a string three tokens in (tokens after it are neither sent nor counted)
            work.append(
                complete(
                    _ids(rng, 20),
                    max_tokens=30,
                    logit_bias={str(APPLE): 100},
                    stop=[" apple apple apple"],
                )
            )
            # n > 1, sampled
            work.append(
                complete(_ids(rng, 25), n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
            )
            # score only: echo + logprobs, nothing generated
            work.append(complete(_ids(rng, 30), max_tokens=0, echo=True, logprobs=1))
            # an abort storm: streams closed after 0, 1 or 3 events (some while still queued)
            for i in range(24):
                prompt = _ids(rng, rng.randint(5, 80))
                prompt_tokens += len(prompt)
                engine_requests += 1
                body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True}
                work.append(_stream_then_close(client, body, [0, 1, 3][i % 3]))
            await asyncio.gather(*work)

            # stopped by a stop token (chat): the usage gives its prompt length
            chat = {
                "messages": [{"role": "user", "content": "colour?"}],
                "max_tokens": 5,
                "logit_bias": {str(IM_END): 100},
            }
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
            engine_requests += 1

    asyncio.run(run())

    deadline = time.monotonic() + 60
    while True:  # every engine request finished and observed, every block back
        m1 = scrape(base)
        done = _delta(m1, m0, P + "request_prompt_tokens_count") == engine_requests
        idle = m1[P + "num_requests_running"] == 0 and m1[P + "num_requests_waiting"] == 0
        if done and idle and m1[P + "num_free_kv_blocks"] == num_kv_blocks(m1):
            break
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.2)

    assert _delta(m1, m0, P + "num_preemptions_total") > 0, "the mix must include preemptions"
    assert _delta(m1, m0, P + "request_success_total{finished_reason=abort}") >= 16
    assert _delta(m1, m0, P + "request_success_total{finished_reason=stop}") >= 2
    assert _delta(m1, m0, P + "request_success_total{finished_reason=length}") >= 9
    assert _delta(m1, m0, P + "prefix_cache_hits_total") > 0

    prompt_sum = _delta(m1, m0, P + "request_prompt_tokens_sum")
    assert _delta(m1, m0, P + "prompt_tokens_total") == prompt_sum == prompt_tokens
    gen_total = _delta(m1, m0, P + "generation_tokens_total")
    assert gen_total == _delta(m1, m0, P + "request_generation_tokens_sum")
    # the known part of it: 2x4 + 6x90 + 3 (stop string) + 3x6 (n=3) + 0 (score only) + 1 (chat)
    assert gen_total >= 8 + 6 * 90 + 3 + 18 + 1
