"""Plain statistics objects the engine produces; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepStats:
    """State after one engine step.

    Attributes:
        num_running, num_waiting: queue lengths after the step.
        num_free_blocks, num_blocks: KV blocks free / allocated in total; kv_usage in 0..1.
        num_prompt_tokens: prompt (prefill) tokens computed this step.
        num_generation_tokens: tokens sampled this step.
        num_preemptions: requests preempted this step.
        prefix_queries, prefix_hits: prompt tokens looked up / found in the prefix cache this step.
        step_seconds: wall time of the step.
        gpu_memory_allocated, gpu_memory_reserved, gpu_memory_total: bytes on the engine's CUDA
            device (0 on the CPU).
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    step_seconds: float
    gpu_memory_allocated: int = 0
    gpu_memory_reserved: int = 0
    gpu_memory_total: int = 0


def combine_steps(earlier: StepStats, later: StepStats) -> StepStats:
    """Two consecutive steps' stats as one: the state (queue lengths, KV blocks, GPU memory) of
    ``later``, the per-step counts (tokens, preemptions, prefix-cache lookups, seconds) summed.
    Used where a reader fell behind and one message has to stand for several steps; a
    per-step histogram then sees one larger step instead of two."""
    return replace(
        later,
        num_prompt_tokens=earlier.num_prompt_tokens + later.num_prompt_tokens,
        num_generation_tokens=earlier.num_generation_tokens + later.num_generation_tokens,
        num_preemptions=earlier.num_preemptions + later.num_preemptions,
        prefix_queries=earlier.prefix_queries + later.prefix_queries,
        prefix_hits=earlier.prefix_hits + later.prefix_hits,
        step_seconds=earlier.step_seconds + later.step_seconds,
    )


@dataclass(frozen=True)
class RequestStats:
    """Timings of one finished request, in seconds (monotonic clock differences).

    ``ttft`` and ``queue_time`` are None when the request never got that far (aborted early).
    ``itls`` holds the gaps between consecutive output tokens.
    """

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    queue_time: float | None
    ttft: float | None
    e2e_latency: float
