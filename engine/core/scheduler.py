"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step gets a token budget (``max_num_batched_tokens``). Running requests are scheduled
first (decodes take one token each; a request still in prefill takes a chunk), then waiting
requests are admitted in arrival order while the budget, ``max_num_seqs`` and free KV blocks
allow. Prefill and decode are one mechanism: a request computes tokens
``num_computed_tokens .. num_tokens`` of its sequence, as in vLLM v1 and Sarathi-Serve
(Agrawal et al., OSDI 2024). When blocks run out, the newest running request is preempted:
its blocks are freed and it returns to the front of the waiting queue to be recomputed.

The scheduler owns every request's progress: it is changed here only, at admission and
preemption (:meth:`schedule`), after a step is launched (:meth:`update_after_launch`) and when
its samples are back (:meth:`update_from_output`). KV blocks belong to the
:class:`~engine.core.kv_cache_manager.KVCacheManager`; each scheduled batch carries the block
ids it appended to each request's table, which is all the worker needs to mirror them.

With async scheduling a running request may have an output placeholder: a token sampled by the
step still in flight. It counts as a token to compute (its id reaches the step on the device);
a request whose token in flight is its last by length is not scheduled again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.attention_budget import causal_pairs, max_rows_within
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import RequestOutput, SampleOutput
from engine.core.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step: which requests, how many new tokens each, and their block-table changes.

    Attributes:
        requests, num_new_tokens: the step's requests and their new-token counts (same order).
        new_block_ids: per request, the block ids appended to its block table for this step;
            when ``block_table_reset`` is set for it (admitted this step, new or after a
            preemption) they are its whole table.
        block_table_reset: per request, whether its table starts over.
        finished_request_ids: requests finished since the previous batch: the worker may drop
            their per-request state.
        num_preemptions: requests preempted while scheduling this step.
        grammar_rows, grammar_bitmask: the requests with an active grammar that sample this step
            (ids), and their packed bitmasks in that order (``ceil(vocab / 32)`` little-endian
            int32 words per request, bit set = token allowed); filled by the engine just before
            the launch, empty/None without grammars.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    block_table_reset: list[bool] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    grammar_rows: list[str] = field(default_factory=list)
    grammar_bitmask: bytearray | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def _add(self, req: Request, n: int, blocks: list[int], reset: bool) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.new_block_ids.append(blocks)
        self.block_table_reset.append(reset)


def _last_token_in_flight(req: Request) -> bool:
    """Whether the token in flight is the request's last by length (max_tokens or max_len)."""
    return (
        req.sample_index >= req.sampling_params.max_tokens
        or req.num_tokens_with_placeholders >= req.max_len
    )


def _within_pairs(n: int, computed: int, pairs_left: int | None, any_prefill: bool) -> int:
    """A prompt chunk of up to ``n`` rows after ``computed`` cached tokens, cut to the
    query-key pairs left to the step (None: no bound); the step's first chunk (no
    ``any_prefill`` yet) keeps at least one row, so running streams never starve a prompt."""
    if pairs_left is None:
        return n
    rows = max_rows_within(computed, pairs_left)
    return min(n, rows if rows or any_prefill else 1)


