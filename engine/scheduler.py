"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step gets a token budget (``max_num_batched_tokens``). Running requests are scheduled
first (decodes take one token each; a request still in prefill takes a chunk), then waiting
requests are admitted in arrival order while the budget, ``max_num_seqs`` and free KV blocks
allow. Prefill and decode are one mechanism: a request computes tokens
``num_computed_tokens .. num_tokens`` of its sequence, as in vLLM v1 and Sarathi-Serve
(Agrawal et al., OSDI 2024). When blocks run out, the newest running request is preempted:
its blocks are freed and it returns to the front of the waiting queue to be recomputed.

With async scheduling a running request may have an output placeholder: a token sampled by the
step still in flight. It counts as a token to compute (its id reaches the step on the device);
a request whose token in flight is its last by length is not scheduled again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledBatch:
    """Requests of one step and how many new tokens each computes (same order)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


def _last_token_in_flight(req: Request) -> bool:
    """Whether the token in flight is the request's last by length (max_tokens or max_len)."""
    return (req.sample_index >= req.sampling_params.max_tokens
            or req.num_tokens_with_placeholders >= req.max_len)


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`.

    Args:
        block_manager: the KV block allocator.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step.
        enable_chunked_prefill: when False a prompt is only scheduled whole.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> ScheduledBatch:
        """Pick the requests of the next step and allocate their KV blocks."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests, oldest first; preempt the newest when blocks run out.
        queue = list(self.running)
        kept: list[Request] = []
        while queue and budget > 0:
            req = queue.pop(0)
            left = req.num_tokens_with_placeholders - req.num_computed_tokens
            if left <= 0 or (req.num_output_placeholders and _last_token_in_flight(req)):
                kept.append(req)  # its last token is in flight: it finishes when that arrives
                continue
            n = min(left, budget)
            # without chunked prefill a prefill is taken whole; only the recompute of a
            # preempted request (prompt + outputs) may exceed the budget and go in chunks
            if not self.enable_chunked_prefill and n < left <= self.max_num_batched_tokens:
                kept.append(req)  # cannot take a partial prefill; wait for a later step
                continue
            while bm.allocate_slots(req, n) is None:
                victim = queue.pop() if queue else None
                if victim is None:
                    # nothing newer left to evict: preempt this request itself
                    self._preempt(req)
                    batch.num_preemptions += 1
                    req = None
                    break
                self._preempt(victim)
                batch.num_preemptions += 1
            if req is None:
                break
            kept.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        kept.extend(queue)  # not scheduled this step (budget exhausted) but still running
        self.running = kept

        # 2. admit waiting requests in order, unless someone was preempted this step.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.num_preemptions:
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: admitted once the token is back
            cached = bm.find_cached_prefix(req, count=False)
            remaining = req.num_tokens - req.num_computed_tokens - len(cached) * bm.block_size
            n = min(remaining, budget)
            if not self.enable_chunked_prefill and n < remaining <= self.max_num_batched_tokens:
                break
            if bm.allocate_slots(req, n, cached) is None:
                break  # retried next step; the lookup is counted once, on admission
            bm.count_prefix_lookup(req, len(cached))
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks and drop it from the queues. Idempotent."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request)
