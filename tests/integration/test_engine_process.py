"""The engine loop in its own process (the CUDA default) behaves like the in-thread engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess, wait_gone

REPO = Path(__file__).resolve().parents[2]

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


def test_sigterm_to_the_process_group_lets_in_flight_requests_finish():
    """A SIGTERM to the whole process group (``make serve``'s, a service manager's
    control-group stop) reaches the engine process too: it ignores it, so a stream in flight
    still finishes within ``--graceful-timeout`` and the server exits 0 with its engine
    stopped (a daemonic engine process died of the signal and failed the stream)."""
    srv = ServerProcess(
        "--engine-mode", "process", "--max-model-len", "512", "--graceful-timeout", "60"
    ).wait_ready()
    try:
        engine = _engine_pid(srv)
        body = {"prompt": "a", "max_tokens": 100, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        for pid in (srv.proc.pid, engine):
                            os.kill(pid, signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        log = open(srv.log_path).read()
        assert events[-1] == "data: [DONE]", log[-4000:]
        last = json.loads(events[-2][6:])  # an error event when the engine process died
        assert "choices" in last and last["choices"][0]["finish_reason"] == "length", last
        assert "engine process died" not in log, log[-4000:]
        assert wait_gone([engine], 10) == [], "the engine process outlived the server"
    finally:
        srv.stop()


#: a front end that starts an engine process, reads from it, and exits without a shutdown
_EXIT_WITHOUT_SHUTDOWN = """
from engine.core.config import EngineConfig
from engine.frontend.process_core import ProcessCore
from engine.loader.embedded import ensure_embedded_checkpoint

if __name__ == "__main__":
    cfg = EngineConfig(model=str(ensure_embedded_checkpoint()), device="cpu", num_kv_blocks=32)
    core = ProcessCore(cfg, frozenset())
    core.start(lambda outputs, stats: None, lambda: print("on_death called", flush=True))
    print("engine pid", core._proc.pid, flush=True)
"""


def test_a_front_end_exiting_without_shutdown_ends_its_engine_process(tmp_path):
    """The engine process is not daemonic (it ignores SIGTERM): a front end that exits without
    a shutdown, its reader thread blocked on the pipe, still ends it at once through the
    pipe's end (``EngineProcess.reap``) -- not by a kill after the timeout, and without
    reporting an engine death."""
    script = tmp_path / "front_end.py"
    script.write_text(_EXIT_WITHOUT_SHUTDOWN)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert time.monotonic() - t0 < 60, out[-4000:]
    assert "still running after" not in out and "engine process died" not in out, out[-4000:]
    assert "on_death called" not in out, out[-4000:]
    pid = int(out.split("engine pid ")[1].split()[0])
    assert wait_gone([pid], 10) == [], "the engine process outlived its front end"


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
