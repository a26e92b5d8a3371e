"""``--api-server-count 2``: two API-server processes in front of one engine core.

Checked over the real server (``python -m server`` as a subprocess): both API servers answer
(the kernel spreads connections over their SO_REUSEPORT sockets), the shared engine gives the
same greedy text whichever server took the request, /metrics is one exact view from either
server (token counters equal the clients' usage sums and the per-request histograms), no KV
block leaks, ``--limit-concurrency`` is one limit over both servers, and an API server that
dies takes the whole server down with exit code 1 (nothing left running), as does the engine
core's death; the API servers and the engine stop when their supervisor is killed, a second
server on the port fails at once, and a signal during start-up stops the loading engine.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess, wait_gone

# port binding (a second server on a taken port), connection caps and a 5 s exit bound: run
# alone
pytestmark = pytest.mark.serial

P = "qwen_serve:"


def _spawned_children(pid: int) -> list[int]:
    """The ``multiprocessing`` spawn children of ``pid`` (the engine core, the API servers)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            found.append(int(d.name))
    return found


@pytest.fixture(scope="module")
def two_servers():
    srv = ServerProcess("--api-server-count", "2", "--max-model-len", "512").wait_ready()
    srv.api_server_pids(2)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_both_servers_answer_one_engine_and_metrics_are_one_exact_view(two_servers):
    base = two_servers.base_url
    rng = random.Random(time.time_ns())
    fixed = [rng.randrange(1000, 20000) for _ in range(12)]
    bodies = []
    for i in range(32):
        prompt = (
            fixed
            if i % 4 == 0
            else [rng.randrange(1000, 20000) for _ in range(rng.randrange(3, 40))]
        )
        bodies.append(
            {
                "prompt": prompt,
                "max_tokens": rng.randrange(1, 9),
                "temperature": 0,
                "ignore_eos": True,
            }
        )
    for b in bodies[::4]:
        b["max_tokens"] = 6

    def post(body):  # a fresh connection per request: the kernel picks the API server
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, bodies))

    # which API server served each request: its "[api N]" log line names the response id
    log = Path(two_servers.log_path).read_text()
    server_of = {}
    for res in results:
        m = re.search(r"\[api (\d)\]: finished " + re.escape(res["id"]) + "-p0-0:", log)
        assert m, f"no log line for {res['id']}"
        server_of[res["id"]] = int(m.group(1))
    assert set(server_of.values()) == {0, 1}, server_of  # both servers took requests

    # the one engine: the same greedy prompt gives the same text on either server
    texts = {(server_of[r["id"]], r["choices"][0]["text"]) for r in results[::4]}
    assert len({t for _, t in texts}) == 1, texts

    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert completion_tokens == sum(b["max_tokens"] for b in bodies)
    # the step stats (gauges) travel apart from the outputs: wait for the idle state
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = scrape(base)
        if m[P + "num_requests_running"] == 0 and m[P + "num_free_kv_blocks"] == num_kv_blocks(m):
            break
        time.sleep(0.1)
    views = [scrape(base) for _ in range(8)]  # fresh connections: scrapes land on both servers
    for m in views:
        assert m[P + "prompt_tokens_total"] == prompt_tokens
        assert m[P + "generation_tokens_total"] == completion_tokens
        assert m[P + "request_prompt_tokens_sum"] == prompt_tokens
        assert m[P + "request_generation_tokens_sum"] == completion_tokens
        assert m[P + "request_success_total{finished_reason=length}"] == len(bodies)
        assert m[P + "time_to_first_token_seconds_count"] == len(bodies)
        assert m[P + "num_requests_running"] == 0
        assert m[P + "num_free_kv_blocks"] == num_kv_blocks(m)  # no block leaked
        assert m[P + "iteration_tokens_total_count"] > 0  # the engine's steps, counted once
        assert sum(1 for k in m if k.startswith(P + "model_info")) == 1
    steps = {m[P + "iteration_tokens_total_count"] for m in views}
    assert len(steps) == 1, steps  # the same step count from either server


