"""The HTTP process's CPU time per streamed token, with a scripted engine core instead of a model.

Usage: ``python bench/frontend_tokens.py [--concurrency 64] [--max-tokens 128] [--step-ms 5]
[--profile out.pstats]``. Serves the real app (chat endpoint, embedded tokenizer, metrics,
uvicorn as ``python -m server`` configures it) in this process over an engine core that emits
one token per running request every ``--step-ms`` from a thread, as the engine process's reader
thread does; ``bench/serve.py``'s client processes stream ``--concurrency`` chat requests at
once. Reports this process's CPU time (all its threads) per output token and per SSE chunk, in
microseconds: the front end's cost of a token (request stream, detokenization, SSE framing,
Starlette, uvicorn), without a model competing for the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.core.commands import AbortRequest, AddRequest, Command
from engine.core.limits import EngineLimits
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason
from engine.core.stats import StepStats


class ScriptedCore:
    """An engine core (``engine.frontend.core_client.EngineCoreClient``) that emits one token
    per running request every ``step_s`` seconds from its own thread: ids drawn from ordinary
    vocabulary tokens, finished with ``length`` at the request's ``max_tokens``."""

    engine = None

    def __init__(self, limits: EngineLimits, step_s: float, seed: int = 0):
        self.limits, self.step_s = limits, step_s
        self._lock = threading.Lock()
        self._running: dict[str, list[int]] = {}  # request id -> [tokens left]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(seed)

    def start(self, emit, on_death) -> None:
        def run():
            while not self._stop.wait(self.step_s):
                with self._lock:
                    outputs = []
                    for rid, left in list(self._running.items()):
                        left[0] -= 1
                        done = left[0] == 0
                        outputs.append(
                            RequestOutput(
                                rid,
                                [self._rng.randint(1000, 30000)],
                                finished=done,
                                finish_reason=FinishReason.LENGTH if done else None,
                            )
                        )
                        if done:
                            del self._running[rid]
                if outputs:
                    emit(
                        outputs,
                        StepStats(
                            len(self._running), 0, 1, 1, 0.0, 0, len(outputs), 0, 0, 0, self.step_s
                        ),
                    )

        self._thread = threading.Thread(target=run, name="scripted-core", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._lock:
            if isinstance(command, AddRequest):
                self._running[command.request_id] = [command.params.max_tokens]
            elif isinstance(command, AbortRequest):
                self._running.pop(command.request_id, None)

    def shutdown(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None, help="default: 2 x concurrency")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=5.0, help="ms between scripted engine steps")
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument("--port", type=int, default=8401)
    ap.add_argument(
        "--profile", default=None, help="write a cProfile of the event-loop thread here"
    )
    args = ap.parse_args()

    import logging

    from bench.serve import make_prompts, run_level
    from engine.frontend.async_engine import AsyncEngine
    from engine.frontend.tokenizer import Tokenizer
    from engine.loader.embedded import ensure_embedded_checkpoint
    from server.__main__ import build_parser
    from server.app import create_app
    from server.context import ServerContext
    from server.http_server import make_server
    from server.metrics import ServerMetrics
    from server.prompt_encoder import PromptEncoder

    logging.basicConfig(level=logging.WARNING)
    sargs = build_parser().parse_args(["--port", str(args.port), "--log-level", "warning"])
    tokenizer = Tokenizer(ensure_embedded_checkpoint())
    limits = EngineLimits(
        max_model_len=4096,
        vocab_size=151936,
        eos_token_ids=tokenizer.eos_token_ids,
        num_kv_blocks=1 << 16,
        block_size=16,
        max_num_batched_tokens=8192,
        enable_chunked_prefill=True,
        dtype="none",
    )
    metrics = ServerMetrics("scripted", {})
    ctx = ServerContext(
        engine=AsyncEngine(ScriptedCore(limits, args.step_ms / 1e3), on_step=metrics.on_step),
        tokenizer=tokenizer,
        model_name="scripted",
        metrics=metrics,
        encoder=PromptEncoder(tokenizer),
    )
    server = make_server(create_app(ctx), sargs)
    n = args.requests or 2 * args.concurrency
    prompts = make_prompts(str(tokenizer.path), n, args.prompt_tokens)
    result: dict = {}

    def drive():
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{args.port}"
        run_level(base, "scripted", prompts[:4], 2, 8, 60, client_procs=1)  # warm-up
        c0, t0 = time.process_time(), time.perf_counter()
        result.update(
            run_level(
                base,
                "scripted",
                prompts,
                args.concurrency,
                args.max_tokens,
                600,
                extra={"ignore_eos": True},
                client_procs=args.client_procs,
            )
        )
        result["server_cpu_s"], result["wall_s"] = (
            time.process_time() - c0,
            time.perf_counter() - t0,
        )
        server.should_exit = True

    threading.Thread(target=drive, daemon=True).start()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    server.run()
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    tokens = result["out_tok_s"] * result["duration"]
    chunks = tokens / result["tokens_per_chunk"]
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "completed",
                    "errors",
                    "out_tok_s",
                    "itl_median",
                    "itl_p99",
                    "tokens_per_chunk",
                    "client_cpu_max",
                    "server_cpu_s",
                    "wall_s",
                )
            }
        )
    )
    print(
        f"server CPU: {1e6 * result['server_cpu_s'] / tokens:.1f} us per output token, "
        f"{1e6 * result['server_cpu_s'] / chunks:.1f} us per chunk with choices, "
        f"{100 * result['server_cpu_s'] / result['duration']:.0f}% of one core over the level "
        f"(concurrency {args.concurrency}, {args.max_tokens} tokens each, "
        f"a step every {args.step_ms} ms)"
    )


if __name__ == "__main__":
    main()
