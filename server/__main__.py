"""Command line: ``python -m server [--model DIR] ...``; every flag also reads QWEN_SERVE_<FLAG>."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import re
import sys

from engine.core.config import DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES
from kernels.interpreter import interpreting
from kernels.switches import COUNT_NAMES, SWITCH_NAMES, env_count, env_switch
from server.http_protocol import HTTP_PARSERS, protocol_base
from server.http_server import listen_socket, make_server

log = logging.getLogger("server")

ENV_PREFIX = "QWEN_SERVE_"


def _env(name: str, default=None):
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}

#: (flag dest, lowest allowed, highest allowed or None) checked after parsing
_RANGES = [
    ("port", 0, 65535),
    ("max_model_len", 1, None),
    ("block_size", 1, None),
    ("num_kv_blocks", 1, None),
    ("max_num_seqs", 1, None),
    ("max_num_batched_tokens", 1, None),
    ("prefill_only_token_budget", 1, None),
    ("lone_prompt_min_tokens", 0, None),
    ("max_prefill_tokens_with_decodes", 0, None),
    ("max_prefill_attention_with_decodes", 0, None),
    ("max_body_bytes", 1, None),
    ("api_server_count", 1, None),
    ("tensor_parallel_size", 1, None),
    ("max_prompt_tokens", 1, None),
    ("graceful_timeout", 0, None),
    ("grammar_compile_timeout", 0.01, None),
    ("timeout_keep_alive", 1, None),
    ("timeout_request_header", 0.1, None),
    ("timeout_request_body", 0.1, None),
    ("limit_concurrency", 1, None),
    ("h11_max_incomplete_event_size", 1024, None),
    ("gpu_memory_utilization", 0.01, 1.0),
    ("kv_cache_memory_gb", 0.001, None),
    ("prefill_graph_max_tokens", 0, None),
    ("engine_idle_poll_ms", 0, None),
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default to show (not for unset flags)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) and not action.default:
            return action.help
        return super()._get_help_string(action)


class _EnvCheckedParser(argparse.ArgumentParser):
    """Checks values that come from QWEN_SERVE_* variables as strictly as command-line ones.

    argparse does not check ``choices`` against defaults, and the defaults here come from the
    environment; switches (``--no-...``) read 1/true/yes/on or 0/false/no/off from it; numbers
    are checked against their ranges. Errors name the flag and its variable.
    """

    def error(self, message):
        m = re.match(r"argument (--[a-z0-9-]+)", message)
        if m and "QWEN_SERVE_" not in message:
            env = ENV_PREFIX + m.group(1)[2:].upper().replace("-", "_")
            message = message.replace(m.group(1), f"{m.group(1)} (or {env})", 1)
        # one line, without argparse's usage block (the message names the flag; --help has more)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            flag = "/".join(action.option_strings)
            if isinstance(action, argparse._StoreTrueAction) and isinstance(value, str):
                if value.strip().lower() not in _TRUE | _FALSE:
                    self.error(
                        f"argument {flag}: invalid switch value {value!r} "
                        "(use 1/true/yes/on or 0/false/no/off)"
                    )
                setattr(ns, action.dest, value.strip().lower() in _TRUE)
            elif action.choices is not None and value is not None and value not in action.choices:
                self.error(
                    f"argument {flag}: invalid choice {value!r} "
                    f"(choose from {', '.join(map(str, action.choices))})"
                )
        for dest, low, high in _RANGES:
            value = getattr(ns, dest, None)
            if value is not None and (
                not math.isfinite(value) or value < low or (high is not None and value > high)
            ):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                bound += ", and finite" if not math.isfinite(value) else ""
                self.error(
                    f"argument --{dest.replace('_', '-')}: {value} is out of range "
                    f"(must be {bound})"
                )
        if (getattr(ns, "api_server_count", 1) or 1) > 1 and getattr(ns, "engine_mode", None) == (
            "thread"
        ):
            self.error(
                "argument --api-server-count: more than 1 API server needs the engine core in "
                "its own process (--engine-mode process or auto, not thread)"
            )
        http = getattr(ns, "http", None)
        if http is not None:
            try:
                protocol_base(http)
            except ValueError as e:
                self.error(f"argument --http: {e}")
        if getattr(ns, "allow_credentials", False) and "*" in (ns.allowed_origins or ()):
            # Starlette would echo every Origin back with credentials allowed: any site could
            # then call the API with the user's cookies or proxy login
            self.error(
                'argument --allow-credentials: not with "*" among --allowed-origins; list the '
                "origins allowed to send credentials"
            )
        key = getattr(ns, "api_key", None)
        if key is not None and (not key.strip() or key != key.strip()):
            self.error(  # (clients' headers lose surrounding whitespace: it could never match)
                "argument --api-key: empty, or with leading or trailing whitespace (a newline "
                "from a secret file?); give the key itself, or leave it unset for no key check"
            )
        device = getattr(ns, "device", None)
        if device is not None and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            self.error(f"argument --device: invalid device {device!r} (auto, cpu, cuda or cuda:N)")
        backend = getattr(ns, "attention_backend", None)
        if device is not None and (device.startswith("cuda") or backend == "triton"):
            # asked for CUDA or the Triton kernels: refuse here what the engine would only
            # report after start-up (torch imported only for these flags)
            cuda = _cuda_available()
            if device.startswith("cuda") and not cuda:
                self.error(
                    f"argument --device: {device} asked for, but torch sees no CUDA device "
                    "(a CPU build of torch, or no GPU visible); use --device cpu or auto"
                )
            on_cpu = device == "cpu" or (device == "auto" and not cuda)
            if backend == "triton" and on_cpu and not interpreting():
                self.error(
                    "argument --attention-backend: triton needs a CUDA device (or "
                    "TRITON_INTERPRET=1, the kernels' slow CPU interpreter, for tests); the CPU "
                    "serves with the torch backend (leave the flag unset)"
                )
        model = getattr(ns, "model", None)
        if model is not None and not os.path.isdir(model):
            if os.path.isfile(model):
                with open(model, "rb") as f:
                    if f.read(4) != b"GGUF":
                        self.error(
                            f"argument --model: {model!r} is a file but not a GGUF file; give "
                            "a checkpoint directory or a .gguf file"
                        )
            else:
                self.error(
                    f"argument --model: {model!r} is not a local directory or GGUF file; "
                    "give a checkpoint directory or a .gguf file "
                    "(hub names are not downloaded), or leave it unset for the embedded model"
                )
        return ns, extra


def _string_list(value: str) -> list[str]:
    """A flag's JSON list of strings (``'["https://a.example", "*"]'``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not a list of strings.
    """
    try:
        parsed = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a JSON list of strings (e.g. '[\"*\"]')"
        ) from None
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings")
    return parsed


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch: asked only for CUDA / Triton flags)."""
    import torch

    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    """The server's flags; defaults come from QWEN_SERVE_* environment variables when set."""
    p = _EnvCheckedParser(
        prog="python -m server",
        formatter_class=_HelpFormatter,
        description="OpenAI-compatible server for Qwen3/Qwen2/Qwen3-MoE checkpoints "
        "(paged KV cache, continuous batching). "
        "Every flag can also be set through the environment variable QWEN_SERVE_<FLAG> "
        "(e.g. QWEN_SERVE_PORT=9000); a switch takes 1/true/yes/on or 0/false/no/off "
        "(QWEN_SERVE_NO_COMPILE=1).",
    )
    a = p.add_argument
    a(
        "--model",
        default=_env("model"),
        help="local Hugging Face checkpoint directory "
        "(config.json, tokenizer.json, *.safetensors; hub names are not downloaded) "
        "or a Qwen2/Qwen3 GGUF file (dequantized at load); "
        "unset: the embedded random-weight Qwen3",
    )
    a("--host", default=_env("host", "127.0.0.1"), help="address to listen on")
    a("--port", type=int, default=_env("port", 8000), help="port to listen on")
    a(
        "--dtype",
        default=_env("dtype", "auto"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: float32 on CPU, the checkpoint's dtype on CUDA)",
    )
    a("--device", default=_env("device", "auto"), help="auto, cpu, cuda or cuda:N")
    a(
        "--max-model-len",
        type=int,
        default=_env("max_model_len"),
        help="longest prompt + completion in tokens; unset: the model's limit, "
        "capped by the KV cache",
    )
    a(
        "--block-size",
        type=int,
        default=_env("block_size"),
        help="tokens per KV-cache block (the prefix cache shares whole blocks); unset: 128 on "
        "CUDA (whole tiles of the prefill kernel's TMA loads), 16 on the CPU",
    )
    a(
        "--num-kv-blocks",
        type=int,
        default=_env("num_kv_blocks"),
        help="KV-cache blocks of --block-size tokens to allocate (128-token blocks by default on "
        "CUDA: a count sized for 16-token blocks takes 8x the memory there); unset: from the "
        "KV-cache budget in GiB or from free GPU memory",
    )
    a(
        "--kv-cache-memory-gb",
        type=float,
        default=_env("kv_cache_memory_gb"),
        help="KV-cache budget in GiB when the number of blocks is not given; unset: 1 GiB on CPU, "
        "and on a GPU what the memory-utilization fraction leaves after the weights",
    )
    a(
        "--gpu-memory-utilization",
        type=float,
        default=_env("gpu_memory_utilization", 0.85),
        help="fraction of GPU memory the engine may fill (weights + KV cache) "
        "when the KV budget is not given",
    )
    a(
        "--max-num-seqs",
        type=int,
        default=_env("max_num_seqs", 256),
        help="most requests running at once",
    )
    a(
        "--max-num-batched-tokens",
        type=int,
        default=_env("max_num_batched_tokens", 1024),
        help="token budget of one engine step (prefill chunks + decodes)",
    )
    a(
        "--prefill-only-token-budget",
        type=int,
        default=_env("prefill_only_token_budget"),
        help="token budget of a step in which nothing decodes (larger chunks for a lone long "
        "prompt); unset: the token budget of every step",
    )
    a(
        "--lone-prompt-min-tokens",
        type=int,
        default=_env("lone_prompt_min_tokens"),
        help="a prompt this long or longer on an idle engine is prefilled whole in one step (up "
        "to the length whose activations fit outside the KV cache; the start-up log prints "
        "it), from 16k tokens with cuDNN's attention; 0: off; unset: 16384 on CUDA, off "
        "elsewhere (on the CPU one large step is slower than chunks)",
    )
    a(
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=_env("max_prefill_tokens_with_decodes"),
        help="most prompt tokens one step carries while requests decode (bounds the inter-token "
        "time long prefills add to running streams; Sarathi-Serve's stall-free cap, e.g. 512 for "
        "steadier streams at high concurrency, for less throughput); unset or 0: what the "
        "token budget leaves",
    )
    a(
        "--max-prefill-attention-with-decodes",
        type=int,
        default=_env(
            "max_prefill_attention_with_decodes", DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES
        ),
        help="most query-key pairs of prompt attention one step carries while requests decode "
        "(a chunk over a long cached prefix gets fewer rows; the first chunk of a step gets at "
        "least one); 0: no bound",
    )
    a(
        "--served-model-name",
        default=_env("served_model_name"),
        help="model id in the API; unset: the checkpoint directory's name "
        "(qwen3-embedded for the embedded model)",
    )
    a(
        "--attention-backend",
        default=_env("attention_backend"),
        choices=["triton", "torch"],
        help="default: triton on CUDA, torch on CPU",
    )
    a(
        "--no-prefix-caching",
        action="store_true",
        default=_env("no_prefix_caching", False),
        help="disable automatic prefix caching",
    )
    a(
        "--no-cuda-graph",
        action="store_true",
        default=_env("no_cuda_graph", False),
        help="run every step eagerly (no CUDA graphs for decode, prefill or mixed steps)",
    )
    a(
        "--prefill-graph-max-tokens",
        type=int,
        default=_env("prefill_graph_max_tokens"),
        help="largest prefill/mixed step replayed as a CUDA graph; "
        "unset: the step token budget; 0: only decode steps",
    )
    a(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default=_env("async_scheduling") or "auto",
        help="schedule and launch the next step while the current one runs on the device; "
        "auto = on with CUDA",
    )
    a(
        "--engine-mode",
        default=_env("engine_mode", "auto"),
        choices=["auto", "thread", "process"],
        help="run the engine loop in a thread of the server or in its own process "
        "(auto: process on CUDA, and with --api-server-count above 1, which needs it)",
    )
    a(
        "--engine-idle-poll-ms",
        type=float,
        default=_env("engine_idle_poll_ms", 0.0),
        help="milliseconds the engine process keeps polling for requests after its last work "
        "before it sleeps: a request arriving meanwhile starts on a warm core (costs one busy "
        "core; 0 = sleep at once; refused with the in-thread engine)",
    )
    a(
        "--api-server-count",
        type=int,
        default=_env("api_server_count", 1),
        help="HTTP server processes in front of the one engine core (vLLM's option): they share "
        "the port (SO_REUSEPORT), /metrics and --limit-concurrency; more than 1 spreads the "
        "per-token HTTP work of many streams over several cores (needs --engine-mode process "
        "or auto)",
    )
    a(
        "--compile-mode",
        default=_env("compile_mode", "auto"),
        choices=["auto", "model", "ops", "none"],
        help="torch.compile: model = the whole forward as one graph (attention a custom op), "
        "ops = only the elementwise functions, none = eager (auto: ops on CUDA, none on CPU)",
    )
    a(
        "--no-compile",
        action="store_true",
        default=_env("no_compile", False),
        help="same as --compile-mode none",
    )
    a(
        "--reasoning-parser",
        default=_env("reasoning_parser"),
        choices=["qwen3"],
        help="split <think>...</think> into reasoning_content "
        "(a structured-output grammar then constrains only the answer after </think>)",
    )
    a(
        "--grammar-compile-timeout",
        type=float,
        default=_env("grammar_compile_timeout", 10.0),
        help="seconds a structured-output grammar (JSON schema, regex, choice, grammar, enforced "
        "tool calls) may take to compile before the request gets HTTP 400",
    )
    a(
        "--api-key",
        default=_env("api_key"),
        help="require 'Authorization: Bearer KEY' on /v1 routes",
    )
    a(
        "--protect-metrics",
        action="store_true",
        default=_env("protect_metrics", False),
        help="require the API key on /metrics too",
    )
    a(
        "--allowed-origins",
        type=_string_list,
        default=_env("allowed_origins", "[]"),
        help="CORS: origins whose browser pages may call the API, a JSON list (as vLLM's "
        'flag, whose default is ["*"]); ["*"]: any origin (with no --api-key, any web page '
        "the user opens may then use the server); []: no CORS headers, browsers refuse "
        "cross-origin calls",
    )
    a(
        "--allowed-methods",
        type=_string_list,
        default=_env("allowed_methods", '["*"]'),
        help="CORS: the methods allowed from those origins, a JSON list",
    )
    a(
        "--allowed-headers",
        type=_string_list,
        default=_env("allowed_headers", '["*"]'),
        help="CORS: the request headers allowed from those origins, a JSON list",
    )
    a(
        "--allow-credentials",
        action="store_true",
        default=_env("allow_credentials", False),
        help="CORS: let browsers send cookies and HTTP authentication from those origins "
        '(not with "*" among --allowed-origins)',
    )
    a(
        "--max-body-bytes",
        type=int,
        default=_env("max_body_bytes", 4 << 20),
        help="larger request bodies get 413",
    )
    a(
        "--max-prompt-tokens",
        type=int,
        default=_env("max_prompt_tokens"),
        help="longer prompts get 400; unset: only the context length limits them",
    )
    a(
        "--load-format",
        default=_env("load_format", "auto"),
        choices=["auto", "dummy"],
        help="auto: the checkpoint's weights (safetensors, or the GGUF file given as --model); "
        "dummy: random weights drawn on the "
        "device from --seed, built from config.json alone (for benchmarking model shapes "
        "without their weights; the outputs are meaningless)",
    )
    a(
        "--quantization",
        default=_env("quantization", "auto"),
        choices=["auto", "fp8"],
        help="auto: serve the checkpoint as stored (a block-FP8 checkpoint in FP8); fp8: also "
        "quantize a bf16/fp16/fp32 checkpoint (or a GGUF) at load into 128x128-block FP8 "
        "linear layers (with --load-format dummy: FP8 random weights)",
    )
    a(
        "--seed",
        type=int,
        default=_env("seed", 0),
        help="seed of --load-format dummy's random weights (sampling seeds are per request)",
    )
    a(
        "--tensor-parallel-size",
        type=int,
        default=_env("tensor_parallel_size", 1),
        help="ranks (one process and device each) the model is split over, Megatron-style; "
        "ranks 1..N-1 start on this host (cuda:0..N-1) unless --distributed-init-method is "
        "env:// (torchrun started them, on one or several hosts; docs/deploy.md)",
    )
    a(
        "--distributed-init-method",
        default=_env("distributed_init_method"),
        help="where the tensor-parallel ranks meet: tcp://HOST:PORT, or env:// under torchrun; "
        "unset: a free loopback port",
    )
    a(
        "--log-level",
        type=str.lower,
        default=_env("log_level", "info"),
        choices=["debug", "info", "warning", "error"],
        help="server log level",
    )
    a(
        "--graceful-timeout",
        type=float,
        default=_env("graceful_timeout", 30),
        help="seconds in-flight requests get to finish after SIGTERM or SIGINT (Ctrl-C); then "
        "the server ends them: streams with an error event (503 server_shutting_down) and "
        "[DONE], other requests with that 503. 0 ends them at once; a second signal ends them "
        "at once too, a third forces the quit",
    )
    # slow clients (server/http_protocol.py): a request must arrive within these bounds
    a(
        "--timeout-request-header",
        type=float,
        default=_env("timeout_request_header", 10),
        help="seconds a client has to send a request's line and headers, from the connection "
        "(or, kept alive, from the request's first byte); then 408 and the connection is closed",
    )
    a(
        "--timeout-request-body",
        type=float,
        default=_env("timeout_request_body", 60),
        help="seconds a client has to send a request's body once its headers are in; then 408 "
        "and the connection is closed",
    )
    a(
        "--timeout-keep-alive",
        type=int,
        default=_env("timeout_keep_alive", 5),
        help="seconds an idle kept-alive connection waits for its next request (uvicorn's)",
    )
    a(
        "--limit-concurrency",
        type=int,
        default=_env("limit_concurrency", 1024),
        help="most connections served at once (over all API servers); a connection opened "
        "beyond gets a 503 (OpenAI error body) and is closed",
    )
    a(
        "--http",
        choices=list(HTTP_PARSERS),
        default=_env("http", "auto"),
        help="HTTP/1.1 parser (uvicorn's --http): auto is httptools (C) where installed, else "
        "h11 (pure Python, slower per streamed token)",
    )
    a(
        "--h11-max-incomplete-event-size",
        type=int,
        default=_env("h11_max_incomplete_event_size", 16384),
        help="largest request line + headers still incomplete after a read, in bytes (h11's "
        "bound, applied to httptools too: headers that arrive whole in one read are not "
        "limited by it); past it, 400",
    )
    return p


#: QWEN_SERVE_* variables read outside the flags: the kernel switches and counts
#: (kernels.switches.SWITCH_NAMES, COUNT_NAMES), the cache folder, the test, bench and
#: load-test hooks
_OTHER_ENV = frozenset(SWITCH_NAMES + COUNT_NAMES) | frozenset(
    ENV_PREFIX + name
    for name in (
        "CACHE",
        "REAL_CHECKPOINT",
        "REAL_GGUF",
        "TRACE_FILE",
        "MODEL_NAME",  # the locustfile's (tests/load), beside the server in docker/compose.yaml
    )
)


def unknown_env(parser: argparse.ArgumentParser, environ=os.environ) -> list[str]:
    """The ``QWEN_SERVE_*`` variables set in ``environ`` that no flag and no switch reads (a
    misspelt ``QWEN_SERVE_BLOK_SIZE`` would otherwise be ignored in silence), sorted."""
    known = {ENV_PREFIX + a.dest.upper() for a in parser._actions} | _OTHER_ENV
    return sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)


