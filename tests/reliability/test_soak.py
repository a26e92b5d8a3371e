"""Soak: two minutes of steady streaming load; resident memory stays flat after warm-up
(within 5%)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess

# a fixed-duration soak measuring the server's resident memory: run alone
pytestmark = pytest.mark.serial

DURATION_S = 120
WARMUP_S = 30
CONCURRENCY = 8


@pytest.mark.slow
def test_resident_memory_flat_under_two_minutes_of_load():
    srv = ServerProcess("--max-model-len", "512").wait_ready()
    samples: list[tuple[float, float]] = []
    counts = {"ok": 0, "aborted": 0}
    try:

        async def user(uid: int, client: httpx.AsyncClient, stop_at: float):
            rng = random.Random(uid)
            while time.monotonic() < stop_at:
                body = {
                    "messages": [{"role": "user", "content": "word " * rng.randint(5, 200)}],
                    "max_tokens": rng.randint(4, 48),
                    "temperature": 0.8,
                    "stream": True,
                }
                async with client.stream(
                    "POST", srv.base_url + "/v1/chat/completions", json=body
                ) as r:
                    assert r.status_code == 200
                    n = 0
                    hang_up = rng.random() < 0.1
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if hang_up and n == 3:
                            counts["aborted"] += 1
                            break
                    else:
                        counts["ok"] += 1

        async def sampler(t0: float, stop_at: float):
            while time.monotonic() < stop_at:
                m = await asyncio.to_thread(scrape, srv.base_url)
                samples.append((time.monotonic() - t0, m["process_resident_memory_bytes"]))
                await asyncio.sleep(5)

        async def main():
            t0 = time.monotonic()
            stop_at = t0 + DURATION_S
            async with httpx.AsyncClient(timeout=120) as client:
                await asyncio.gather(
                    sampler(t0, stop_at), *(user(i, client, stop_at) for i in range(CONCURRENCY))
                )

        asyncio.run(main())
        base = [rss for t, rss in samples if t >= WARMUP_S][0]
        later = [rss for t, rss in samples if t >= WARMUP_S]
        growth = max(later) / base - 1
        print(
            f"\nsoak: {counts['ok']} completed, {counts['aborted']} hung up, RSS at warm-up "
            f"{base / 2**20:.0f} MiB, max after {max(later) / 2**20:.0f} MiB ({100 * growth:+.1f}%)"
        )
        assert counts["ok"] > 50
        assert growth <= 0.05, samples
        m = scrape(srv.base_url)
        assert (
            m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m)
            or m["qwen_serve:num_requests_running"] > 0
        )
    finally:
        srv.stop()
