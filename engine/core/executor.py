"""What the engine core needs from the worker side: the interface of a model executor.

The core never imports the worker (nor torch): :class:`~engine.core.llm_engine.LLMEngine` is
handed an object of this shape (``engine.worker.model_runner.ModelRunner`` on one device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.core.config import CacheInfo, ModelConfig
from engine.core.layout import RankLayout
from engine.core.outputs import SampleOutput
from engine.core.request import Request
from engine.core.scheduler import ScheduledBatch


class StepHandle(Protocol):
    """A step queued on the device.

    Attributes:
        sample_requests: the requests sampling a token in this step, in row order.
    """

    sample_requests: list[Request]

    def result(self) -> SampleOutput:
        """Wait for the step's samples (rows in ``sample_requests`` order).

        Raises:
            Exception: what the device raised; :meth:`ModelExecutor.is_fatal` classifies it.
        """
        ...


class ModelExecutor(Protocol):
    """Runs steps of a model over its KV cache.

    Attributes:
        model_config: the architecture; cache_info: the KV cache's runtime facts (blocks are
            the same on every rank; ``kv_bytes_per_block`` is one rank's).
        description: one line for the start-up log (device, dtype, attention backend).
        layout: where the model lives, one entry per tensor-parallel rank.
    """

    model_config: ModelConfig
    cache_info: CacheInfo
    description: str
    layout: tuple[RankLayout, ...]

    def launch(
        self,
        batch: ScheduledBatch,
        eos_token_ids: frozenset[int],
        prev: StepHandle | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepHandle:
        """Queue one step without waiting for it. ``prev``: the step still in flight, whose
        sampled ids are the inputs of requests with an output placeholder. ``before_sampling``
        (deferred sampling): called after the forward is queued and before the sampling is, for
        a step that samples; what it writes into ``batch`` (the grammar bitmask) the sampling
        reads."""
        ...

    def prepare_thread(self) -> None:
        """Called by the engine loop on its own thread before its first step: make what the
        device libraries cache per host thread (cuDNN's attention plans) for this thread."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """Device memory figures for :class:`~engine.core.stats.StepStats` (bytes; {} on the
        CPU)."""
        ...

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether an exception left the device unusable (every later step would fail too)."""
        ...

    def shutdown(self) -> None:
        """Release what the executor started (other ranks' processes); idempotent."""
        ...
