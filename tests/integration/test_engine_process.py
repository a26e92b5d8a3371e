"""The engine loop in its own process (the CUDA default) behaves like the in-thread engine."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess, wait_gone

#: the module's server keeps its engine process polling this long after its last work
IDLE_POLL_MS = 400


@pytest.fixture(scope="module")
def proc_server():
    srv = ServerProcess(
        "--engine-mode",
        "process",
        "--max-model-len",
        "512",
        "--engine-idle-poll-ms",
        str(IDLE_POLL_MS),
    ).wait_ready()
    yield srv
    srv.stop()


def _engine_pid(srv) -> int:
    children = [
        int(p) for p in open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()
    ]
    engine_pids = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert len(engine_pids) == 1, children
    return engine_pids[0]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_engine_process_polls_after_work_then_sleeps(proc_server):
    """--engine-idle-poll-ms reaches the engine process: it stays busy for the window after a
    request, then sleeps (its CPU time stops growing)."""
    pid = _engine_pid(proc_server)
    r = httpx.post(
        proc_server.base_url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
    start = _cpu_seconds(pid)
    time.sleep(IDLE_POLL_MS / 1e3)
    polling = _cpu_seconds(pid) - start
    time.sleep(0.3)  # past the window
    start = _cpu_seconds(pid)
    time.sleep(1.0)
    asleep = _cpu_seconds(pid) - start
    # lenient: other tests may share the cores; polling takes ~a whole core, sleeping ~nothing
    assert polling >= 0.1 * IDLE_POLL_MS / 1e3 and asleep <= 0.05, (polling, asleep)


def test_process_engine_serves_streams_and_frees_blocks(proc_server):
    base = proc_server.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(
        model="qwen3-embedded",
        messages=[{"role": "user", "content": "hi there"}],
        temperature=0,
        max_tokens=12,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # hang up mid-stream: the engine process aborts it and frees its blocks
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json={"prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    for _ in range(50):
        m = scrape(base)
        if m["qwen_serve:num_requests_running"] == 0 and m[
            "qwen_serve:num_free_kv_blocks"
        ] == num_kv_blocks(m):
            break
        time.sleep(0.1)
    assert m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m)
    assert m["qwen_serve:request_success_total{finished_reason=abort}"] == 1


def test_engine_process_death_fails_requests_and_health():
    srv = ServerProcess("--engine-mode", "process", "--max-model-len", "512").wait_ready()
    try:
        os.kill(_engine_pid(srv), signal.SIGKILL)
        for _ in range(100):
            if httpx.get(srv.base_url + "/health", timeout=30).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 503
        r = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        srv.stop()


def test_ctrl_c_to_the_process_group_shuts_down_cleanly():
    """A terminal's Ctrl-C signals the server and its engine process alike: the engine process
    ignores it and the server stops it; exit 0, no traceback (an idle engine process printed
    a KeyboardInterrupt traceback)."""
    srv = ServerProcess("--engine-mode", "process", "--max-model-len", "512").wait_ready()
    try:
        engine = _engine_pid(srv)
        r = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
        time.sleep(0.5)  # the engine process idle, waiting for commands
        for pid in (srv.proc.pid, engine):
            os.kill(pid, signal.SIGINT)
        assert srv.proc.wait(60) == 0
        log = open(srv.log_path).read()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-4000:]
        assert wait_gone([engine], 10) == [], "the engine process outlived the server"
    finally:
        srv.stop()


@pytest.mark.timeout(120)
def test_no_deadlock_when_outputs_pile_up_and_a_large_command_is_sent():
    """The event loop busy while step outputs fill the pipe, then a command larger than the pipe
    buffer: the parent's reader thread keeps draining outputs, so neither process blocks the other
    (an event-loop reader would deadlock here: both sides blocked in send)."""
    import asyncio
    import threading

    from engine.core.commands import AbortRequest, AddRequest
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.frontend.process_core import ProcessCore
    from engine.loader.embedded import ensure_embedded_checkpoint

    cfg = EngineConfig(
        model=str(ensure_embedded_checkpoint()),
        device="cpu",
        max_model_len=1024,
        max_num_seqs=256,
        num_kv_blocks=2048,
    )
    core = ProcessCore(cfg, frozenset())
    got = {"msgs": 0}

    async def scenario():
        core.start(lambda outs, stats: got.__setitem__("msgs", got["msgs"] + 1), lambda: None)
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, logprobs=20)
        for i in range(256):
            core.send(AddRequest(f"r{i}", [1, 2, 3, 4], params))
        await asyncio.sleep(1.0)
        time.sleep(6.0)  # the loop busy elsewhere: outputs back up in the pipe
        sender = threading.Thread(
            target=core.send,
            args=(AddRequest("big", list(range(1, 120000)), SamplingParams(max_tokens=1)),),
            daemon=True,
        )
        sender.start()
        sender.join(30)
        sent = not sender.is_alive()
        for i in range(256):
            core.send(AbortRequest(f"r{i}"))
        await asyncio.to_thread(core.shutdown, 10)
        return sent

    try:
        assert asyncio.run(scenario()), (
            "the large command never left: parent and engine blocked each other"
        )
        assert got["msgs"] > 0
    finally:
        if core.is_alive():
            core._proc.kill()
