"""Command line: ``python -m server [--model DIR] ...``; every flag also reads QWEN_SERVE_<FLAG>."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

import uvicorn

log = logging.getLogger("server")

ENV_PREFIX = "QWEN_SERVE_"


def _env(name: str, default=None):
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT ending in a graceful shutdown exits 0.

    uvicorn re-raises the captured signal after shutting down, which ends the process with
    -SIGTERM; by then in-flight requests have finished (or were aborted after
    --graceful-timeout), so it is a normal exit.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()


class _EnvCheckedParser(argparse.ArgumentParser):
    """argparse does not check ``choices`` against defaults; defaults here come from the
    environment, so a bad QWEN_SERVE_* value would pass unchecked. This parser checks them."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if action.choices is not None and value is not None and value not in action.choices:
                env = ENV_PREFIX + action.dest.upper()
                self.error(f"argument {'/'.join(action.option_strings)} (or {env}): invalid choice {value!r} "
                           f"(choose from {', '.join(map(str, action.choices))})")
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    """The server's flags; defaults come from QWEN_SERVE_* environment variables when set."""
    p = _EnvCheckedParser(
        prog="python -m server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible server for Qwen3/Qwen2 checkpoints (paged KV cache, continuous batching). "
        "Every flag can also be set through the environment variable QWEN_SERVE_<FLAG> "
        "(e.g. QWEN_SERVE_PORT=9000).",
    )
    a = p.add_argument
    a("--model", default=_env("model"), help="Hugging Face checkpoint directory (default: the embedded random-weight Qwen3)")
    a("--host", default=_env("host", "127.0.0.1"), help="address to listen on")
    a("--port", type=int, default=int(_env("port", 8000)), help="port to listen on")
    a("--dtype", default=_env("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"],
      help="weights and activations (auto: float32 on CPU, the checkpoint's dtype on CUDA)")
    a("--device", default=_env("device", "auto"), help="auto, cpu, cuda or cuda:N")
    a("--max-model-len", type=int, default=_env("max_model_len"), help="longest prompt + completion in tokens")
    a("--block-size", type=int, default=int(_env("block_size", 16)), help="tokens per KV-cache block")
    a("--num-kv-blocks", type=int, default=_env("num_kv_blocks"), help="KV-cache blocks to allocate")
    a("--kv-cache-memory-gb", type=float, default=_env("kv_cache_memory_gb"),
      help="KV-cache budget in GiB (when --num-kv-blocks is not given; default: 1 GiB on CPU, "
      "--gpu-memory-utilization of the GPU)")
    a("--gpu-memory-utilization", type=float, default=float(_env("gpu_memory_utilization", 0.85)),
      help="fraction of GPU memory the engine may fill (weights + KV cache) when the KV budget is not given")
    a("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 256)), help="most requests running at once")
    a("--max-num-batched-tokens", type=int, default=int(_env("max_num_batched_tokens", 8192)),
      help="token budget of one engine step (prefill chunks + decodes)")
    a("--served-model-name", default=_env("served_model_name"), help="model id in the API (default: the directory name)")
    a("--attention-backend", default=_env("attention_backend"), choices=["triton", "torch"],
      help="default: triton on CUDA, torch on CPU")
    a("--no-prefix-caching", action="store_true", default=bool(_env("no_prefix_caching")), help="disable automatic prefix caching")
    a("--no-cuda-graph", action="store_true", default=bool(_env("no_cuda_graph")), help="disable CUDA graphs for decode")
    a("--async-scheduling", choices=["auto", "on", "off"], default=_env("async_scheduling") or "auto",
      help="schedule and launch the next step while the current one runs on the device; auto = on with CUDA")
    a("--engine-mode", default=_env("engine_mode", "auto"), choices=["auto", "thread", "process"],
      help="run the engine loop in a thread of the server or in its own process (auto: process on CUDA)")
    a("--compile-mode", default=_env("compile_mode", "auto"), choices=["auto", "model", "ops", "none"],
      help="torch.compile: model = the whole forward as one graph (attention a custom op), ops = only the "
      "elementwise functions, none = eager (auto: ops on CUDA, none on CPU)")
    a("--no-compile", action="store_true", default=bool(_env("no_compile")),
      help="same as --compile-mode none")
    a("--reasoning-parser", default=_env("reasoning_parser"), choices=["qwen3"],
      help="split <think>...</think> into reasoning_content")
    a("--api-key", default=_env("api_key"), help="require 'Authorization: Bearer KEY' on /v1 routes")
    a("--protect-metrics", action="store_true", default=bool(_env("protect_metrics")), help="require the API key on /metrics too")
    a("--max-body-bytes", type=int, default=int(_env("max_body_bytes", 4 << 20)), help="larger request bodies get 413")
    a("--max-prompt-tokens", type=int, default=_env("max_prompt_tokens"), help="longer prompts get 400")
    a("--seed", type=int, default=int(_env("seed", 0)), help="seed of the random weights in benchmark mode")
    a("--log-level", default=_env("log_level", "info"), choices=["debug", "info", "warning", "error"])
    a("--graceful-timeout", type=float, default=float(_env("graceful_timeout", 30)),
      help="seconds in-flight requests get to finish after SIGTERM")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.factory import build_context
    from server.app import create_app

    ctx = build_context(args)
    app = create_app(ctx)
    log.info("serving %s on http://%s:%d", ctx.model_name, args.host, args.port)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                            timeout_graceful_shutdown=int(args.graceful_timeout)))
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
