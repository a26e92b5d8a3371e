"""API key, request limits, sandboxed chat templates, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.frontend.async_engine import RequestStream
from engine.loader.embedded import ensure_embedded_checkpoint
from server.__main__ import build_parser
from server.factory import build_context
from tests.inprocess import app_client
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
    assert httpx.get(base + "/v1/nothing").status_code == 401  # an unknown /v1 route too


@pytest.mark.parametrize("body", [b"{bad", b"\xff\xfe", b"[" * 100_000, b'{"n": "x"}'])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_the_key_is_checked_before_the_body(keyed_server, path, body):
    """Without the key a request gets 401 whatever its body: no JSON error, no validation error
    (they would tell an unauthenticated client about the API, after parsing its body)."""
    r = httpx.post(
        keyed_server.base_url + path,
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_protect_metrics_puts_metrics_behind_the_key():
    """--protect-metrics: /metrics needs the key as /v1 does; /health stays open."""
    args = ["--max-model-len", "512", "--api-key", KEY, "--protect-metrics"]
    ctx = build_context(build_parser().parse_args(args))

    async def scenario():
        async with app_client(ctx) as c:
            r = await c.get("/metrics")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and "prompt_tokens_total" in r.text
            assert (await c.get("/health")).status_code == 200

    asyncio.run(scenario())


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
    out["ended_at"] = time.monotonic()


@pytest.mark.serial  # the listener must be closed 0.5 s after SIGTERM: run alone
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


def _complete(base: str, out: dict) -> None:
    body = {"prompt": "hi", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    try:
        out["response"] = httpx.post(base + "/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as exc:
        out["error"] = exc


def _wait_running(base: str, n: int, timeout: float = 60.0) -> None:
    """Wait until the engine runs ``n`` requests (the metrics' running gauge), so a test knows
    its requests were admitted before it signals the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("qwen_serve:num_requests_running{") and float(line.split()[-1]) >= n:
                return
        time.sleep(0.1)
    raise AssertionError(f"the engine did not run {n} requests within {timeout} s")


def _start_stream_and_plain(srv: ServerProcess) -> tuple[dict, dict, list[threading.Thread]]:
    """A 4000-token stream and a 4000-token non-streamed request, both running in the engine
    (4000 tokens take far longer than any timeout of these tests on CPU)."""
    out = {"started": threading.Event()}
    plain: dict = {}
    threads = [
        threading.Thread(target=_stream_until_done, args=(srv.base_url, 4000, out)),
        threading.Thread(target=_complete, args=(srv.base_url, plain)),
    ]
    for t in threads:
        t.start()
    assert out["started"].wait(60)
    _wait_running(srv.base_url, 2)
    return out, plain, threads


def _assert_ended_cleanly(srv: ServerProcess, out: dict, plain: dict, message: str) -> str:
    """Both requests were ended by the server (error event + [DONE] / 503, code
    server_shutting_down, ``message`` in the error) and the shutdown was clean; returns the
    log."""
    log = Path(srv.log_path).read_text()
    assert srv.proc.returncode == 0, log[-6000:]
    assert "error" not in out, out["error"]  # the stream ended as an SSE stream, not cut
    events = out["events"]
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable", err
    assert message in err["message"], err
    assert all("choices" in json.loads(e[6:]) for e in events[:-2])  # tokens until then
    r = plain["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert message in r.json()["error"]["message"], r.text
    assert "Traceback" not in log and "CancelledError" not in log, log[-6000:]
    assert "Application shutdown complete" in log, log[-6000:]  # the engine was shut down
    return log


#: the signal, and how many copies of it arrive 20 ms apart (2: a SIGTERM to the process group
#: of `make serve`, which GNU make sends its child again once it ran its own handler; copies
#: that arrive before Python ran the handler are merged by Python itself)
SIGNALS = pytest.mark.parametrize(
    "sig,copies",
    [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2)],
    ids=["SIGTERM", "SIGINT", "SIGTERM-delivered-twice"],
)


@SIGNALS
def test_sigterm_aborts_requests_past_the_timeout(sig, copies):
    """Past --graceful-timeout the server ends its requests itself: a stream gets an error event
    and [DONE], a non-streamed request a 503, both code server_shutting_down; no traceback, the
    lifespan shutdown completes, exit 0. A signal delivered twice at once is one signal."""
    srv = ServerProcess("--max-model-len", "4096", "--graceful-timeout", "2").wait_ready()
    out, plain, threads = _start_stream_and_plain(srv)
    t0 = time.monotonic()
    for i in range(copies):
        time.sleep(0.02 if i else 0)
        srv.proc.send_signal(sig)
    srv.proc.wait(60)  # one signal only: a second one would end the requests itself
    srv.stop()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 30
    log = _assert_ended_cleanly(srv, out, plain, "2 s graceful timeout")
    assert "aborting 2 in-flight engine request(s) (choices)" in log, log[-6000:]
    assert out["ended_at"] - t0 > 1.5, out["ended_at"] - t0  # at the timeout, not at once
    assert "second shutdown signal" not in log, log[-6000:]


def test_second_sigint_ends_in_flight_requests_at_once():
    """A second Ctrl-C during the shutdown ends the in-flight requests at once (error event +
    [DONE] / 503) and the server then finishes shutting down cleanly: lifespan shutdown, exit 0,
    no traceback; long before the 60 s graceful timeout, so only the second signal explains
    the end (uvicorn alone would force-quit: streams cut, no lifespan shutdown)."""
    srv = ServerProcess("--max-model-len", "4096", "--graceful-timeout", "60").wait_ready()
    out, plain, threads = _start_stream_and_plain(srv)
    srv.proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert srv.proc.poll() is None  # still waiting for the requests
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    srv.proc.wait(30)
    elapsed = time.monotonic() - t0
    srv.stop()
    for t in threads:
        t.join(30)
    log = _assert_ended_cleanly(srv, out, plain, "a second shutdown signal ended the request")
    assert elapsed < 20, elapsed
    assert "second shutdown signal: aborting 2 in-flight engine request(s)" in log, log[-6000:]
    assert "forcing the quit" not in log, log[-6000:]


@SIGNALS
def test_two_api_servers_end_requests_past_the_timeout_and_exit_cleanly(sig, copies):
    """With --api-server-count 2 the supervisor forwards the signal to both API servers, each
    ends its own requests at --graceful-timeout (error event + [DONE] / 503), both run their
    lifespan shutdown, the engine core stops once both left it, and the server exits 0."""
    srv = ServerProcess(
        "--api-server-count", "2", "--max-model-len", "4096", "--graceful-timeout", "2"
    ).wait_ready()
    # /health answers once one API server listens; a signal to one still starting ends it at
    # once (SIGUSR1's default action, nothing in flight there), without a lifespan shutdown
    srv.api_server_pids(2)
    out, plain, threads = _start_stream_and_plain(srv)
    t0 = time.monotonic()
    for i in range(copies):
        time.sleep(0.02 if i else 0)
        srv.proc.send_signal(sig)
    srv.proc.wait(60)
    srv.stop()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 40
    log = _assert_ended_cleanly(srv, out, plain, "2 s graceful timeout")
    assert out["ended_at"] - t0 > 1.5, out["ended_at"] - t0  # at the timeout, not at once
    assert "second shutdown signal" not in log, log[-6000:]
    ended = re.findall(r"aborting (\d) in-flight engine request", log)
    assert sum(map(int, ended)) == 2, log[-6000:]  # both requests, whichever server had them
    assert log.count("Application shutdown complete") == 2, log[-6000:]
    assert "API servers exited (codes [0, 0]); engine core stopped" in log, log[-6000:]


def test_two_api_servers_signalled_all_at_once_count_one_signal():
    """A service manager that signals every process of the server (systemd's control-group
    stop) sends one SIGTERM to the supervisor, each API server and the engine core: that is
    one signal, so the requests still get the whole --graceful-timeout (a second one would end
    them at once), and the server exits 0."""
    srv = ServerProcess(
        "--api-server-count", "2", "--max-model-len", "4096", "--graceful-timeout", "3"
    ).wait_ready()
    pids, engine = srv.api_server_pids(2)
    out, plain, threads = _start_stream_and_plain(srv)
    t0 = time.monotonic()
    for pid in [srv.proc.pid, *pids, engine]:
        os.kill(pid, signal.SIGTERM)
    srv.proc.wait(60)
    srv.stop()
    for t in threads:
        t.join(30)
    assert out["ended_at"] - t0 > 2.5, out["ended_at"] - t0  # at the timeout, not at once
    log = _assert_ended_cleanly(srv, out, plain, "3 s graceful timeout")
    assert "second shutdown signal" not in log, log[-6000:]
    assert "API servers exited (codes [0, 0]); engine core stopped" in log, log[-6000:]


def test_requests_ended_at_the_graceful_timeout_free_their_kv_blocks():
    """What the server calls when --graceful-timeout expires (in-process, on the live engine):
    streamed and non-streamed requests end (error event + [DONE] / 503), the engine aborts them
    so every KV block is free again, and a request arriving after is refused with a 503."""
    ctx = build_context(build_parser().parse_args(["--max-model-len", "512"]))
    bm = ctx.engine.engine.kv_cache_manager
    body = {"prompt": "once upon a time", "max_tokens": 400, "ignore_eos": True}

    async def scenario():
        async with app_client(ctx, timeout=120) as c:

            async def stream():
                async with c.stream(
                    "POST", "/v1/completions", json={**body, "stream": True, "n": 2}
                ) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data")]

            async def end_when_generating():
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    streams = ctx.engine.in_flight
                    if len(streams) == 3 and all(s.first_token_time for s in streams):
                        return ctx.end_in_flight(2)
                    await asyncio.sleep(0.05)
                return 0

            results = await asyncio.gather(
                stream(), c.post("/v1/completions", json=body), end_when_generating()
            )
            late = await c.post("/v1/completions", json=body)
            deadline = time.monotonic() + 30
            while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return (*results, late)

    events, plain, ended, late = asyncio.run(scenario())
    assert ended == 3  # two choices of the stream, one plain request
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "server_shutting_down" and "2 s graceful timeout" in err["message"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    # a request arriving after was never started: its own code and message, not the timeout's
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "server_shutting_down", late.text
    assert late.json()["error"]["message"] == "the server is shutting down", late.text
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("ending", ["server_abort", "engine_error"])
def test_tokens_generated_before_a_server_abort_are_streamed(monkeypatch, ending):
    """The tokens the engine generated before the server ended a stream (or the engine failed
    it) reach the client, before the error event: the text sent is the decode of every token
    the engine produced, with no gap. The request is ended while a token output is still
    queued for the stream (the consumer fell behind), the case where the error used to be
    merged into those tokens and they were dropped."""
    ctx = build_context(build_parser().parse_args(["--max-model-len", "512"]))
    body = {
        "prompt": "once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    produced: list[int] = []
    ended = []
    original_put = RequestStream._put

    def put(stream, out):
        original_put(stream, out)
        produced.extend(out.new_token_ids)
        if out.new_token_ids and len(produced) >= 8 and not ended:
            ended.append(stream.queue.qsize())  # this output is still queued, unread
            if ending == "server_abort":
                ctx.end_in_flight(2)
            else:
                ctx.engine.fail_all("boom")

    monkeypatch.setattr(RequestStream, "_put", put)

    async def scenario():
        async with (
            app_client(ctx, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            return [line async for line in r.aiter_lines() if line.startswith("data")]

    events = asyncio.run(scenario())
    assert ended and ended[0] >= 1
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    if ending == "server_abort":
        assert err["code"] == "server_shutting_down", err
    else:
        assert err["type"] == "internal_server_error" and "boom" in err["message"], err
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert text == ctx.tokenizer.decode(produced, skip_special_tokens=True)
    assert len(produced) >= 8 and text