def bad_switches(environ=os.environ) -> list[str]:
    """Why each kernel switch or count set in ``environ`` has an unreadable value (the kernels
    read them only on the devices they run on: a bad value would otherwise pass unseen
    elsewhere)."""
    errors = []
    checks = [(name, env_switch, True) for name in SWITCH_NAMES]
    checks += [(name, env_count, 1) for name in COUNT_NAMES]
    for name, read, default in checks:
        if name in environ:
            try:
                read(name, default, environ=environ)
            except ValueError as exc:
                errors.append(str(exc))
    return errors


def check_memory(config) -> None:
    """Refuse a KV-cache budget (``--kv-cache-memory-gb``) over this machine's physical memory
    when the engine runs on the CPU, where the cache is host memory (a CUDA budget is checked
    against the GPU when the engine allocates it).

    Raises:
        ValueError: naming the flag, the budget and the memory.
    """
    gib = config.kv_cache_memory_gb
    if config.device_type != "cpu" or gib is None or config.num_kv_blocks is not None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if gib > total:
        raise ValueError(
            f"argument --kv-cache-memory-gb: {gib:g} GiB is more than this machine's memory "
            f"({total:.1f} GiB); the CPU engine keeps its KV cache in host memory"
        )


def read_model_config(model_dir: str):
    """``ModelConfig.from_hf(model_dir)``, its failures on a directory that is no Hugging Face
    checkpoint as one ``ValueError`` naming ``--model``: no ``config.json``, one that is not
    JSON (or not UTF-8, or not an object), one without a key the architecture needs.

    Raises:
        ValueError: as above, or ``from_hf``'s own (an unsupported ``model_type``, ...).
    """
    from engine.core.config import ModelConfig

    config_json = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_json):
        raise ValueError(
            f"argument --model: {model_dir!r} has no config.json file (not a Hugging Face "
            "checkpoint directory)"
        )
    try:
        return ModelConfig.from_hf(model_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"argument --model: {config_json} is not UTF-8 JSON ({exc})") from None
    except (KeyError, TypeError, AttributeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else "not a JSON object of settings"
        raise ValueError(
            f"argument --model: {config_json} is not a usable model config ({what})"
        ) from None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in bad_switches():
        parser.error(problem)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    unknown = unknown_env(parser)
    if unknown:
        log.warning(
            "ignored: %s (no flag reads them; `python -m server --help` lists the flags, each "
            "also read from QWEN_SERVE_<FLAG>)",
            ", ".join(unknown),
        )
    from engine.core.config import check_max_model_len, resolve_quantization
    from engine.frontend.launch import resolve_engine_mode
    from server.app import create_app
    from server.factory import build_context, engine_config, run_worker_rank_if_any

    try:  # what the flags or the checkpoint refuse, before any process starts: one line
        config = engine_config(args)
        check_memory(config)
        model = read_model_config(config.model)
        check_max_model_len(config, model)
        quantization = resolve_quantization(model, config.quantization)
        model.check_quantization(quantization)
        if config.tensor_parallel_size > 1:
            model.check_tensor_parallel(config.tensor_parallel_size, quantization)
        resolve_engine_mode(config, args.engine_mode)  # what the in-thread engine cannot do
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    code = run_worker_rank_if_any(config)
    if code is not None:  # a torchrun rank other than 0: no HTTP server here
        return code
    if args.api_server_count > 1:
        from server.api_servers import run_api_servers

        return run_api_servers(args, config)
    sock = listen_socket(args.host, args.port)  # before the model loads: a taken port fails now
    ctx = build_context(args, config)
    app = create_app(ctx)
    log.info("serving %s on http://%s:%d", ctx.model_name, args.host, sock.getsockname()[1])
    # What start-up built lives as long as the server: keep it out of the garbage collector's full
    # passes, whose pauses would otherwise stall every stream (vLLM freezes after start-up too).
    gc.collect()
    gc.freeze()
    timeout = float(args.graceful_timeout)
    server = make_server(
        app, args, on_graceful_timeout=lambda early: ctx.end_in_flight(timeout, early=early)
    )
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
