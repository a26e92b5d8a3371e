"""Online serving benchmark in the manner of ``vllm bench serve``: this server vs
``transformers serve``.

Usage (on the GPU): ``python bench/serve.py --ckpt DIR [--concurrency 1 16 64 256] [--skip-peer]``;
against a running server (e.g. ``make serve`` on the CPU): ``python bench/serve.py --base-url
http://127.0.0.1:8000 --prompt-tokens 64 --max-tokens 16 --concurrency 1 4``.
Random ~1024-token chat prompts, 128 output tokens, all requests sent at once under a max
concurrency; streaming; measures request throughput, output tokens/s, TTFT, TPOT and ITL
(mean, median, p99). The checkpoint directory needs a tokenizer (tokenizer.json + config).

The client is spread over up to ``--client-procs`` processes (default 8, at most one per unit of
concurrency), each with its own event loop (uvloop when importable) and HTTP client (aiohttp
when importable, as ``vllm bench serve``; else httpx), so that one Python process reading ~7k
SSE events/s cannot fall behind and stamp several events at once. Each process's CPU time /
wall time is reported (``client_cpu``): near 100% means the client, not the server, set the pace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


#: request fields per ``--sampling`` (on top of the body's temperature 0)
SAMPLING = {
    "greedy": {},
    "qwen3": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
}


def make_prompts(ckpt: str, n: int, target_tokens: int, seed: int = 0) -> list[str]:
    """Texts of about ``target_tokens`` tokens: random ordinary-token ids decoded with the
    checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1000, 30000) for _ in range(target_tokens)]
        text = tok.decode(ids)
        out.append(tok.decode(tok.encode(text).ids[: target_tokens - 20]))
    return out


