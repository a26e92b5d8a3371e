"""Headless Locust against a real server subprocess; the server's metrics must match Locust exactly.

The server (`python -m server`, embedded random-weight model) runs on a free loopback port.
Locust (tests/load/locustfile.py) streams chat completions for 20 s with 10 users. With
``--stop-timeout 30`` a user that is mid-request when the time limit hits finishes that request
before it stops, so no stream is cut off: every request the server finishes is one Locust
counted, and none ends as finished_reason="abort". The comparison uses Locust's request count
for the chat endpoint including failures (and also asserts there were none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import ServerProcess

# a load test of fixed duration (its request counts depend on the CPU it gets): run alone
pytestmark = pytest.mark.serial

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")

CHAT_PATH = "/v1/chat/completions"
USERS = 10
SPAWN_RATE = 5
RUN_TIME_S = 20
STOP_TIMEOUT_S = 30
HEALTH_TIMEOUT_S = 120
METRICS_SETTLE_S = 15

REQUESTS_TOTAL = "qwen_serve:request_success_total"
E2E_COUNT = "qwen_serve:e2e_request_latency_seconds_count"
TTFT_COUNT = "qwen_serve:time_to_first_token_seconds_count"


def _child_env() -> dict[str, str]:
    """The caller's environment without server/Locust settings that would change the run
    (an API key, another model, ...); QWEN_SERVE_CACHE (where the embedded model lives) stays."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key == "QWEN_SERVE_CACHE"
        or not key.startswith(("QWEN_SERVE_", "QWEN_LOCUST_", "LOCUST_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def _scrape(base_url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """Samples of GET /metrics summed over labels by sample name, and
    request_success_total by finished_reason."""
    status, text = _get(base_url + "/metrics")
    assert status == 200, f"GET /metrics: HTTP {status}: {text[:300]}"
    totals: dict[str, float] = {}
    by_reason: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == REQUESTS_TOTAL:
                key = (sample.name, sample.labels.get("finished_reason", ""))
                by_reason[key] = by_reason.get(key, 0.0) + sample.value
    return totals, by_reason


@pytest.fixture
def server_url():
    srv = ServerProcess("--max-model-len", "1024").wait_ready(HEALTH_TIMEOUT_S)
    yield srv.base_url
    srv.stop()


def _run_locust(base_url: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(USERS),
        "-r",
        str(SPAWN_RATE),
        "-t",
        f"{RUN_TIME_S}s",
        "--stop-timeout",
        str(STOP_TIMEOUT_S),
        "--host",
        base_url,
        "--only-summary",
        "--json",  # final stats on stdout, written after every user has stopped
    ]
    env = _child_env()
    env["QWEN_LOCUST_WAIT_FOR_SERVER_S"] = "30"
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIME_S + STOP_TIMEOUT_S + 90,
    )
    out = proc.stdout
    try:
        stats = json.loads(out[out.index("[") :])
    except ValueError:
        pytest.fail(
            f"no JSON stats from locust (exit {proc.returncode})\n"
            f"stdout:\n{out[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return stats, proc


def test_locust_headless_matches_server_metrics(server_url):
    before, reasons_before = _scrape(server_url)
    stats, proc = _run_locust(server_url)
    diag = f"locust exit {proc.returncode}; stderr tail:\n{proc.stderr[-5000:]}"

    entries = {(e["method"], e["name"]): e for e in stats}
    chat = entries.get(("POST", CHAT_PATH))
    assert chat is not None, f"no POST {CHAT_PATH} entry in {sorted(entries)}; {diag}"
    failures = {f"{m} {n}": e["num_failures"] for (m, n), e in entries.items() if e["num_failures"]}
    assert not failures, f"locust failures {failures}; {diag}"
    assert proc.returncode == 0, diag

    n = chat["num_requests"]  # Locust's num_requests includes failed requests
    assert n >= USERS, f"only {n} chat requests in {RUN_TIME_S} s; {diag}"
    ttft = entries.get(("SSE", "TTFT"))
    assert ttft is not None and ttft["num_requests"] == n, (
        f"TTFT entries {ttft and ttft['num_requests']} != {n} requests"
    )

    # The server records a request when it finishes, which may trail the client's [DONE] by a
    # moment: wait until the counters reach n (or time runs out), then compare exactly.
    names = (REQUESTS_TOTAL, E2E_COUNT, TTFT_COUNT)
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        after, reasons_after = _scrape(server_url)
        deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in names}
        if all(d >= n for d in deltas.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    missing = [name for name in names if name not in after]
    assert not missing, f"metrics missing from /metrics: {missing}"
    assert deltas == {name: float(n) for name in names}, (
        f"server counters moved by {deltas}, locust counted {n} requests"
    )
    bad = {
        key[1]: value - reasons_before.get(key, 0.0)
        for key, value in reasons_after.items()
        if key[1] in ("abort", "error") and value != reasons_before.get(key, 0.0)
    }
    assert not bad, f"requests that ended as abort/error during the run: {bad}"
