"""Two local torchrun "nodes" on loopback (gloo), one rank each: node 0 serves HTTP and runs the
engine core as rank 0 (``--distributed-init-method env://``), node 1 runs rank 1's worker
loop. Chat answers; SIGTERM to node 0's torchrun stops both nodes, rank 1 cleanly."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from engine.worker.rank_monitor import STALE_S
from tests.conftest import write_tiny_checkpoint
from tests.serverproc import REPO, free_port
from tests.tiny_tokenizer import servable_copy


def node(rank: int, model: str, master_port: int, http_port: int, log: Path) -> subprocess.Popen:
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"),
        *("--master-addr", "127.0.0.1", "--master-port", str(master_port)),
        *("-m", "server", "--model", model, "--device", "cpu"),
        *("--tensor-parallel-size", "2", "--distributed-init-method", "env://"),
        *("--port", str(http_port), "--num-kv-blocks", "64", "--max-model-len", "512"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_SERVE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def start_nodes(tmp_path) -> tuple[list[subprocess.Popen], list[Path], str]:
    """Both nodes started and node 0 answering /health: (processes, logs, base URL)."""
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(ckpt, "qwen3", seed=1234, tie=True)
    model = servable_copy(ckpt, tmp_path / "served")
    master, http = free_port(), free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [node(r, model, master, http, logs[r]) for r in (0, 1)]
    base = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 180
    while True:
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return procs, logs, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.3)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its worker in a session of its own,
    so a process group does not reach it)."""
    out, todo = [], [pid]
    while todo:
        for path in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            try:
                kids = [int(k) for k in Path(path).read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_all(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM each torchrun (it forwards the signal to its worker), wait until its processes
    are gone or ``grace`` seconds pass, then SIGKILL whatever is left (torchrun may wait in
    its exit barrier for an agent that died)."""
    family = {p.pid: descendants(p.pid) for p in procs}
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        while time.monotonic() < deadline and p.poll() is None:
            if not any(alive(k) for k in family[p.pid]):
                break
            time.sleep(0.2)
    for p in procs:
        for pid in (*family[p.pid], p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait()


def test_two_torchrun_nodes_serve_one_engine(tmp_path):
    procs, logs, base = start_nodes(tmp_path)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        (name,) = [m.id for m in client.models.list().data]
        messages = [{"role": "user", "content": "two nodes"}]
        full = client.chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0.0
        )
        assert full.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0.0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == full.choices[0].message.content
        assert "tensor parallel size 2" in logs[0].read_text()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == 0, logs[1].read_text()[-3000:]
        procs[0].wait(60)
        assert "rank 1 stopped after" in logs[1].read_text()
    finally:
        stop_all(procs)


def test_killed_torchrun_rank_is_noticed(tmp_path):
    """Rank 1 (node 1) killed while the engine is idle: no collective fails, rank 0 notices the
    silent heartbeat (within STALE_S plus a poll), the engine stops, /health answers 503."""
    procs, logs, base = start_nodes(tmp_path)
    try:
        (pid,) = re.findall(r"rank 1 ready: rank 1: cpu on \S+ \(pid (\d+)\)", logs[1].read_text())
        os.kill(int(pid), signal.SIGKILL)
        killed = time.monotonic()
        status = None
        while time.monotonic() - killed < STALE_S + 15:
            status = httpx.get(base + "/health", timeout=5).status_code
            if status == 503:
                break
            time.sleep(0.5)
        assert status == 503, logs[0].read_text()[-3000:]
        assert "lost a rank (rank 1 sent no heartbeat" in logs[0].read_text()
    finally:
        stop_all(procs)
