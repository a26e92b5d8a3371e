"""Start an engine core for a server: in a thread of this process or in a process of its own."""

from __future__ import annotations

from engine.core.config import EngineConfig
from engine.frontend.core_client import EngineCoreClient, ThreadCore
from engine.frontend.process_core import ProcessCore

#: values of ``--engine-mode`` besides "auto"
ENGINE_MODES = ("thread", "process")


def default_engine_mode(config: EngineConfig) -> str:
    """ "process" on CUDA (the engine loop never waits for the HTTP server's GIL), else "thread"."""
    return "process" if config.device_type == "cuda" else "thread"


def start_engine_core(
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    mode: str | None = None,
    log_interval: float = 10.0,
) -> EngineCoreClient:
    """Build the engine and return its (not yet started) core client.

    Args:
        config: engine settings; eos_token_ids: ids ending generation (the tokenizer's).
        mode: "thread", "process" or None (:func:`default_engine_mode`).

    Raises:
        ValueError: unknown mode, or what building the engine raises.
        RuntimeError: the engine process failed to start.
    """
    mode = mode or default_engine_mode(config)
    if mode == "process":
        return ProcessCore(config, eos_token_ids, log_interval)
    if mode == "thread":
        from engine.worker.build import build_engine

        return ThreadCore(build_engine(config, eos_token_ids=eos_token_ids), log_interval)
    raise ValueError(f"unknown engine mode {mode!r}; expected one of {ENGINE_MODES}")
