"""Build the engine, tokenizer and metrics from command-line arguments."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.core.config import EngineConfig, ModelConfig, read_generation_config
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.core_client import EngineCoreClient
from engine.frontend.launch import is_worker_rank, run_worker_rank, start_engine_core
from engine.frontend.tokenizer import Tokenizer
from engine.loader.gguf_loader import is_gguf, resolve_model_path
from server.context import CorsPolicy, ServerContext
from server.metrics import ServerMetrics
from server.params import generation_defaults
from server.prompt_encoder import PromptEncoder
from server.structured_outputs import GrammarValidator

log = logging.getLogger(__name__)


def resolve_device(name: str) -> str:
    """ "auto" -> "cuda" when available else "cpu"."""
    if name == "auto":
        import torch  # here: an API-server process never needs torch (hundreds of MB)

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _model_dir(args: argparse.Namespace) -> str:
    """``--model`` (a GGUF file: its prepared directory), or the embedded checkpoint's directory
    (built on first use)."""
    if args.model is not None:
        if is_gguf(args.model):
            log.info("GGUF file %s: weights dequantized at load (gguf-py)", args.model)
            return resolve_model_path(args.model)
        return args.model
    from engine.loader.embedded import default_cache_root, ensure_embedded_checkpoint

    log.info(
        "no --model: using the embedded random-weight Qwen3 (built on first use under %s, "
        "set QWEN_SERVE_CACHE to move it)",
        default_cache_root(),
    )
    return str(ensure_embedded_checkpoint())


def run_worker_rank_if_any(config: EngineConfig) -> int | None:
    """On a tensor-parallel rank other than 0 started by torchrun (``env://``, ``RANK`` > 0):
    serve as that rank until rank 0 shuts the engine down and return the exit code. None in
    every other process (it goes on to serve HTTP)."""
    if not is_worker_rank(config):
        return None
    return run_worker_rank(config)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of the parsed flags.

    ``--model`` is a checkpoint directory or a GGUF file (served from the directory
    :func:`engine.loader.gguf_loader.prepare_gguf_model_dir` derives from it, under the model
    name of the file, e.g. ``model-q4_k_m.gguf``).

    Raises:
        FileNotFoundError / ValueError: bad settings, an unreadable or unsupported GGUF file.
    """
    return EngineConfig(
        model=_model_dir(args),
        dtype=args.dtype,
        device=resolve_device(args.device),
        max_model_len=args.max_model_len and int(args.max_model_len),
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks and int(args.num_kv_blocks),
        kv_cache_memory_gb=args.kv_cache_memory_gb and float(args.kv_cache_memory_gb),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_only_token_budget=args.prefill_only_token_budget,
        lone_prompt_min_tokens=args.lone_prompt_min_tokens,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes or None,
        max_prefill_attention_with_decodes=args.max_prefill_attention_with_decodes or None,
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        cuda_graph=not args.no_cuda_graph,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        compile_mode="none"
        if args.no_compile
        else (None if args.compile_mode == "auto" else args.compile_mode),
        load_format=args.load_format,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method or None,
        quantization=getattr(args, "quantization", None),
        engine_idle_poll_ms=getattr(args, "engine_idle_poll_ms", 0.0),
    )


def build_context(
    args: argparse.Namespace,
    config: EngineConfig | None = None,
    core: EngineCoreClient | None = None,
    metrics_dir: str | None = None,
) -> ServerContext:
    """Load the checkpoint (or build the embedded one) and wire engine, tokenizer and metrics.

    ``config``: :func:`engine_config` of ``args`` when the caller has it already (None: made
    here), so the model is resolved, and its start-up line logged, once. ``core``: the client of
    an engine core started elsewhere (an API server of several, ``server.api_servers``); None:
    the engine core is started here. ``metrics_dir``: the directory the API servers share
    their metrics through (``ServerMetrics``'s ``multiprocess_dir``); None: this process's
    metrics alone.

    Raises:
        FileNotFoundError / ValueError: unreadable or unsupported checkpoint, bad settings.
    """
    config = config if config is not None else engine_config(args)
    model_dir = config.model
    name = args.served_model_name or (
        Path(args.model).resolve().name if args.model is not None else "qwen3-embedded"
    )
    model_config = ModelConfig.from_hf(model_dir)
    tokenizer = Tokenizer(model_dir)
    with ThreadPoolExecutor(1, thread_name_prefix="prompt-encoder") as pool:
        # the prompt encoder's load (~2 s for Qwen's 151k-token vocabulary; fastokens releases
        # the GIL) overlaps the engine core's start-up
        encoder = pool.submit(PromptEncoder, tokenizer)
        if core is None:
            core = start_engine_core(config, tokenizer.eos_token_ids, args.engine_mode)
        encoder = encoder.result()
    limits = core.limits
    metrics = ServerMetrics(
        name,
        {
            "model": model_dir,
            "architecture": model_config.architecture,
            "num_experts": model_config.num_experts,
            "load_format": config.load_format,
            "dtype": limits.dtype,
            "block_size": limits.block_size,
            "num_kv_blocks": limits.num_kv_blocks,
            "max_model_len": limits.max_model_len,
            "tensor_parallel_size": max(1, len(limits.ranks)),
        },
        limits.ranks,
        multiprocess_dir=metrics_dir,
    )
    log.info("engine core: %s", type(core).__name__)
    return ServerContext(
        engine=AsyncEngine(core, on_step=metrics.on_step),
        tokenizer=tokenizer,
        model_name=name,
        metrics=metrics,
        defaults=generation_defaults(read_generation_config(model_dir)),
        reasoning_parser=args.reasoning_parser,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens and int(args.max_prompt_tokens),
        protect_metrics=args.protect_metrics,
        encoder=encoder,
        cors=CorsPolicy(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        grammar_validator=GrammarValidator(
            Path(model_dir) / "tokenizer.json",
            limits.vocab_size,
            limits.eos_token_ids,
            timeout_s=args.grammar_compile_timeout,
        ),
    )
