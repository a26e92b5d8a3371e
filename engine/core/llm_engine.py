"""The synchronous engine: requests in, one batched step at a time, token outputs out."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.executor import ModelExecutor, StepHandle
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.limits import EngineLimits, RequestRejected
from engine.core.outputs import RequestOutput
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.stats import StepStats
from engine.core.structured_output import GrammarState, StructuredOutputManager

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Pure Python: the model runs in the ``executor`` it is handed
    (``engine.worker.build.build_engine`` builds both).

    Args:
        config: engine settings.
        executor: runs the steps (see :class:`~engine.core.executor.ModelExecutor`).
        eos_token_ids: ids ending generation.
    """

    def __init__(
        self, config: EngineConfig, executor: ModelExecutor, eos_token_ids: frozenset[int]
    ):
        self.config = config
        self.executor = executor
        self.model_config = executor.model_config
        info = executor.cache_info
        self.cache_info = info
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache_manager = KVCacheManager(
            info.num_kv_blocks, info.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=self.eos_token_ids,
            prefill_only_token_budget=config.prefill_only_token_budget,
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
            max_prefill_attention_with_decodes=config.max_prefill_attention_with_decodes,
            lone_prompt_tokens=(info.lone_prompt_min_tokens, info.lone_prompt_max_tokens),
        )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else config.device_type == "cuda"
        )
        self._grammars: StructuredOutputManager | None = (
            None  # built with the first structured-output request
        )
        self._in_flight: StepHandle | None = None  # launched step whose samples are not applied yet
        self._undelivered: list[RequestOutput] = []
        self.limits = EngineLimits(
            max_model_len=info.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            dtype=info.dtype,
            ranks=tuple(executor.layout),
        )
        log.info(
            "engine ready: %s, KV cache %d blocks x %d tokens (%.2f GiB), max_model_len %d, "
            "tokens per step at most %d (--max-num-batched-tokens; %d in steps where no "
            "request decodes; %s)",
            executor.description,
            info.num_kv_blocks,
            info.block_size,
            info.num_kv_blocks * info.kv_bytes_per_block / (1 << 30),
            info.max_model_len,
            config.max_num_batched_tokens,
            self.scheduler.prefill_only_token_budget,
            "prompts of {}-{} tokens run whole on an idle engine".format(
                *self.scheduler.lone_prompt_tokens
            )
            if self.scheduler.lone_prompt_tokens[1]
            else "no prompt runs whole in one step",
        )

    # ---------------------------------------------------------------- requests
    @property
    def requests(self) -> dict[str, Request]:
        """Live requests by id (the scheduler's)."""
        return self.scheduler.requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validate and queue a request.

        Raises:
            RequestRejected: see :meth:`EngineLimits.validate`, or a duplicate id.
        """
        if request_id in self.scheduler.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}", "duplicate")
        self.limits.validate(prompt_token_ids, params.max_tokens)
        req = Request(request_id, list(prompt_token_ids), params, max_len=self.max_model_len)
        spec = params.structured_output
        if spec is not None:
            if self._grammars is None:
                self._grammars = StructuredOutputManager(
                    Path(self.config.model) / "tokenizer.json",
                    self.model_config.vocab_size,
                    self.eos_token_ids,
                )
            req.grammar = GrammarState(spec, self._grammars.template(spec))
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Finish a request at once and free its blocks. Returns False for an unknown id."""
        return self.scheduler.abort(request_id)

    def prepare_thread(self) -> None:
        """Make the executor's per-thread caches on the calling thread, the one about to run
        :meth:`step` (see ``ModelExecutor.prepare_thread``)."""
        self.executor.prepare_thread()

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a launched step not yet applied."""
        return self.scheduler.has_work() or self._in_flight is not None

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether ``exc`` left the device unusable (the executor's classification)."""
        return self.executor.is_fatal(exc)

    def shutdown(self) -> None:
        """Stop what the executor started (a tensor-parallel engine's other ranks);
        idempotent. The engine takes no steps afterwards."""
        self.executor.shutdown()

    # -------------------------------------------------------------------- step
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One engine iteration: schedule and launch a step, and apply sampled tokens.

        With async scheduling (the default on CUDA) the step launched here runs on the device
        while the host processes the previous step's samples and, in the next call, schedules
        the step after it: the host work overlaps the GPU (vLLM's async scheduling). A running
        request with a token in flight is scheduled with an output placeholder and reads that
        token on the device. The outputs returned are those of the previous launch. A step with
        a request whose sampling reads host state (penalties, ``min_tokens``, a grammar) defers
        its sampling: the forward is queued first, the previous step's samples are applied
        while it runs (grammar matchers advanced, the bitmask filled), then the sampling is
        queued, so it sees every earlier token and only the sampling waits for the host.

        An exception inside the model fails only the requests of that step (finish reason
        ``error``) and the engine stays usable, except for a device error (see
        :meth:`is_fatal`), which is re-raised after failing them: the device is unusable.
        """
        t0 = time.perf_counter()
        kv = self.kv_cache_manager
        q0, h0 = kv.prefix_queries, kv.prefix_hits
        outputs: list[RequestOutput] = []
        self._undelivered = (
            outputs  # what this call has produced, should it raise (take_undelivered)
        )
        overlap = self.async_scheduling
        outputs += self.scheduler.promote_compiled()
        batch = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        deferred = (
            overlap
            and self.scheduler.num_host_sampling > 0
            and any(r.sampling_params.needs_host_state for r in batch.requests)
        )
        handle, n_prompt, prev_done = self._launch(batch, outputs, prev, deferred)
        if overlap:
            self._in_flight = handle
        if prev is not None and not prev_done:
            outputs += self._process(prev)
        if handle is not None and not overlap:
            outputs += self._process(handle)
        self._undelivered = []
        n_gen = sum(len(o.new_token_ids) for o in outputs)
        return outputs, self._stats(t0, n_prompt, n_gen, batch.num_preemptions, q0, h0)

    def take_undelivered(self) -> list[RequestOutput]:
        """Outputs produced by a :meth:`step` call that then raised (e.g. finished requests
        drained before a device error); the engine loop emits them before failing the rest."""
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _launch(
        self,
        batch: ScheduledBatch,
        outputs: list[RequestOutput],
        prev: StepHandle | None,
        deferred: bool,
    ) -> tuple[StepHandle | None, int, bool]:
        """Launch the batch and advance its requests' progress; returns (handle, prompt tokens,
        whether ``prev`` was processed here).

        ``prev``: the step in flight, whose sampled ids feed requests with a placeholder.
        ``deferred``: process ``prev`` (its outputs appended to ``outputs``) and fill the grammar
        bitmasks between the batch's forward and its sampling (see :meth:`step`). A non-fatal
        launch failure fails the batch's requests (appended to ``outputs``).
        """
        if not len(batch):
            self._wait_for_grammars()
            return None, 0, False
        prev_done = False
        apply_failed = False  # an exception while applying ``prev``: not this step's fault

        def before_sampling() -> None:
            nonlocal prev_done, apply_failed
            if prev is not None:
                prev_done = True
                try:
                    outputs.extend(self._process(prev))
                except Exception:
                    # as outside the callback, it leaves step(): the engine loop fails every
                    # request (prev may be half applied: its placeholders cannot be trusted)
                    apply_failed = True
                    raise
            self._fill_bitmasks(batch)

        try:
            if deferred:
                handle = self.executor.launch(
                    batch, self.eos_token_ids, prev, before_sampling=before_sampling
                )
            else:
                self._fill_bitmasks(batch)
                handle = self.executor.launch(batch, self.eos_token_ids, prev)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            if apply_failed or self.is_fatal(exc):
                raise
            log.error("model step failed; failing %d requests", len(batch), exc_info=exc)
            outputs += self.scheduler.fail(batch.requests, str(exc))
            return None, 0, prev_done
        return handle, self.scheduler.update_after_launch(batch, handle.sample_requests), prev_done

    def _fill_bitmasks(self, batch: ScheduledBatch) -> None:
        """Packed grammar bitmasks of the batch's requests that sample this step. Their last
        token is on the host: the step is synchronous or its sampling deferred, after the
        previous step's samples were applied (a request finished by them is skipped)."""
        if self._grammars is None:
            return
        states = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            grammar = req.grammar
            if (
                grammar is not None
                and not req.is_finished
                and grammar.constrains_next
                and req.num_computed_tokens + n == req.num_tokens_with_placeholders
            ):
                states.append(grammar)
                batch.grammar_rows.append(req.request_id)
        if states:
            batch.grammar_bitmask = self._grammars.fill_bitmasks(states)

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars compiling: wait a little for one (no busy loop)."""
        pending = [r.grammar.compiled for r in self.scheduler.waiting_for_grammar]
        if pending:
            concurrent.futures.wait(
                pending, timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _process(self, handle: StepHandle) -> list[RequestOutput]:
        """Wait for a launched step and apply its samples (the scheduler appends tokens, checks
        stops and finishes). A non-fatal error while waiting fails the step's requests (a device
        error is re-raised)."""
        try:
            samples = handle.result()
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            if self.is_fatal(exc):
                raise
            self.scheduler.drop_placeholders(handle.sample_requests)
            log.error(
                "model step failed; failing %d requests", len(handle.sample_requests), exc_info=exc
            )
            return self.scheduler.fail(handle.sample_requests, str(exc))
        return self.scheduler.update_from_output(handle.sample_requests, samples)

    def idle_stats(self) -> StepStats:
        """Queue and cache state without a step (after aborts emptied the engine)."""
        kv = self.kv_cache_manager
        return self._stats(time.perf_counter(), 0, 0, 0, kv.prefix_queries, kv.prefix_hits)

    def _stats(self, t0, n_prompt, n_gen, n_preempt, q0, h0) -> StepStats:
        kv = self.kv_cache_manager
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            kv_usage=kv.usage,
            num_prompt_tokens=n_prompt,
            num_generation_tokens=n_gen,
            num_preemptions=n_preempt,
            prefix_queries=kv.prefix_queries - q0,
            prefix_hits=kv.prefix_hits - h0,
            step_seconds=time.perf_counter() - t0,
            **self.executor.memory_stats(),
        )

    # ----------------------------------------------------------------- offline
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (offline batch); returns the output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{id(self)}-{i}" for i in range(len(prompts))]
        reqs = [self.add_request(rid, p, sp) for rid, p, sp in zip(ids, prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [r.output_token_ids for r in reqs]
