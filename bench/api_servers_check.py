"""A check of ``--api-server-count N`` on a real engine (the GPU): /metrics is one exact view, no
KV block leaks, and SIGTERM ends everything cleanly.

Usage: ``python bench/api_servers_check.py --ckpt DIR [--count 2] [--streams 64]``. Starts
``python -m server --api-server-count N``, runs ``--streams`` concurrent streamed completions
(random prompts and lengths, each on a fresh connection, usage included), then scrapes /metrics
over eight fresh connections (so from several API servers) and checks that every scrape shows
the token counters equal to the clients' usage sums and to the per-request histograms, every
request counted, and every KV block free. Then two long streams and a SIGTERM with
``--graceful-timeout 2``: both streams must end with an error event and ``[DONE]``, the server
exit 0 and none of its processes stay. Prints one line per check and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

P = "qwen_serve:"


def _stream(port: int, body: dict) -> tuple[list[dict], str | None]:
    """The SSE events of one streamed completion (parsed), and the raw last line."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    events, last = [], None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        last = line
        if line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    c.close()
    return events, last


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*"', "", key)
            key = key.replace("{,", "{").replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--port", type=int, default=8393)
    ap.add_argument("--log", default="/tmp/api_servers_check.log")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "server", "--model", args.ckpt, "--port", str(args.port)]
    cmd += ["--api-server-count", str(args.count), "--max-model-len", "4096"]
    cmd += ["--graceful-timeout", "2", "--served-model-name", "m", "--log-level", "info"]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    failures = []

    def check(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    t0 = time.time()
    pids = None
    while time.time() - t0 < 300 and proc.poll() is None:
        m = re.search(
            rf"with {args.count} API servers \(pids ([\d, ]+); engine core pid (\d+)\)",
            open(args.log).read(),
        )
        if m:
            pids = [int(p) for p in m.group(1).split(", ")] + [int(m.group(2))]
            break
        time.sleep(0.5)
    if pids is None:
        print(open(args.log).read()[-4000:])
        proc.kill()
        return 1
    print(f"{args.count} API servers listening {time.time() - t0:.1f} s after start", flush=True)
    rng = random.Random(time.time_ns())
    words = "the of and to in a is that for it as was with be by on not he".split()
    bodies = [
        {
            "model": "m",
            "prompt": " ".join(rng.choice(words) for _ in range(rng.randrange(8, 400))),
            "max_tokens": rng.randrange(8, 96),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(args.streams)
    ]
    with ThreadPoolExecutor(args.streams) as pool:
        results = list(pool.map(lambda b: _stream(args.port, b), bodies))
    usage = [ev[-1]["usage"] for ev, _ in results]
    prompt = sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    check(
        all(last == "data: [DONE]" for _, last in results)
        and completion == sum(b["max_tokens"] for b in bodies),
        f"{args.streams} streams finished with every token ({completion} tokens)",
    )
    views = [_scrape(args.port) for _ in range(8)]
    for i, m in enumerate(views):
        info = next(k for k in m if k.startswith(P + "model_info"))
        blocks = int(re.search(r'num_kv_blocks="(\d+)"', info).group(1))
        ok = (
            m[P + "prompt_tokens_total"] == prompt == m[P + "request_prompt_tokens_sum"]
            and m[P + "generation_tokens_total"]
            == completion
            == m[P + "request_generation_tokens_sum"]
            and m[P + 'request_success_total{finished_reason="length"}'] == args.streams
            and m[P + "num_free_kv_blocks"] == blocks
            and m[P + "num_requests_running"] == 0
        )
        check(
            ok,
            f"scrape {i}: prompt {m[P + 'prompt_tokens_total']:.0f}/{prompt}, generation "
            f"{m[P + 'generation_tokens_total']:.0f}/{completion}, free blocks "
            f"{m[P + 'num_free_kv_blocks']:.0f}/{blocks}",
        )
    long = {"model": "m", "prompt": "once upon a time", "max_tokens": 3500}
    long |= {"ignore_eos": True, "stream": True}
    ends: list = []
    threads = [
        threading.Thread(target=lambda: ends.append(_stream(args.port, long))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)
    t1 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    for t in threads:
        t.join(30)
    ok = len(ends) == 2 and all(
        last == "data: [DONE]"
        and ev
        and ev[-1].get("error", {}).get("code") == "server_shutting_down"
        for ev, last in ends
    )
    check(ok, f"SIGTERM: both long streams ended with the shutdown error and [DONE] ({len(ends)})")
    time.sleep(1.0)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    check(
        code == 0 and not alive,
        f"SIGTERM: exit code {code} after {time.time() - t1:.1f} s, processes left {alive}",
    )
    text = open(args.log).read()
    check("Traceback" not in text, "no traceback in the server log")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
