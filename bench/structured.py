"""Structured outputs: grammar compile times and the serving cost of a JSON schema on every request.

Usage (on the GPU): ``python bench/structured.py --ckpt /tmp/qwen3-0.6b-random
--tokenizer-from .benchassets/tokenizer [--concurrency 64]``; on the CPU for a quick check:
``python bench/structured.py --ckpt <embedded checkpoint dir> --device cpu --concurrency 4
--requests 8 --max-tokens 16``.

1. Compile times on the host CPU for the test schemas (``tests/integration/schemas.py``) and the
   benchmark's array schema: uncached (a new llguidance matcher from the grammar text, what the
   first request of a schema pays in the server's validation and again in the engine core) and
   cached (the engine core's per-request copy of the compiled template), p50 / p99 in ms.
2. Serving at one concurrency (streamed chat, ~1,024-token prompts, ``max_tokens`` outputs):
   every request unconstrained (``ignore_eos``); every request constrained by a schema whose
   outputs run past ``max_tokens`` (an array of 150 enum items), so both runs produce the same
   number of tokens; and half of each sharing the batch (two clients at once), reporting the
   unconstrained half's TPOT. Prints output tok/s, TTFT and TPOT, and the constrained /
   unconstrained throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import make_prompts, run_level, wait_health  # noqa: E402

ARRAY_SCHEMA = {
    "type": "array",
    "items": {"enum": ["alpha", "beta", "gamma", "delta"]},
    "minItems": 150,
    "maxItems": 150,
}


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def compile_times(ckpt: str, vocab_size: int, repeats: int) -> dict:
    """{"uncached": (p50, p99), "cached": (p50, p99)} in ms over the schemas x ``repeats``."""
    from llguidance import LLMatcher, LLTokenizer

    from tests.integration.schemas import SCHEMAS

    tok = LLTokenizer((Path(ckpt) / "tokenizer.json").read_text(), n_vocab=vocab_size)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammars = [
        LLMatcher.grammar_from_json_schema(s, defaults=options) for s in [*SCHEMAS, ARRAY_SCHEMA]
    ]
    uncached, cached = [], []
    for _ in range(repeats):
        for g in grammars:
            t = time.perf_counter()
            m = LLMatcher(tok, g, log_level=0)
            uncached.append(1e3 * (time.perf_counter() - t))
            assert not m.is_error(), m.get_error()
            t = time.perf_counter()
            m.deep_copy()
            cached.append(1e3 * (time.perf_counter() - t))
    return {k: (_pct(v, 50), _pct(v, 99)) for k, v in (("uncached", uncached), ("cached", cached))}


def check_outputs(base: str, n: int = 16) -> str:
    """Correctness on this device: ``n`` of the test schemas at temperature 1 through the server
    (the bitmask kernel on the GPU): each must finish with "stop" and parse as JSON holding the
    schema's required keys. Returns "PASS" or the first failure."""
    import httpx

    from tests.integration.schemas import SCHEMAS

    for i, schema in enumerate(SCHEMAS[:n]):
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": "JSON"}],
            "temperature": 1.0,
            "max_tokens": 300,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema},
            },
        }
        c = httpx.post(base + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
        try:
            value = json.loads(c["message"]["content"])
        except ValueError:
            return f"FAIL: schema {i} gave {c['message']['content']!r}"
        missing = set(schema.get("required", [])) - set(value if isinstance(value, dict) else {})
        if c["finish_reason"] != "stop" or missing:
            return f"FAIL: schema {i}: finish {c['finish_reason']}, missing {missing}"
    return "PASS"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--tokenizer-from", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compile-repeats", type=int, default=5)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument(
        "--tree", default=str(REPO), help="source tree whose server is measured (default: this)"
    )
    ap.add_argument("--skip-mixed", action="store_true", help="only the two whole-batch runs")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda":
        from bench.common import random_qwen3_checkpoint

        random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
    ct = compile_times(args.ckpt, vocab, args.compile_repeats)

    port = 8300
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        args.ckpt,
        "--port",
        str(port),
        "--device",
        args.device,
        "--max-model-len",
        "4096",
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
    ]
    if args.device == "cuda":
        cmd += ["--dtype", "bfloat16"]
    base = f"http://127.0.0.1:{port}"
    prompts = make_prompts(args.ckpt, args.requests, args.prompt_tokens)
    plain = {"ignore_eos": True}
    constrained = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "array", "schema": ARRAY_SCHEMA},
        }
    }
    with open(f"{args.out}/structured_server.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=args.tree,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            wait_health(base, proc)
            checked = check_outputs(base)
            run_level(
                base, "bench", prompts[:4], 2, 16, 120, extra=constrained, client_procs=1
            )  # warm-up
            c, mt = args.concurrency, args.max_tokens
            rows = {
                "unconstrained": run_level(base, "bench", prompts, c, mt, 600, extra=plain),
                "json schema": run_level(base, "bench", prompts, c, mt, 600, extra=constrained),
            }
            half = len(prompts) // 2
            mixed: dict = {}

            def client(name, ps, extra):
                mixed[name] = run_level(
                    base, "bench", ps, max(1, c // 2), mt, 600, extra=extra, client_procs=4
                )

            threads = (
                []
                if args.skip_mixed
                else [
                    threading.Thread(
                        target=client, args=("mixed: unconstrained half", prompts[:half], plain)
                    ),
                    threading.Thread(
                        target=client, args=("mixed: constrained half", prompts[half:], constrained)
                    ),
                ]
            )
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rows.update(mixed)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (u50, u99), (c50, c99) = ct["uncached"], ct["cached"]
    print(
        f"\ngrammar compile on the host (ms): uncached p50 {u50:.3f} p99 {u99:.3f}; "
        f"cached (per-request copy) p50 {c50:.4f} p99 {c99:.4f}"
    )
    print("\n| run | conc | done | out tok/s | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        err = f"+{r['errors']} err" if r["errors"] else ""
        ttft = f"{r['ttft_mean']:.1f}/{r['ttft_median']:.1f}/{r['ttft_p99']:.1f}"
        tpot = f"{r['tpot_mean']:.2f}/{r['tpot_median']:.2f}/{r['tpot_p99']:.2f}"
        done = f"{r['completed']}{err}"
        print(f"| {name} | {r['concurrency']} | {done} | {r['out_tok_s']:.0f} | {ttft} | {tpot} |")
    ratio = rows["json schema"]["out_tok_s"] / rows["unconstrained"]["out_tok_s"]
    mixed_tpot = rows.get("mixed: unconstrained half", {}).get("tpot_median", float("nan"))
    print(
        f"\nconstrained / unconstrained output tok/s: {ratio:.3f}; unconstrained TPOT median "
        f"{rows['unconstrained']['tpot_median']:.2f} ms alone vs {mixed_tpot:.2f} ms beside "
        "constrained requests"
    )
    print(f"structured outputs on this device, {16} test schemas at temperature 1: {checked}")
    print(
        json.dumps({"compile_ms": ct, "rows": rows, "ratio": ratio, "check": checked}, default=str)
    )


if __name__ == "__main__":
    main()
