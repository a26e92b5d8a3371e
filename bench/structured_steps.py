"""Where the engine core's time goes in steps that hold structured-output requests.

Usage (on the GPU): ``python bench/structured_steps.py --ckpt /tmp/qwen3-0.6b-random
--tokenizer-from .benchassets/tokenizer [--batch 64]``; on the CPU for a quick check:
``python bench/structured_steps.py --device cpu --batch 4 --max-tokens 8`` (embedded model).

1. Mask fill alone: llguidance's ``LLExecutor`` filling the bitmasks of ``--batch`` matchers of
   the benchmark's array schema (``bench/structured.py``'s ``ARRAY_SCHEMA``) at 1, 2, 4, 8 and
   the default number of threads, and advancing them one token each (``consume_token`` in a
   loop, and ``LLExecutor.consume_token_par``): ms per step, median of 50 steps.
2. The engine with the server's defaults (``bench/ab_engine.server_default_engine``), no HTTP:
   ``--batch`` requests of ~``--prompt-len`` random tokens decoding ``--max-tokens`` tokens,
   first unconstrained (``ignore_eos``), then each constrained by the array schema (whose
   outputs run the full ``max_tokens``), then half and half. Per run: output tok/s over the
   decode phase, median step wall time, and the host time per step spent in each engine phase
   (perf_counter around the scheduler, the executor's launch, the output processing, the mask
   fill and the matchers' advance; nested phases are included in their parents).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.structured import ARRAY_SCHEMA  # noqa: E402

#: the engine phases timed per step (perf_counter; nested ones are included in their parents)
PHASES = ("schedule", "executor.launch", "process outputs", "grammar accept", "fill bitmasks")


def _timed(store: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store[name] += time.perf_counter() - t

    return wrapper


def mask_fill(tokenizer_json: Path, vocab: int, batch: int) -> None:
    """Section 1: the grammar work of one step outside the engine."""
    import ctypes

    from llguidance import LLExecutor, LLMatcher, LLTokenizer

    from server.structured_outputs import JSON_OPTIONS

    t = time.perf_counter()
    tok = LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab)
    print(f"llguidance tokenizer built in {time.perf_counter() - t:.2f} s; {os.cpu_count()} CPUs")
    grammar = LLMatcher.grammar_from_json_schema(ARRAY_SCHEMA, defaults=JSON_OPTIONS)
    mask_bytes = 4 * ((vocab + 31) // 32)
    # a valid output of the schema, tokenized: every matcher consumes its tokens in turn
    words = ["alpha", "beta", "gamma", "delta"]
    text = "[" + ", ".join(f'"{words[i % 4]}"' for i in range(150)) + "]"
    seq = tok.tokenize_str(text)
    print("| threads | mask fill ms/step | consume loop ms | consume_token_par ms |")
    print("|---|---|---|---|")
    for threads in (1, 2, 4, 8, None):
        ex = LLExecutor(num_threads=threads) if threads else LLExecutor()
        ms = [LLMatcher(tok, grammar, log_level=0) for _ in range(batch)]
        buf = bytearray(batch * mask_bytes)
        view = (ctypes.c_char * len(buf)).from_buffer(buf)
        fill, loop, par = [], [], []
        for step in range(min(60, len(seq) - 1)):
            t0 = time.perf_counter()
            ex.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(ms)], ctypes.addressof(view), mask_bytes, batch
            )
            t1 = time.perf_counter()
            token = seq[step]
            if step % 2:
                for m in ms:
                    m.consume_token(token)
                loop.append(time.perf_counter() - t1)
            else:
                ex.consume_token_par([(m, token) for m in ms])
                par.append(time.perf_counter() - t1)
            assert not ms[0].is_error(), ms[0].get_error()
            if step >= 10:
                fill.append(t1 - t0)
        del view
        print(
            f"| {threads or 'default'} | {1e3 * statistics.median(fill):.3f} | "
            f"{1e3 * statistics.median(loop):.3f} | {1e3 * statistics.median(par):.3f} |"
        )


def engine_runs(args) -> None:
    """Section 2: phase times of the engine core's steps."""
    import torch
    from llguidance import LLMatcher

    from bench.ab_engine import load_engine_api, server_default_engine
    from engine.core import structured_output as so
    from engine.core.structured_output import StructuredOutputSpec
    from server.structured_outputs import JSON_OPTIONS

    build, EngineConfig, SamplingParams = load_engine_api(REPO)
    eng = server_default_engine(build, EngineConfig, args.ckpt, args.device)
    spec = StructuredOutputSpec(
        LLMatcher.grammar_from_json_schema(ARRAY_SCHEMA, defaults=JSON_OPTIONS)
    )
    times: dict[str, float] = collections.defaultdict(float)
    eng.scheduler.schedule = _timed(times, "schedule", eng.scheduler.schedule)
    eng._process = _timed(times, "process outputs", eng._process)
    eng._fill_bitmasks = _timed(times, "fill bitmasks", eng._fill_bitmasks)
    ex = eng.executor
    ex.launch = _timed(times, "executor.launch", ex.launch)
    accept = so.GrammarState.accept
    so.GrammarState.accept = _timed(times, "grammar accept", accept)
    rng = random.Random(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print("| run | decode out tok/s | step ms median | " + " | ".join(PHASES) + " |")
    print("|---" * (3 + len(PHASES)) + "|")
    for label, constrained in (
        ("unconstrained", lambda i: False),
        ("json schema on every request", lambda i: True),
        ("half constrained", lambda i: i % 2 == 0),
        ("unconstrained again", lambda i: False),
    ):
        # warm: the first constrained run builds the llguidance tokenizer and compiles
        for rep in range(2):
            for i in range(args.batch):
                c = constrained(i)
                eng.add_request(
                    f"{label}-{rep}-{i}",
                    [rng.randrange(1000, 100000) for _ in range(args.prompt_len)],
                    SamplingParams(
                        temperature=1.0,
                        seed=i,
                        max_tokens=args.max_tokens,
                        ignore_eos=not c,
                        **({"structured_output": spec} if c else {}),
                    ),
                )
            while eng.scheduler.waiting_for_grammar or eng.scheduler.waiting:
                eng.step()  # prefills (and grammar compiles)
            sync()
            times.clear()
            steps, n_out, t_start = [], 0, time.perf_counter()
            while eng.has_unfinished():
                t = time.perf_counter()
                outs, _ = eng.step()
                steps.append(time.perf_counter() - t)
                n_out += sum(len(o.new_token_ids) for o in outs)
            sync()
            wall = time.perf_counter() - t_start
        n = max(1, len(steps))
        print(
            f"| {label} | {n_out / wall:,.0f} | {1e3 * statistics.median(steps):.2f} | "
            + " | ".join(f"{1e3 * times.get(c, 0.0) / n:.3f}" for c in PHASES)
            + " |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None, help="default: the embedded model")
    ap.add_argument("--tokenizer-from", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    if args.ckpt is None:
        from engine.loader.embedded import ensure_embedded_checkpoint

        args.ckpt = str(ensure_embedded_checkpoint())
    else:
        from bench.common import random_qwen3_checkpoint

        random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    import json

    vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
    mask_fill(Path(args.ckpt) / "tokenizer.json", vocab, args.batch)
    if not args.skip_engine:
        engine_runs(args)


if __name__ == "__main__":
    main()
