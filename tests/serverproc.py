"""Start the real server as a subprocess on a free port (used by integration and load tests)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


#: the ports :func:`free_port` hands out: 20000-31999, below Linux's ephemeral range (32768 and
#: up), so no outgoing connection can take one between the check here and the server's bind;
#: split into one block per pytest-xdist worker (up to 6, then the blocks repeat), so parallel
#: workers never pick the same port
PORT_BASE = 20000
PORTS_PER_WORKER = 2000
MAX_WORKERS = 6


def free_port() -> int:
    """A loopback port free now, from this process's block of :data:`PORT_BASE` and up (the
    block of pytest-xdist worker ``gwN``; the first one outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % MAX_WORKERS if worker[2:].isdigit() else 0
    first = PORT_BASE + index * PORTS_PER_WORKER
    rng = random.Random()  # not the tests' seeded global generator
    for _ in range(200):
        port = rng.randrange(first, first + PORTS_PER_WORKER)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


class ServerProcess:
    """``python -m server`` on 127.0.0.1:<free port>; output goes to a log file.

    Args:
        args: extra command-line flags. env: extra environment variables.
    """

    def __init__(self, *args: str, env: dict | None = None, log_path: str | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or f"/tmp/qwen-serve-test-{self.port}.log"
        # the caller's server settings (an exported API key, another model...) would change the
        # test; only QWEN_SERVE_CACHE (where the embedded model lives) is kept
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k == "QWEN_SERVE_CACHE" or not k.startswith("QWEN_SERVE_")
        }
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("TRITON_INTERPRET", None)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "--port",
                str(self.port),
                "--log-level",
                "info",
                *args,
            ],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return Path(self.log_path).read_text()[-6000:]

    def api_server_pids(self, count: int, timeout: float = 120.0) -> tuple[list[int], int]:
        """With ``--api-server-count count``: wait for the supervisor's line saying every API
        server listens; returns the pids of the API servers and of the engine core."""
        pattern = rf"with {count} API servers \(pids ([\d, ]+); engine core pid (\d+)\)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, Path(self.log_path).read_text())
            if m:
                return [int(p) for p in m.group(1).split(", ")], int(m.group(2))
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("the API servers did not all start:\n" + self.log())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return " Z " not in stat.read_text()
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for every process of ``pids`` to end; returns those
    still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]
