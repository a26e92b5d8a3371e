"""Build an engine core: a :class:`ModelRunner` for the checkpoint (or, over several ranks, a
:class:`TensorParallelExecutor`), handed to an :class:`LLMEngine`."""

from __future__ import annotations

import dataclasses

from engine.core.config import EngineConfig, ModelConfig, eos_ids_from
from engine.core.llm_engine import LLMEngine
from engine.loader.gguf_loader import resolve_model_path
from engine.worker.model_runner import ModelRunner


def build_engine(config: EngineConfig, eos_token_ids: frozenset[int] | None = None) -> LLMEngine:
    """The engine for ``config.model`` on ``config.device``.

    With ``config.tensor_parallel_size`` > 1 this process becomes rank 0 and the other ranks
    start (see ``engine.worker.tp_executor``); call :meth:`LLMEngine.shutdown` to stop them.

    Args:
        config: engine settings (``config.model`` is the checkpoint directory, or a GGUF
            file: its prepared directory is used, see
            :func:`engine.loader.gguf_loader.prepare_gguf_model_dir`).
        eos_token_ids: ids ending generation; None: the checkpoint's generation config.

    Raises:
        FileNotFoundError, ValueError: an unreadable or unsupported checkpoint (a GGUF of
            another architecture or with tensor types gguf-py cannot dequantize), bad settings
            (shapes that do not split over the tensor-parallel ranks, or quantization with more
            than one rank, included).
        RuntimeError: the ranks failed to meet.
    """
    model = resolve_model_path(config.model)
    if model != config.model:
        config = dataclasses.replace(config, model=model)
    model_config = ModelConfig.from_hf(config.model)
    if config.tensor_parallel_size > 1:
        from engine.worker.tp_executor import TensorParallelExecutor

        executor = TensorParallelExecutor(model_config, config)
    else:
        executor = ModelRunner(model_config, config)
    eos = eos_token_ids if eos_token_ids is not None else eos_ids_from(config.model)
    return LLMEngine(config, executor, eos)
