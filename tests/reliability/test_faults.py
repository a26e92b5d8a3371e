"""An exception inside a model step fails only that step's requests; the engine loop keeps serving.

Runs the real app in-process (httpx ASGI transport) so the test can inject the fault into the
model runner of the live engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from server.__main__ import build_parser
from server.factory import build_context
from tests.inprocess import app_client


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def ctx(request):
    return build_context(
        build_parser().parse_args(["--max-model-len", "512", "--async-scheduling", request.param])
    )


def test_model_step_exception_fails_only_that_step(ctx):
    runner = ctx.engine.engine.executor
    real_launch = runner.launch
    calls = {"n": 0}

    def flaky(batch, eos_ids, prev=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_launch(batch, eos_ids, prev)

    async def scenario():
        try:
            async with app_client(ctx) as c:
                body = {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                runner.launch = flaky
                failed = await c.post("/v1/chat/completions", json=body)
                ok = await c.post("/v1/chat/completions", json=body)
                stream_body = {**body, "stream": True}
                calls["n"] = 0  # fail the first step of the streamed request too
                async with c.stream("POST", "/v1/chat/completions", json=stream_body) as r:
                    events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                after = await c.post("/v1/chat/completions", json=body)
                health = await c.get("/health")
                metrics = (await c.get("/metrics")).text
            return failed, ok, events, after, health, metrics
        finally:
            runner.launch = real_launch

    failed, ok, events, after, health, metrics = asyncio.run(scenario())
    assert failed.status_code == 500
    assert "injected fault" in failed.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1] == "data: [DONE]"
    assert any("error" in json.loads(e[6:]) for e in events[:-1])
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    assert health.status_code == 200
    assert 'qwen_serve:request_success_total{finished_reason="error"' in metrics
    bm = ctx.engine.engine.kv_cache_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_device_error_stops_the_engine_and_fails_requests():
    """A CUDA error poisons the device: the engine loop stops, requests fail, /health says 503."""
    ctx2 = build_context(build_parser().parse_args(["--max-model-len", "512"]))
    runner = ctx2.engine.engine.executor

    def broken(batch, eos_ids, prev=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def scenario():
        async with app_client(ctx2) as c:
            runner.launch = broken
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            failed = await c.post("/v1/chat/completions", json=body)
            for _ in range(50):
                if not ctx2.engine.is_running:
                    break
                await asyncio.sleep(0.05)
            health = await c.get("/health")
            refused = await c.post("/v1/chat/completions", json=body)
        return failed, health, refused

    failed, health, refused = asyncio.run(scenario())
    assert failed.status_code == 500 and "CUDA error" in failed.json()["error"]["message"]
    assert health.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
