"""The engine loop in its own process (the CUDA default) behaves like the in-thread engine."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def proc_server():
    srv = ServerProcess("--engine-mode", "process", "--max-model-len", "512").wait_ready()
    yield srv
    srv.stop()


def test_process_engine_serves_streams_and_frees_blocks(proc_server):
    base = proc_server.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model="qwen3-embedded", messages=[{"role": "user", "content": "hi there"}], temperature=0,
                  max_tokens=12)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # hang up mid-stream: the engine process aborts it and frees its blocks
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "a b c", "max_tokens": 400, "stream": True,
                                                               "ignore_eos": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    for _ in range(50):
        m = scrape(base)
        if m["qwen_serve:num_requests_running"] == 0 and m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m):
            break
        time.sleep(0.1)
    assert m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m)
    assert m["qwen_serve:request_success_total{finished_reason=abort}"] == 1


def test_engine_process_death_fails_requests_and_health():
    srv = ServerProcess("--engine-mode", "process", "--max-model-len", "512").wait_ready()
    try:
        children = [int(p) for p in open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()]
        engine_pids = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert engine_pids, children
        os.kill(engine_pids[0], signal.SIGKILL)
        for _ in range(100):
            if httpx.get(srv.base_url + "/health", timeout=30).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        srv.stop()
