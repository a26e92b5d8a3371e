"""API key, request limits, sandboxed chat templates, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import httpx
import pytest

from engine.loader.embedded import ensure_embedded_checkpoint
from tests.serverproc import ServerProcess

KEY = "s3cret-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_server():
    srv = ServerProcess(
        "--max-model-len",
        "512",
        "--max-body-bytes",
        "20000",
        "--max-prompt-tokens",
        "300",
        env={"QWEN_SERVE_API_KEY": KEY},
    ).wait_ready()
    yield srv
    srv.stop()


def test_api_key_required_on_v1_only(keyed_server):
    base = keyed_server.base_url
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"prompt": "a"}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/qwen3-embedded", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.request(
            method, base + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert ok.status_code == 200, ok.text
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200


def test_limits(keyed_server):
    base = keyed_server.base_url
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"messages": [{"role": "user", "content": "x" * 30000}]}
    r = httpx.post(base + "/v1/chat/completions", json=big, headers=auth)
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.post(base + "/v1/chat/completions", json={**CHAT, "n": 17}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(
        base + "/v1/chat/completions",
        json={**CHAT, "stop": [str(i) for i in range(17)]},
        headers=auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    long_prompt = {"messages": [{"role": "user", "content": "hello " * 400}]}
    r = httpx.post(base + "/v1/chat/completions", json=long_prompt, headers=auth)
    assert r.status_code == 400 and "limit is 300" in r.json()["error"]["message"]


def test_template_reaching_python_internals_fails_safely(tmp_path):
    src = ensure_embedded_checkpoint()
    model = tmp_path / "evil"
    shutil.copytree(src, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages[0]['content'] }}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.jinja"):
        extra.unlink()
    srv = ServerProcess("--model", str(model), "--max-model-len", "256").wait_ready()
    try:
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 400
        assert "template" in r.json()["error"]["message"].lower()
        assert (
            "subclasses" not in r.text or "unsafe" in r.text.lower() or "security" in r.text.lower()
        )
        assert httpx.get(srv.base_url + "/health").status_code == 200
        # plain completions do not use the template and still work
        assert (
            httpx.post(
                srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}
            ).status_code
            == 200
        )
    finally:
        srv.stop()


def _stream_until_done(base: str, max_tokens: int, out: dict) -> None:
    body = {
        "prompt": "once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    events = []
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        out["started"].set()
    except httpx.HTTPError as exc:
        out["error"] = exc
    out["events"] = events


def test_sigterm_lets_in_flight_requests_finish():
    srv = ServerProcess("--max-model-len", "512", "--graceful-timeout", "60").wait_ready()
    out = {"started": threading.Event()}
    t = threading.Thread(target=_stream_until_done, args=(srv.base_url, 150, out))
    t.start()
    assert out["started"].wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no new connections once shutting down
        httpx.get(srv.base_url + "/health", timeout=2)
    t.join(120)
    code = srv.stop()
    events = out["events"]
    assert events[-1] == "data: [DONE]", srv.log()
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert code == 0, srv.log()


def test_sigterm_aborts_requests_past_the_timeout():
    srv = ServerProcess("--max-model-len", "4096", "--graceful-timeout", "2").wait_ready()
    out = {"started": threading.Event()}
    t = threading.Thread(target=_stream_until_done, args=(srv.base_url, 4000, out))
    t.start()
    assert out["started"].wait(60)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.stop(timeout=60)
    t.join(30)
    assert code == 0, srv.log()
    assert time.monotonic() - t0 < 30
    assert out["events"] and out["events"][-1] != "data: [DONE]"  # cut off, not completed