class _Stream:
    """One streamed POST with aiohttp when importable (as ``vllm bench serve``), else httpx.

    Args:
        limit: most connections at once (the worker's share of the concurrency).
    """

    def __init__(self, limit: int):
        try:
            import aiohttp
        except ImportError:
            aiohttp = None
        self.lib = "aiohttp" if aiohttp is not None else "httpx"
        self._aiohttp, self._limit, self._session = aiohttp, limit, None

    async def __aenter__(self):
        if self._aiohttp is not None:
            a = self._aiohttp
            self._session = a.ClientSession(
                connector=a.TCPConnector(limit=self._limit + 8),
                timeout=a.ClientTimeout(total=6 * 3600),
            )
        else:
            limits = httpx.Limits(
                max_connections=self._limit + 8, max_keepalive_connections=self._limit + 8
            )
            self._session = httpx.AsyncClient(timeout=600, limits=limits)
        await self._session.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self._session.__aexit__(*exc)

    async def post(self, url: str, body: dict):
        """Async iterator over the response's byte chunks as they are read from the socket.

        Raises:
            RuntimeError: a status other than 200 (with the start of the body).
        """
        if self._aiohttp is not None:
            async with self._session.post(url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
                async for data in r.content.iter_any():
                    yield data
        else:
            async with self._session.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for data in r.aiter_raw():
                    yield data


def sse_events(buffer: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """Split SSE bytes into the ``data:`` payloads of complete events; returns (payloads, rest).

    ``buffer`` is what the previous call left (an event cut across reads); events end with a
    blank line.
    """
    buffer += data
    *events, rest = buffer.split(b"\n\n")
    payloads = []
    for ev in events:
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip())
    return payloads, rest


async def one_request(
    client: _Stream, url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> dict:
    """One streamed chat request, timed as ``vllm bench serve`` times it (seconds, perf_counter).

    TTFT: until the first chunk with content (or reasoning_content); the role chunk sent before
    the engine runs does not count. ITL: per chunk, from each chunk with choices after the first
    content chunk to the one before it (a chunk carrying several tokens counts once; the finish
    chunk counts too). TPOT: (last chunk - first content) / (output tokens - 1). Chunks read
    from the socket together share one timestamp.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.perf_counter()
    first = last = None
    itls, usage, n_chunks, rest = [], None, 0, b""
    async for data in client.post(url, body):
        t = time.perf_counter()
        payloads, rest = sse_events(rest, data)
        for payload in payloads:
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices")
            if not choices:
                continue
            if first is None:
                if any(
                    c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content")
                    for c in choices
                ):
                    first = last = t
                    n_chunks = 1
                continue
            itls.append(t - last)
            last = t
            n_chunks += 1
    end = time.perf_counter()
    if first is None:
        return {"ok": False, "error": "no tokens"}
    n_out = usage["completion_tokens"] if usage else n_chunks
    return {
        "ok": True,
        "start": t0,
        "end": end,
        "ttft": first - t0,
        "e2e": end - t0,
        "n_out": n_out,
        "n_chunks": n_chunks,
        "itls": itls,
        "tpot": (last - first) / max(1, n_out - 1),
    }


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _event_loop_runner():
    """uvloop's loop when importable (as on the GPU image), else asyncio's; returns
    (runner, name)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner(), "asyncio"
    return asyncio.Runner(loop_factory=uvloop.new_event_loop), "uvloop"


def _client_worker(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    time_cap: float,
    extra: dict | None,
    start,
    results,
) -> None:
    """A client process: its share of the prompts at its share of the concurrency, on its own loop.

    Waits at the ``start`` barrier, then puts ``{"records", "t0", "t_end", "cpu", "wall", "lib",
    "loop"}`` on ``results``: the raw per-request records (perf_counter seconds: CLOCK_MONOTONIC,
    one clock for all processes on Linux) and its CPU time and wall time (seconds) of the run.
    """
    runner, loop_name = _event_loop_runner()
    client = _Stream(concurrency)

    async def run() -> list:
        sem = asyncio.Semaphore(concurrency)
        deadline = time.perf_counter() + time_cap
        async with client:

            async def guarded(p):
                async with sem:
                    if time.perf_counter() > deadline:
                        return None
                    try:
                        return await one_request(client, url, model, p, max_tokens, extra)
                    except Exception as exc:  # noqa: BLE001 - counted as a failed request, as vllm bench does
                        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

            return await asyncio.gather(*(guarded(p) for p in prompts))

    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    with runner:
        records = runner.run(run())
    t_end, c_end = time.perf_counter(), time.process_time()
    results.put(
        {
            "records": records,
            "t0": t0,
            "t_end": t_end,
            "cpu": c_end - c0,
            "wall": t_end - t0,
            "lib": client.lib,
            "loop": loop_name,
        }
    )


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal whole shares (larger shares first)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def run_level(
    base: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    time_cap: float,
    extra: dict | None = None,
    client_procs: int = 8,
) -> dict:
    """All ``prompts`` at most ``concurrency`` at a time, spread over ``min(client_procs,
    concurrency)`` client processes (so the client cannot be what limits the server); merges
    their records into the level's statistics (ms) and reports each process's CPU use."""
    procs = max(1, min(client_procs, concurrency))
    conc = split(concurrency, procs)
    shares = [0] * procs  # requests per process, in proportion to its concurrency
    for _ in range(len(prompts)):
        shares[min(range(procs), key=lambda j: shares[j] / conc[j])] += 1
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers, lo = [], 0
    for c, n in zip(conc, shares):
        workers.append(
            ctx.Process(
                target=_client_worker,
                daemon=True,
                args=(
                    base + "/v1/chat/completions",
                    model,
                    prompts[lo : lo + n],
                    c,
                    max_tokens,
                    time_cap,
                    extra,
                    start,
                    results,
                ),
            )
        )
        lo += n
    for w in workers:
        w.start()
    start.wait()
    outs = [results.get() for _ in workers]
    for w in workers:
        w.join()
    results_all = [r for o in outs for r in o["records"]]
    dur = max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)
    ok = [r for r in results_all if r and r["ok"]]
    errors = [r["error"] for r in results_all if r and not r["ok"]]
    itls = [x for r in ok for x in r["itls"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    cpu = [o["cpu"] / o["wall"] for o in outs]
    return {
        "concurrency": concurrency,
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[:1],
        "duration": dur,
        "req_s": len(ok) / dur,
        "out_tok_s": sum(r["n_out"] for r in ok) / dur,
        **{f"ttft_{k}": f(ttft) * 1e3 for k, f in _STATS.items()},
        **{f"tpot_{k}": f(tpot) * 1e3 for k, f in _STATS.items()},
        **{f"itl_{k}": f(itls) * 1e3 for k, f in _STATS.items()},
        "tokens_per_chunk": sum(r["n_out"] for r in ok) / max(1, sum(r["n_chunks"] for r in ok)),
        "client_procs": procs,
        "client_lib": f"{outs[0]['lib']}/{outs[0]['loop']}",
        "client_cpu": [round(x, 3) for x in cpu],
        "client_cpu_max": max(cpu),
    }


_STATS = {
    "mean": lambda x: statistics.fmean(x) if x else float("nan"),
    "median": lambda x: pct(x, 50),
    "p99": lambda x: pct(x, 99),
}


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
        time.sleep(0.25)
    raise TimeoutError("server did not become healthy")


def run_levels(
    name: str, base: str, model: str, args, prompts: list[str], pid: int | None = None
) -> list[dict]:
    """A warm-up, then each concurrency level of ``args`` against the server at ``base``.

    ``prompts`` holds :func:`prompts_needed` distinct prompts: the warm-up and every level take
    their own, so no level reuses an earlier one's (no prefix-cache hits across levels); each
    level's prefix-cache hit rate, read from the server's /metrics, is reported (ours only).
    """
    run_level(base, model, prompts[:WARMUP_PROMPTS], 2, 16, 120, client_procs=1)  # warm-up
    lo = WARMUP_PROMPTS
    rows = []
    levels = (
        args.concurrency
        if name == "qwen-serve" or not args.peer_concurrency
        else args.peer_concurrency
    )
    for c in levels:
        n = max(args.min_requests, c * args.requests_per_concurrency)
        cap = args.peer_time_cap if name != "qwen-serve" else 600
        extra = (
            {"ignore_eos": True, **SAMPLING[args.sampling]} if name == "qwen-serve" else None
        )  # the peer rejects unknown fields
        spy = None
        if (
            pid is not None and name == "qwen-serve" and c == args.py_spy_level
        ):  # sample the server's Python stacks
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-d",
                    str(args.py_spy_seconds),
                    "--subprocesses",
                    "--nonblocking",
                    "-f",
                    "raw",
                    "-o",
                    f"{args.out}/pyspy_c{c}.txt",
                    "-p",
                    str(pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        before = prefix_cache_counters(base) if name == "qwen-serve" else None
        r = run_level(
            base,
            model,
            prompts[lo : lo + n],
            c,
            args.max_tokens,
            cap,
            extra,
            client_procs=args.client_procs,
        )
        lo += n
        if before is not None:
            after = prefix_cache_counters(base)
            queried = after[0] - before[0]
            r["prefix_hit_rate"] = (after[1] - before[1]) / queried if queried else 0.0
        if spy is not None:
            try:
                spy.wait(args.py_spy_seconds + 30)
            except subprocess.TimeoutExpired:
                spy.kill()
        r["name"] = name
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


#: prompts of the warm-up before the levels
WARMUP_PROMPTS = 4


def prompts_needed(args, levels: list[int]) -> int:
    """Distinct prompts for the warm-up and every level of ``levels``."""
    return WARMUP_PROMPTS + sum(
        max(args.min_requests, c * args.requests_per_concurrency) for c in levels
    )


def prefix_cache_counters(base: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefix cache, from the server's /metrics."""
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {}
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"qwen_serve:{name}_total"):
                total += float(line.rsplit(" ", 1)[1])
        values[name] = total
    return values["prefix_cache_queries"], values["prefix_cache_hits"]


def bench_server(
    name: str,
    cmd: list[str],
    port: int,
    model: str,
    args,
    prompts,
    log_path: str,
    root: Path = REPO,
) -> list[dict]:
    """Start a server with ``cmd`` in source tree ``root``, run the levels against it, stop it."""
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if root != REPO:
        env["PYTHONPATH"] = f"{root}:{env.get('PYTHONPATH', '')}"
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env)
        try:
            wait_health(base, proc)
            # start-up: imports, weight load, KV-cache sizing, warm-up and CUDA-graph capture
            print(f"{name}: healthy {time.perf_counter() - t0:.1f} s after start", flush=True)
            return run_levels(name, base, model, args, prompts, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def print_table(rows: list[dict]) -> None:
    """The markdown table of all levels (ms; client CPU: the busiest client process's CPU time /
    wall time)."""
    print(
        "\n| server | conc | done | req/s | out tok/s | TTFT mean/med/p99 ms "
        "| TPOT mean/med/p99 ms | ITL mean/med/p99 ms "
        "| tok/chunk | client procs | client CPU max | prefix hits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hits = r.get("prefix_hit_rate")
        print(
            f"| {r['name']} | {r['concurrency']} | {r['completed']}"
            f"{'+' + str(r['errors']) + ' err' if r['errors'] else ''} "
            f"| {r['req_s']:.2f} | {r['out_tok_s']:.0f} "
            f"| {r['ttft_mean']:.1f}/{r['ttft_median']:.1f}/{r['ttft_p99']:.1f} "
            f"| {r['tpot_mean']:.2f}/{r['tpot_median']:.2f}/{r['tpot_p99']:.2f} "
            f"| {r['itl_mean']:.2f}/{r['itl_median']:.2f}/{r['itl_p99']:.2f} "
            f"| {r['tokens_per_chunk']:.2f} | {r['client_procs']} ({r['client_lib']}) "
            f"| {100 * r['client_cpu_max']:.0f}% "
            f"| {'-' if hits is None else f'{100 * hits:.1f}%'} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ckpt",
        default=None,
        help="checkpoint to serve (a random Qwen3-0.6B is written there once)",
    )
    ap.add_argument(
        "--base-url",
        default=None,
        help="benchmark a server that is already running "
        "(e.g. http://127.0.0.1:8000 for `make serve`) "
        "instead of starting one; prompts use --ckpt's tokenizer, or the embedded model's",
    )
    ap.add_argument(
        "--served-model", default="qwen3-embedded", help="model name sent with --base-url"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument(
        "--sampling",
        choices=sorted(SAMPLING),
        default="greedy",
        help="our server's requests: greedy (temperature 0), or qwen3 (Qwen3's "
        "generation_config sampling: temperature 0.6, top_p 0.95, top_k 20; the peer stays "
        "greedy)",
    )
    ap.add_argument("--requests-per-concurrency", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--client-procs",
        type=int,
        default=8,
        help="client processes per level, each with its own event loop and a share of the "
        "concurrency (capped by the concurrency)",
    )
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument(
        "--peer-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="concurrency levels for the peer (default: --concurrency)",
    )
    ap.add_argument("--peer-time-cap", type=float, default=60)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument(
        "--tokenizer-from", default=None, help="copy tokenizer files from this directory"
    )
    ap.add_argument(
        "--py-spy-level",
        type=int,
        default=None,
        help="record py-spy stacks of the server at this concurrency",
    )
    ap.add_argument("--py-spy-seconds", type=int, default=8)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="our server's --max-model-len (default: the checkpoint's max_position_embeddings)",
    )
    ap.add_argument(
        "--server-args",
        nargs="*",
        default=[],
        help="extra flags of our server (e.g. --prefill-only-token-budget 8192); each value is "
        "split like a shell line, so one --server-args='--a=1 --b=2' passes two flags",
    )
    ap.add_argument(
        "--server-root",
        default=str(REPO),
        help="source tree to start our server from (A/B runs of two trees)",
    )
    args = ap.parse_args()
    if args.ckpt is None and args.base_url is None:
        ap.error("give --ckpt (start the servers) or --base-url (a running server)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.base_url is not None:
        if args.ckpt is None:
            from engine.loader.embedded import ensure_embedded_checkpoint

            args.ckpt = str(ensure_embedded_checkpoint())
        rows = run_levels(
            "qwen-serve",
            args.base_url.rstrip("/"),
            args.served_model,
            args,
            make_prompts(args.ckpt, prompts_needed(args, args.concurrency), args.prompt_tokens),
        )
        print_table(rows)
        return
    from bench.common import random_qwen3_checkpoint

    random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    levels = sorted({*args.concurrency, *(args.peer_concurrency or [])})
    prompts = make_prompts(args.ckpt, prompts_needed(args, levels), args.prompt_tokens)
    max_len = args.max_model_len or json.loads((Path(args.ckpt) / "config.json").read_text()).get(
        "max_position_embeddings", 4096
    )
    rows = (
        []
        if args.skip_ours
        else bench_server(
            "qwen-serve",
            [
                sys.executable,
                "-m",
                "server",
                "--model",
                args.ckpt,
                "--port",
                "8100",
                "--dtype",
                "bfloat16",
                "--max-model-len",
                str(max_len),
                *[a for s in args.server_args for a in shlex.split(s)],
                "--served-model-name",
                "bench",
                "--log-level",
                "warning",
            ],
            8100,
            "bench",
            args,
            prompts,
            f"{args.out}/ours.log",
            Path(args.server_root).resolve(),
        )
    )
    if not args.skip_peer:
        peer = [
            "transformers",
            "serve",
            "--continuous-batching",
            "--cb-use-cuda-graph",
            "--port",
            "8200",
        ]
        for i, cmd in enumerate(
            [peer[:2] + [args.ckpt] + peer[2:], peer]
        ):  # newer CLIs take the model first
            try:
                rows += bench_server(
                    "transformers serve",
                    cmd,
                    8200,
                    args.ckpt,
                    args,
                    prompts,
                    f"{args.out}/peer{i}.log",
                )
                break
            except Exception as exc:  # noqa: BLE001 - report our numbers anyway
                print(f"peer command {cmd} failed: {type(exc).__name__}: {exc}")
    print_table(rows)
    ours = {r["concurrency"]: r for r in rows if r["name"] == "qwen-serve"}
    for r in rows:
        if r["name"] != "qwen-serve" and r["concurrency"] in ours and r["out_tok_s"] > 0:
            print(
                f"ratio at concurrency {r['concurrency']}: "
                f"{ours[r['concurrency']]['out_tok_s'] / r['out_tok_s']:.1f}x output tok/s"
            )


if __name__ == "__main__":
    main()