def _open_idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def test_limit_concurrency_is_one_limit_over_both_servers():
    """``--limit-concurrency 4``: with four idle connections open anywhere, a request on a fifth
    connection gets 503 whichever server it reaches (counted per server, most would pass); with
    three open, it is served."""
    srv = ServerProcess(
        "--api-server-count",
        "2",
        "--max-model-len",
        "256",
        "--limit-concurrency",
        "4",
        "--timeout-request-header",
        "120",
        "--timeout-keep-alive",
        "120",
    ).wait_ready()
    try:
        srv.api_server_pids(2)

        def health_codes(n: int) -> list[int]:  # each on a fresh connection, closed after
            return [httpx.get(srv.base_url + "/health", timeout=10).status_code for _ in range(n)]

        idle = _open_idle(srv.port, 3)
        time.sleep(0.5)
        with httpx.Client(base_url=srv.base_url, timeout=10) as fourth:  # one kept-alive socket
            assert [fourth.get("/health").status_code for _ in range(8)] == [200] * 8
            deadline = time.monotonic() + 20  # 4 open now: fresh connections get the 503
            codes: list[int] = []
            while time.monotonic() < deadline:
                codes = health_codes(12)
                if codes == [503] * 12:
                    break
                time.sleep(0.2)
            assert codes == [503] * 12, codes
            r = httpx.get(srv.base_url + "/health", timeout=10)
            assert r.json()["error"]["code"] == "too_many_connections", r.text
            assert fourth.get("/health").status_code == 200  # the admitted ones go on
        for s in idle:
            s.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            codes = health_codes(8)
            if codes == [200] * 8:
                break
            time.sleep(0.2)
        assert codes == [200] * 8, codes  # the count went back down
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_second_server_on_the_same_port_fails_at_once(two_servers):
    """SO_REUSEPORT would let a second --api-server-count server listen on the port too and
    take half of its connections; it fails before loading anything, the first serves on."""
    second = ServerProcess("--api-server-count", "2", "--port", str(two_servers.port))
    try:
        assert second.proc.wait(60) == 1, second.log()
        assert "another server with --api-server-count already serves on it" in second.log()
    finally:
        second.stop()
    assert httpx.get(two_servers.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("victim", ["api-server-1", "the engine core"])
def test_a_process_that_dies_stops_the_whole_server(victim):
    srv = ServerProcess("--api-server-count", "2", "--max-model-len", "256").wait_ready()
    pids, engine = srv.api_server_pids(2)
    os.kill(pids[1] if victim == "api-server-1" else engine, signal.SIGKILL)
    assert srv.proc.wait(60) == 1, srv.log()
    assert f"{victim} exited unexpectedly (exit code -9)" in srv.log(), srv.log()
    assert wait_gone([*pids, engine], 30) == [], srv.log()
    srv.stop()


def test_the_api_servers_and_the_engine_stop_when_the_supervisor_is_killed():
    """A killed supervisor is one shutdown signal to each API server: a stream in flight still
    finishes within --graceful-timeout (a second signal would end it at once), then the API
    servers and the engine exit."""
    srv = ServerProcess(
        "--api-server-count", "2", "--max-model-len", "256", "--graceful-timeout", "60"
    ).wait_ready()
    pids, engine = srv.api_server_pids(2)
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "once", "max_tokens": 80, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    srv.proc.kill()
    srv.proc.wait(10)
    t.join(120)
    assert wait_gone([*pids, engine], 60) == [], Path(srv.log_path).read_text()[-6000:]
    log = Path(srv.log_path).read_text()
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length", events[-3:]
    assert "second shutdown signal" not in log, log[-6000:]
    assert log.count("Application shutdown complete") == 2, log[-6000:]  # both shut down
    srv.stop()


def test_a_signal_during_start_up_stops_the_loading_engine():
    """SIGTERM while the engine core loads: the supervisor kills it and exits 0 at once."""
    srv = ServerProcess("--api-server-count", "2", "--max-model-len", "256")
    deadline = time.monotonic() + 60
    children: list[int] = []
    while not children and time.monotonic() < deadline and srv.proc.poll() is None:
        children = _spawned_children(srv.proc.pid)
        time.sleep(0.05)
    assert children, srv.log()
    assert "serving on" not in Path(srv.log_path).read_text()  # still loading
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.log()
    assert time.monotonic() - t0 < 5
    log = Path(srv.log_path).read_text()
    assert "signal during start-up: stopped while the engine loaded" in log, log[-6000:]
    assert "engine ready" not in log and "Traceback" not in log, log[-6000:]  # killed, not waited
    assert wait_gone(children, 10) == [], srv.log()
    srv.stop()
