"""Overload, abort storms and impossible prompts against a server whose KV cache fits ~10
requests."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.metricsutil import num_kv_blocks, scrape, total_requests
from tests.serverproc import ServerProcess

# 200-stream and 100-abort storms, and a rejection timed under load: run alone
pytestmark = pytest.mark.serial

# ~40-token prompts + 12 tokens need 4 blocks of 16: 40 blocks hold about 10 requests
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def small_server():
    srv = ServerProcess(
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "256",
    ).wait_ready()
    yield srv
    srv.stop()


def _prompt(i: int) -> str:
    rng = random.Random(i)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "kernel",
        "block",
        "cache",
        "token",
        "river",
        "stone",
    ]
    return " ".join(rng.choice(words) for _ in range(25 + i % 10))


async def _stream_text(
    client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int
) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish = "", None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    for line in lines[:-1]:
        c = json.loads(line[6:])
        text += c["choices"][0]["text"]
        finish = c["choices"][0]["finish_reason"] or finish
    return text, finish


def _wait_idle(base: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base)
        idle = (
            m["qwen_serve:num_requests_running"] == 0 and m["qwen_serve:num_requests_waiting"] == 0
        )
        if idle and m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_overload_200_streams_complete_with_preemption(small_server):
    base = small_server.base_url
    prompts = [_prompt(i) for i in range(10)]

    async def alone():
        async with httpx.AsyncClient(timeout=120) as c:
            return [await _stream_text(c, base, p, 12) for p in prompts]

    reference = asyncio.run(alone())
    before = scrape(base)

    async def storm():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=250)) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream_text(c, base, prompts[i % 10], 12) for i in range(200))),
                timeout=300,
            )

    t0 = time.monotonic()
    results = asyncio.run(storm())
    elapsed = time.monotonic() - t0
    assert len(results) == 200
    for i, res in enumerate(results):
        assert res == reference[i % 10], f"request {i} differs from its solo run"
    after = _wait_idle(base)
    assert after["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(after) == NUM_BLOCKS
    assert total_requests(after) - total_requests(before) == 200
    assert (
        after["qwen_serve:num_preemptions_total"]
        > before.get("qwen_serve:num_preemptions_total", 0)
        or after["qwen_serve:request_queue_time_seconds_count"]
        > before["qwen_serve:request_queue_time_seconds_count"]
    )
    preempted = after["qwen_serve:num_preemptions_total"] - before.get(
        "qwen_serve:num_preemptions_total", 0
    )
    print(f"\n200 streams in {elapsed:.1f}s, preemptions {preempted:.0f}")


def test_abort_storm_frees_every_block(small_server):
    base = small_server.base_url
    before = scrape(base)
    rng = random.Random(0)

    async def one(i: int, client: httpx.AsyncClient):
        body = {"prompt": _prompt(i), "max_tokens": 400, "temperature": 0, "stream": True}
        cut_after = rng.randint(0, 6)  # chunks to read before hanging up
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n > cut_after:
                        break  # leaving the block closes the connection mid-stream

    async def storm():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=120)) as c:
            await asyncio.gather(*(one(i, c) for i in range(100)))

    asyncio.run(storm())
    m = _wait_idle(base, timeout=20)
    assert m["qwen_serve:num_requests_running"] == 0 and m["qwen_serve:num_requests_waiting"] == 0
    assert m["qwen_serve:num_free_kv_blocks"] == NUM_BLOCKS
    aborted = m.get("qwen_serve:request_success_total{finished_reason=abort}", 0) - before.get(
        "qwen_serve:request_success_total{finished_reason=abort}", 0
    )
    assert aborted == 100
    # generation stopped: no request ran to its 400-token limit and the counter is still
    gen = m["qwen_serve:generation_tokens_total"]
    time.sleep(1.0)
    assert scrape(base)["qwen_serve:generation_tokens_total"] == gen
    assert m.get("qwen_serve:request_success_total{finished_reason=length}", 0) == before.get(
        "qwen_serve:request_success_total{finished_reason=length}", 0
    )


def test_prompt_that_never_fits_is_rejected_and_others_continue(small_server):
    base = small_server.base_url
    huge = " ".join(["token"] * 2000)  # over max_model_len 512 and the 640-token cache

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            normal = [asyncio.create_task(_stream_text(c, base, _prompt(i), 8)) for i in range(4)]
            t0 = time.monotonic()
            r = await c.post(base + "/v1/completions", json={"prompt": huge, "max_tokens": 4})
            rejected_in = time.monotonic() - t0
            return r, rejected_in, await asyncio.gather(*normal)

    r, rejected_in, normal = asyncio.run(run())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    assert rejected_in < 5
    assert all(finish in ("stop", "length") for _, finish in normal)
