"""Schemathesis fuzzing of the /v1 routes from the server's own OpenAPI schema: no 5xx, stays
healthy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server():
    srv = ServerProcess("--max-model-len", "96", "--max-num-seqs", "32").wait_ready()
    yield srv
    srv.stop()


def test_schemathesis_no_server_errors(fuzz_server, tmp_path):
    exe = Path(sys.executable).with_name("schemathesis")
    cli = str(exe) if exe.exists() else shutil.which("schemathesis")
    assert cli, "schemathesis is a test dependency"
    base = fuzz_server.base_url
    cmd = [
        cli,
        "run",
        base + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--include-path-regex",
        "^/v1/",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "1",
        "--request-timeout",
        "120",
        "--no-color",
        "--workers",
        "1",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:] + fuzz_server.log()
    assert httpx.get(base + "/health").status_code == 200
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200
    m = scrape(base)
    assert m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m)
