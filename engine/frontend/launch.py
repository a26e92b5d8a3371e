"""Start an engine core for a server: in a thread of this process or in a process of its own;
or, on a tensor-parallel rank other than 0 started by torchrun, run that rank's worker loop."""

from __future__ import annotations

import os

from engine.core.config import EngineConfig
from engine.frontend.core_client import EngineCoreClient, ThreadCore
from engine.frontend.process_core import ProcessCore

#: values of ``--engine-mode`` besides "auto"
ENGINE_MODES = ("thread", "process")


def default_engine_mode(config: EngineConfig) -> str:
    """ "process" on CUDA (the engine loop never waits for the HTTP server's GIL) and for a
    tensor-parallel engine (losing a rank ends the engine process, see
    ``engine.worker.rank_monitor``), else "thread"."""
    if config.device_type == "cuda" or config.tensor_parallel_size > 1:
        return "process"
    return "thread"


def resolve_engine_mode(config: EngineConfig, mode: str | None = None) -> str:
    """The engine mode a server runs: ``mode``, or :func:`default_engine_mode` for None or
    "auto", after refusing what the in-thread engine cannot do (host checks only; the server
    calls it before it loads anything, :func:`start_engine_core` again).

    Raises:
        ValueError: unknown mode; "thread" with tensor parallelism (a lost rank ends the
            process holding rank 0, which must not be the server's) or with
            ``engine_idle_poll_ms`` (the polling is the engine process's).
    """
    mode = default_engine_mode(config) if mode in (None, "auto") else mode
    if mode not in ENGINE_MODES:
        raise ValueError(f"unknown engine mode {mode!r}; expected one of {ENGINE_MODES}")
    if mode == "thread" and config.tensor_parallel_size > 1:
        raise ValueError(
            "--engine-mode thread cannot run a tensor-parallel engine: rank 0 runs in the "
            "engine-core process (use --engine-mode process or auto)"
        )
    if mode == "thread" and config.engine_idle_poll_ms > 0:
        raise ValueError(
            f"argument --engine-idle-poll-ms: {config.engine_idle_poll_ms:g} needs the engine "
            "core in its own process (--engine-mode process, the default on CUDA): the polling "
            "applies to an engine process, not to the in-thread engine"
        )
    return mode


def start_engine_core(
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    mode: str | None = None,
    log_interval: float = 10.0,
) -> EngineCoreClient:
    """Build the engine and return its (not yet started) core client.

    Args:
        config: engine settings; eos_token_ids: ids ending generation (the tokenizer's).
        mode: "thread", "process", "auto" or None (:func:`resolve_engine_mode`).

    Raises:
        ValueError: what :func:`resolve_engine_mode` refuses, or what building the engine
            raises.
        RuntimeError: the engine process failed to start.
    """
    if resolve_engine_mode(config, mode) == "process":
        return ProcessCore(config, eos_token_ids, log_interval)
    from engine.worker.build import build_engine

    return ThreadCore(build_engine(config, eos_token_ids=eos_token_ids), log_interval)


def is_worker_rank(config: EngineConfig) -> bool:
    """Whether this process is a tensor-parallel rank other than 0 started by torchrun
    (``env://`` and ``RANK`` != 0): it runs :func:`run_worker_rank` instead of a server."""
    return config.distributed_init_method == "env://" and os.environ.get("RANK", "0") != "0"


def run_worker_rank(config: EngineConfig) -> int:
    """Serve as torchrun's rank ``RANK`` until rank 0 shuts the engine down; returns the exit
    code (a failure logs and exits the process with code 1).

    Raises:
        ValueError: torchrun's variables missing or inconsistent with the settings.
    """
    from engine.worker.tp_worker import torchrun_rank_main  # here: torch only when needed

    return torchrun_rank_main(config)
