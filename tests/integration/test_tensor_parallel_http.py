"""``python -m server --tensor-parallel-size 2`` on the CPU (gloo): chat through the openai
client, streaming and not; and a killed rank: in-flight requests fail, /health answers 503,
no process is left behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import write_tiny_checkpoint
from tests.metricsutil import scrape
from tests.serverproc import ServerProcess
from tests.tiny_tokenizer import servable_copy

MESSAGES = [{"role": "user", "content": "Hello, tensor parallel world"}]


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tp")
    write_tiny_checkpoint(path, "qwen3", seed=1234, tie=True)
    return servable_copy(path, tmp_path_factory.mktemp("qwen3-tp-served"))


def start(model: str) -> ServerProcess:
    return ServerProcess(
        "--model",
        model,
        "--device",
        "cpu",
        "--tensor-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
        env={"OMP_NUM_THREADS": "1"},
    ).wait_ready(timeout=240)


def rank_pids(srv: ServerProcess) -> dict[int, int]:
    """rank -> pid, from the engine's start-up log line of the layout."""
    return {
        int(r): int(p) for r, p in re.findall(r"rank (\d+): cpu on \S+ \(pid (\d+)\)", srv.log())
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_chat_streaming_and_not(tp_checkpoint):
    srv = start(tp_checkpoint)
    try:
        pids = rank_pids(srv)
        assert sorted(pids) == [0, 1], srv.log()
        client = openai.OpenAI(
            base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120
        )
        (model,) = [m.id for m in client.models.list().data]
        full = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=24, temperature=0.0
        )
        assert full.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=24, temperature=0.0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == full.choices[0].message.content
        assert "tensor parallel size 2" in srv.log()
        samples = scrape(srv.base_url)
        for rank in (0, 1):
            where = f"{{device=cpu,host={socket.gethostname()},rank={rank}}}"
            assert samples["qwen_serve:rank_weight_bytes" + where] > 0
            assert samples["qwen_serve:rank_kv_cache_bytes" + where] > 0
        info = [k for k in samples if k.startswith("qwen_serve:model_info")]
        assert "tensor_parallel_size=2" in info[0]
    finally:
        assert srv.stop() == 0
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids.values()), "a rank outlived the server"


def test_killed_rank_fails_requests_and_health(tp_checkpoint):
    srv = start(tp_checkpoint)
    try:
        pids = rank_pids(srv)
        client = openai.OpenAI(
            base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60
        )
        (model,) = [m.id for m in client.models.list().data]
        first_chunk, outcome = threading.Event(), {}

        def stream() -> None:
            try:
                chunks = client.chat.completions.create(
                    model=model,
                    messages=MESSAGES,
                    max_tokens=480,
                    temperature=1.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                n = 0
                for c in chunks:
                    n += 1
                    first_chunk.set()
                    if c.choices and c.choices[0].finish_reason:
                        outcome["finish"] = c.choices[0].finish_reason
                outcome["chunks"] = n
            except Exception as exc:  # noqa: BLE001 - the failure under test
                outcome["error"] = exc
            finally:
                first_chunk.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(60)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the in-flight request hangs after a rank died"
        assert "error" in outcome or outcome.get("finish") not in ("length", "stop"), outcome
        health = None
        while time.monotonic() - killed_at < 30:
            health = httpx.get(srv.base_url + "/health", timeout=5).status_code
            if health == 503:
                break
            time.sleep(0.2)
        assert health == 503
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert err.value.status_code == 503
        # rank 0's monitor sees the exit, or a collective of the step in flight fails first
        log = srv.log()
        assert "lost a rank (rank 1 (pid" in log or "tensor-parallel step failed" in log, log
        assert not alive(pids[0])  # the engine-core process (rank 0) ended
    finally:
        srv.stop()
