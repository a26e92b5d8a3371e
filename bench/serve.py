"""Online serving benchmark in the manner of ``vllm bench serve``: this server vs ``transformers serve``.

Usage (on the GPU): ``python bench/serve.py --ckpt DIR [--concurrency 1 16 64 256] [--skip-peer]``
Random ~1024-token chat prompts, 128 output tokens, all requests sent at once under a max
concurrency; streaming; measures request throughput, output tokens/s, TTFT, TPOT and ITL
(mean, median, p99). The checkpoint directory needs a tokenizer (tokenizer.json + config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_prompts(ckpt: str, n: int, target_tokens: int, seed: int = 0) -> list[str]:
    """Texts of about ``target_tokens`` tokens: random ordinary-token ids decoded with the checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1000, 30000) for _ in range(target_tokens)]
        text = tok.decode(ids)
        out.append(tok.decode(tok.encode(text).ids[: target_tokens - 20]))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                d = c.get("delta", {})
                if d.get("content") or d.get("reasoning_content"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    if not times:
        return {"ok": False, "error": "no tokens"}
    n_out = usage["completion_tokens"] if usage else len(times)
    itls = [b - a for a, b in zip(times, times[1:])]
    return {"ok": True, "ttft": times[0] - t0, "e2e": end - t0, "n_out": n_out, "itls": itls,
            "tpot": (end - times[0]) / max(1, n_out - 1)}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run_level(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, time_cap: float,
                    extra: dict | None = None) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        deadline = time.perf_counter() + time_cap

        async def guarded(p):
            async with sem:
                if time.perf_counter() > deadline:
                    return None
                try:
                    return await one_request(client, base + "/v1/chat/completions", model, p, max_tokens, extra)
                except httpx.HTTPError as exc:
                    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        dur = time.perf_counter() - t0
    ok = [r for r in results if r and r["ok"]]
    errors = [r["error"] for r in results if r and not r["ok"]]
    itls = [x for r in ok for x in r["itls"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    return {
        "concurrency": concurrency, "completed": len(ok), "errors": len(errors), "first_error": errors[:1],
        "duration": dur, "req_s": len(ok) / dur, "out_tok_s": sum(r["n_out"] for r in ok) / dur,
        **{f"ttft_{k}": f(ttft) * 1e3 for k, f in _STATS.items()},
        **{f"tpot_{k}": f(tpot) * 1e3 for k, f in _STATS.items()},
        **{f"itl_{k}": f(itls) * 1e3 for k, f in _STATS.items()},
    }


_STATS = {"mean": lambda x: statistics.fmean(x) if x else float("nan"),
          "median": lambda x: pct(x, 50), "p99": lambda x: pct(x, 99)}


def wait_health(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(base + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise TimeoutError("server did not become healthy")


def bench_server(name: str, cmd: list[str], port: int, model: str, args, prompts, log_path: str) -> list[dict]:
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_health(base, proc)
            asyncio.run(run_level(base, model, prompts[:4], 2, 16, 120))  # warm-up
            rows = []
            levels = args.concurrency if name == "qwen-serve" or not args.peer_concurrency else args.peer_concurrency
            for c in levels:
                n = max(args.min_requests, c * args.requests_per_concurrency)
                cap = args.peer_time_cap if name != "qwen-serve" else 600
                extra = {"ignore_eos": True} if name == "qwen-serve" else None  # the peer rejects unknown fields
                spy = None
                if name == "qwen-serve" and c == args.py_spy_level:  # sample the server's Python stacks
                    spy = subprocess.Popen(["py-spy", "record", "-d", str(args.py_spy_seconds), "--subprocesses",
                                            "--nonblocking", "-f", "raw", "-o", f"{args.out}/pyspy_c{c}.txt",
                                            "-p", str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                r = asyncio.run(run_level(base, model, prompts[:n], c, args.max_tokens, cap, extra))
                if spy is not None:
                    try:
                        spy.wait(args.py_spy_seconds + 30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                r["name"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
            return rows
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests-per-concurrency", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--peer-concurrency", type=int, nargs="+", default=None,
                    help="concurrency levels for the peer (default: --concurrency)")
    ap.add_argument("--peer-time-cap", type=float, default=60)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--tokenizer-from", default=None, help="copy tokenizer files from this directory")
    ap.add_argument("--py-spy-level", type=int, default=None, help="record py-spy stacks of the server at this concurrency")
    ap.add_argument("--py-spy-seconds", type=int, default=8)
    args = ap.parse_args()
    from bench.common import random_qwen3_checkpoint

    random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    n = max(args.min_requests, max(args.concurrency) * args.requests_per_concurrency)
    prompts = make_prompts(args.ckpt, n, args.prompt_tokens)
    rows = [] if args.skip_ours else bench_server("qwen-serve", [sys.executable, "-m", "server", "--model", args.ckpt, "--port", "8100",
                                       "--dtype", "bfloat16", "--max-model-len", "4096", "--served-model-name", "bench",
                                       "--log-level", "warning"], 8100, "bench", args, prompts, f"{args.out}/ours.log")
    if not args.skip_peer:
        peer = ["transformers", "serve", "--continuous-batching", "--cb-use-cuda-graph", "--port", "8200"]
        for i, cmd in enumerate([peer[:2] + [args.ckpt] + peer[2:], peer]):  # newer CLIs take the model first
            try:
                rows += bench_server("transformers serve", cmd, 8200, args.ckpt, args, prompts, f"{args.out}/peer{i}.log")
                break
            except Exception as exc:  # noqa: BLE001 - report our numbers anyway
                print(f"peer command {cmd} failed: {type(exc).__name__}: {exc}")
    print("\n| server | conc | done | req/s | out tok/s | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms | ITL mean/med/p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['concurrency']} | {r['completed']}{'+' + str(r['errors']) + ' err' if r['errors'] else ''} "
              f"| {r['req_s']:.2f} | {r['out_tok_s']:.0f} | {r['ttft_mean']:.1f}/{r['ttft_median']:.1f}/{r['ttft_p99']:.1f} "
              f"| {r['tpot_mean']:.2f}/{r['tpot_median']:.2f}/{r['tpot_p99']:.2f} "
              f"| {r['itl_mean']:.2f}/{r['itl_median']:.2f}/{r['itl_p99']:.2f} |")
    ours = {r["concurrency"]: r for r in rows if r["name"] == "qwen-serve"}
    for r in rows:
        if r["name"] != "qwen-serve" and r["concurrency"] in ours and r["out_tok_s"] > 0:
            print(f"ratio at concurrency {r['concurrency']}: {ours[r['concurrency']]['out_tok_s'] / r['out_tok_s']:.1f}x output tok/s")


if __name__ == "__main__":
    main()