class Scheduler:
    """Waiting and running queues over a :class:`KVCacheManager`.

    Args:
        kv_cache_manager: the KV block owner.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of a step in which requests decode.
        enable_chunked_prefill: when False a prompt is only scheduled whole (and the two
            prefill budgets below do not apply).
        eos_token_ids: ids that end a request unless it ignores EOS.
        prefill_only_token_budget: token budget of a step in which nothing decodes (a lone long
            prompt gets larger chunks, so fewer steps to its first token); None: the same as
            ``max_num_batched_tokens``.
        max_prefill_tokens_with_decodes: most prompt tokens a step may carry while requests
            decode, so a long prefill cannot stretch every running stream's inter-token time
            (Sarathi-Serve's chunk bound, Agrawal et al. 2024); None or 0: the budget's
            remainder.
        lone_prompt_tokens: ``(low, high)``: when nothing runs and the first waiting request
            has ``low`` to ``high`` tokens to compute past its prefix-cache hit, the step's
            budget is at least those tokens (one large step runs the GEMMs at full size and, with
            no hit, lets the attention backend take a dense kernel;
            ``EngineConfig.lone_prompt_min_tokens``). ``(0, 0)``: never. Chunked prefill only.
        max_prefill_attention_with_decodes: most query-key pairs of prompt attention
            (:func:`~engine.core.attention_budget.causal_pairs`, summed over the step's prompt
            chunks) a step may carry while requests decode: a chunk over a long cached prefix
            gets fewer rows, so the attention work a long prompt adds to each running stream's
            step stays bounded at any context length. The first prompt chunk of a step always
            gets at least one row (a prompt is never starved by running streams). None: no
            bound (so is 0).

    Raises:
        ValueError: a negative ``max_prefill_tokens_with_decodes`` or
            ``max_prefill_attention_with_decodes``.

    Attributes:
        requests: live requests (waiting or running) by id.
        waiting, waiting_for_grammar, running: the queues (a request whose grammar is still
            compiling waits in ``waiting_for_grammar``, outside the admission order).
        num_preemptions: preemptions since start.
        num_host_sampling: live requests whose sampling reads host state (penalties,
            ``min_tokens``, a grammar): with async scheduling the steps holding them defer
            their sampling (:meth:`LLMEngine.step <engine.core.llm_engine.LLMEngine.step>`).
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        eos_token_ids: frozenset[int] = frozenset(),
        prefill_only_token_budget: int | None = None,
        max_prefill_tokens_with_decodes: int | None = None,
        max_prefill_attention_with_decodes: int | None = None,
        lone_prompt_tokens: tuple[int, int] = (0, 0),
    ):
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        chunked = enable_chunked_prefill
        self.prefill_only_token_budget = (
            prefill_only_token_budget
            if chunked and prefill_only_token_budget
            else max_num_batched_tokens
        )
        low, high = lone_prompt_tokens
        self.lone_prompt_tokens = (low, high) if chunked and 0 < low <= high else (0, 0)
        cap = max_prefill_tokens_with_decodes
        if cap is not None and cap < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be >= 0 (0: no cap), got {cap}")
        self.max_prefill_tokens_with_decodes = (cap or None) if chunked else None
        pairs = max_prefill_attention_with_decodes
        if pairs is not None and pairs < 0:
            raise ValueError(
                f"max_prefill_attention_with_decodes must be >= 0 (0: no bound), got {pairs}"
            )
        self.max_prefill_attention_with_decodes = (pairs or None) if chunked else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.waiting_for_grammar: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_host_sampling = 0
        self._finished_ids: list[str] = []

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must not be live). A request whose grammar is still
        compiling waits apart (:attr:`waiting_for_grammar`) until :meth:`promote_compiled`."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.grammar is not None and not request.grammar.ready():
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.append(request)
        if request.sampling_params.needs_host_state:
            self.num_host_sampling += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or waiting for their grammar to compile."""
        return len(self.waiting) + len(self.waiting_for_grammar)

    def promote_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled (in arrival order, behind the waiting
        queue); fail those whose grammar did not compile. Returns the failures' outputs."""
        if not self.waiting_for_grammar:
            return []
        still, failed = [], []
        for req in self.waiting_for_grammar:
            if not req.grammar.ready():
                still.append(req)
            elif req.grammar.error is not None:
                failed.append(req)
            else:
                self.waiting.append(req)
        self.waiting_for_grammar = still
        outputs = []
        for req in failed:
            outputs += self.fail([req], req.grammar.failure_message)
        return outputs

    def abort(self, request_id: str) -> bool:
        """Finish a live request with reason ``abort``; False for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, FinishReason.ABORT)
        return True

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks and drop it from the queues. Idempotent."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting_for_grammar:
            self.waiting_for_grammar.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        if self.requests.pop(request.request_id, None) is not None:
            self._finished_ids.append(request.request_id)
            if request.sampling_params.needs_host_state:
                self.num_host_sampling -= 1

    def fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        """Finish the still-live ones among ``requests`` with reason ``error``; their outputs."""
        outputs = []
        for req in requests:
            if not req.is_finished:
                self.finish(req, FinishReason.ERROR)
                outputs.append(RequestOutput.failed(req.request_id, message))
        return outputs

    # -------------------------------------------------------------- scheduling
    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)  # before the reset: it reads the computed tokens
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> ScheduledBatch:
        """Pick the requests of the next step and allocate their KV blocks."""
        batch = ScheduledBatch(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        kv = self.kv_cache_manager
        # a request decodes this step when one token is left to compute (its last sample, or
        # the token in flight); any such request sets the step's budgets
        decoding = any(
            r.num_tokens_with_placeholders - r.num_computed_tokens <= 1 for r in self.running
        )
        budget = self.max_num_batched_tokens if decoding else self.prefill_only_token_budget
        if not self.running and self.lone_prompt_tokens[1]:
            budget = self._lone_prompt_budget(budget)
        cap = self.max_prefill_tokens_with_decodes
        prefill_left = min(budget, cap) if decoding and cap else budget
        # query-key pairs of prompt attention left to the step (None: unbounded)
        pairs_left = self.max_prefill_attention_with_decodes if decoding else None
        any_prefill = False  # whether a prompt chunk is in the step yet

        # 1. running requests, oldest first; preempt the newest when blocks run out.
        queue = deque(self.running)
        kept: list[Request] = []
        reqs, counts, new_ids, resets = (
            batch.requests,
            batch.num_new_tokens,
            batch.new_block_ids,
            batch.block_table_reset,
        )
        while queue and budget > 0:
            req = queue.popleft()
            left = req.num_tokens_with_placeholders - req.num_computed_tokens
            if left <= 0 or (req.num_output_placeholders and _last_token_in_flight(req)):
                kept.append(req)  # its last token is in flight: it finishes when that arrives
                continue
            if left == 1:
                n = min(left, budget)
            else:
                n = _within_pairs(
                    min(left, budget, prefill_left),
                    req.num_computed_tokens,
                    pairs_left,
                    any_prefill,
                )
            if n <= 0:
                kept.append(req)  # the step's prefill tokens are spent; it continues next step
                continue
            # without chunked prefill a prefill is taken whole; only the recompute of a
            # preempted request (prompt + outputs) may exceed the budget and go in chunks
            if not self.enable_chunked_prefill and n < left <= self.max_num_batched_tokens:
                kept.append(req)  # cannot take a partial prefill; wait for a later step
                continue
            while (new_blocks := kv.allocate_slots(req, n)) is None:
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
            reqs.append(req)  # batch._add, inlined: this loop runs for every running request
            counts.append(n)
            new_ids.append(new_blocks)
            resets.append(False)
            budget -= n
            if left > 1:
                prefill_left -= n
                any_prefill = True
                if pairs_left is not None:
                    pairs_left -= causal_pairs(req.num_computed_tokens, n)
        kept.extend(queue)  # not scheduled this step (budget exhausted) but still running
        self.running = kept

        # 2. admit waiting requests in order, unless someone was preempted this step.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not batch.num_preemptions
        ):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: admitted once the token is back
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit
            n = _within_pairs(
                min(remaining, budget, prefill_left), num_hit, pairs_left, any_prefill
            )
            if n <= 0:
                break
            if not self.enable_chunked_prefill and n < remaining <= self.max_num_batched_tokens:
                break
            if kv.allocate_slots(req, n, hit_blocks) is None:
                break  # retried next step; the lookup is counted once, on admission
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            batch._add(req, n, kv.get_block_ids(req.request_id), True)
            budget -= n
            prefill_left -= n
            any_prefill = True
            if pairs_left is not None:
                pairs_left -= causal_pairs(num_hit, n)
        if not batch.requests:  # nothing runs: the finished ids go with the next batch that does
            self._finished_ids[:0] = batch.finished_request_ids
            batch.finished_request_ids = []
        return batch

    def _lone_prompt_budget(self, budget: int) -> int:
        """The step budget on an idle engine: at least the tokens the first waiting request
        has to compute past its prefix-cache hit, when they are within
        :attr:`lone_prompt_tokens` (with the default budgets it is then the step's only
        request: exactly those tokens, so a hit never becomes room for other prompts), else
        ``budget``. A follow-up turn over a cached conversation has few tokens left and keeps
        the budget."""
        if not self.waiting:
            return budget
        req = self.waiting[0]
        low, high = self.lone_prompt_tokens
        n = req.num_tokens - req.num_computed_tokens
        if req.num_output_placeholders or n < low or n <= budget:
            return budget
        n -= self.kv_cache_manager.get_computed_blocks(req)[1]
        return n if low <= n <= high and n > budget else budget

    # ----------------------------------------------------------------- updates
    def update_after_launch(self, batch: ScheduledBatch, sample_requests: list[Request]) -> int:
        """Advance the progress of a launched step's requests; returns the prompt tokens it
        computes.

        Args:
            batch: the launched step.
            sample_requests: those of its requests that sample a token (each gets a placeholder
                until :meth:`update_from_output`).
        """
        num_prompt = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens:  # the step computes prompt tokens
                num_prompt += min(start + n, req.num_prompt_tokens) - start
            req.num_computed_tokens = start + n
        for req in sample_requests:
            req.num_output_placeholders += 1
        return num_prompt

    def update_from_output(
        self, sample_requests: list[Request], samples: SampleOutput
    ) -> list[RequestOutput]:
        """Apply a step's samples (rows in ``sample_requests`` order): append each token, check
        the stop conditions, finish the requests that stop; returns their outputs.

        Requests finished while the step ran (aborted, failed, stopped) are skipped.
        """
        if samples.prompt_logprobs:
            self._add_prompt_logprobs(samples.prompt_logprobs)
        outputs = []
        for i, req in enumerate(sample_requests):
            req.num_output_placeholders -= 1
            if req.is_finished:
                continue
            p = req.sampling_params
            prompt_lps = None
            if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
            if p.max_tokens == 0:  # prompt scoring only: the sampled token is not kept
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        [],
                        prompt_logprobs=prompt_lps,
                        finished=True,
                        finish_reason=FinishReason.LENGTH,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens,
                        scheduled_time=req.first_scheduled_time,
                    )
                )
                self.finish(req, FinishReason.LENGTH)
                continue
            token = samples.token_ids[i]
            req.output_token_ids.append(token)
            grammar = req.grammar
            if grammar is not None:
                grammar.accept(token)
                if grammar.error is not None:
                    outputs += self.fail([req], grammar.failure_message)
                    continue
            if grammar is not None and grammar.completed:
                reason = FinishReason.STOP  # whatever ignore_eos and min_tokens say
            else:
                reason = self._check_stop(req, token)
            lp = samples.logprobs[i]
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [token],
                    [lp] if lp is not None or p.logprobs is not None else [],
                    prompt_logprobs=prompt_lps,
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                    scheduled_time=req.first_scheduled_time,
                )
            )
            if reason is not None:
                self.finish(req, reason)
        return outputs

    def _add_prompt_logprobs(self, chunks: dict) -> None:
        """Append each live request's newly scored prompt positions to ``prompt_logprobs``.

        Positions already held are skipped: a request preempted while it scored its prompt
        computes (and scores) it again from the start.
        """
        for rid, (start, entries) in chunks.items():
            req = self.requests.get(rid)
            if req is None or req.prompt_logprobs_sent:
                continue  # finished meanwhile, or already delivered
            have = len(req.prompt_logprobs)
            if start <= have < start + len(entries):
                req.prompt_logprobs.extend(entries[have - start :])

    def drop_placeholders(self, sample_requests: list[Request]) -> None:
        """A launched step's samples will never arrive (it failed): remove their placeholders."""
        for req in sample_requests:
            req.num_output_placeholders -= 1

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                return FinishReason.STOP
        if n_out >= p.max_tokens or req.num_tokens >= req.max_len:
            return FinishReason.LENGTH
        return None
