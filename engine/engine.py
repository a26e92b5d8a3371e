"""The synchronous engine: requests in, one batched step at a time, token outputs out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, read_generation_config
from engine.limits import EngineLimits, RequestRejected
from engine.model_runner import ModelRunner, StepHandle
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stats import StepStats

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        new_token_ids: tokens sampled this step (0 or 1).
        logprobs: per new token, None or (logprob, [(id, logprob)] alternatives).
        finish_reason: set on the request's last output.
        error: message when the request failed inside the engine.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    scheduled_time: float | None = None

    @staticmethod
    def failed(request_id: str, message: str) -> "RequestOutput":
        """The last output of a request the engine failed."""
        return RequestOutput(request_id, [], finished=True, finish_reason=FinishReason.ERROR, error=message)


def is_fatal(exc: BaseException) -> bool:
    """A CUDA error (illegal access, launch failure): it poisons the CUDA context, so every
    later step would fail too. Out-of-memory and ordinary exceptions are not fatal."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


def eos_ids_from(model_dir: str) -> frozenset[int]:
    """EOS ids from ``generation_config.json`` (an int or a list)."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        config: engine settings (``config.model`` is the checkpoint directory).
        eos_token_ids: ids ending generation; default: the checkpoint's generation config.
        random_weights: benchmark mode, weights from ``config.seed`` instead of the checkpoint.
    """

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] | None = None, random_weights: bool = False):
        self.config = config
        self.model_config = ModelConfig.from_hf(config.model)
        self.runner = ModelRunner(self.model_config, config, random_weights=random_weights)
        info = self.runner.cache_info
        self.cache_info = info
        self.max_model_len = info.max_model_len
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else eos_ids_from(config.model)
        self.block_manager = BlockManager(info.num_kv_blocks, info.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.requests: dict[str, Request] = {}
        dev = torch.device(config.device)
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else dev.type == "cuda"
        self._in_flight: StepHandle | None = None  # launched step whose samples are not applied yet
        self._sync_requests: set[str] = set()  # live requests whose sampling reads host state
        self._undelivered: list[RequestOutput] = []
        self.limits = EngineLimits(
            max_model_len=info.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=frozenset(self.eos_token_ids), num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            dtype=str(self.runner.dtype).removeprefix("torch."),
        )
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks x %d tokens, max_model_len %d, backend %s",
            self.model_config.model_type, config.device, self.runner.dtype, info.num_kv_blocks,
            info.block_size, info.max_model_len, self.runner.backend.name,
        )

    # ---------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject a request that can never be served (see :meth:`EngineLimits.validate`)."""
        self.limits.validate(prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request.

        Raises:
            RequestRejected: see :meth:`validate`, or a duplicate id.
        """
        if request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}", "duplicate")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, max_len=self.max_model_len)
        self.requests[request_id] = req
        if params.needs_penalties or params.min_tokens > 0:
            self._sync_requests.add(request_id)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Finish a request at once and free its blocks. Returns False for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a launched step not yet applied."""
        return self.scheduler.has_work() or self._in_flight is not None

    # -------------------------------------------------------------------- step
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

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.runner.release(req.request_id)
        self._sync_requests.discard(req.request_id)

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One engine iteration: schedule and launch a step, and apply sampled tokens.

        With async scheduling (the default on CUDA) the step launched here runs on the device
        while the host processes the previous step's samples and, in the next call, schedules
        the step after it: the host work overlaps the GPU (vLLM's async scheduling). A running
        request with a token in flight is scheduled with an output placeholder and reads that
        token on the device. The outputs returned are those of the previous launch. Requests whose
        sampling reads host state (penalties, ``min_tokens``) make steps synchronous while they run.

        An exception inside the model fails only the requests of that step (finish reason
        ``error``) and the engine stays usable, except for a device error (see
        :func:`is_fatal`), which is re-raised after failing them: the device is unusable.
        """
        t0 = time.perf_counter()
        bm = self.block_manager
        q0, h0 = bm.prefix_queries, bm.prefix_hits
        outputs: list[RequestOutput] = []
        self._undelivered = outputs  # what this call has produced, should it raise (take_undelivered)
        overlap = self.async_scheduling and not self._sync_requests
        if not overlap and self._in_flight is not None:  # drain before a synchronous step
            prev, self._in_flight = self._in_flight, None
            outputs += self._process(prev)
        batch = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        handle, n_prompt = self._launch(batch, outputs, prev)
        if overlap:
            self._in_flight = handle
        if prev is not None:
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

    def _launch(self, batch: ScheduledBatch, outputs: list[RequestOutput],
                prev: StepHandle | None) -> tuple[StepHandle | None, int]:
        """Launch the batch and advance its requests' computed tokens; returns (handle, prompt tokens).

        ``prev``: the step in flight, whose sampled ids feed requests with a placeholder. A
        non-fatal launch failure fails the batch's requests (appended to ``outputs``).
        """
        if not len(batch):
            return None, 0
        try:
            handle = self.runner.launch(batch, self.eos_token_ids, prev)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            if is_fatal(exc):
                raise
            outputs += self._fail(batch.requests, exc)
            return None, 0
        n_prompt = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            n_prompt += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
        for req in handle.sample_requests:
            req.num_output_placeholders += 1
        return handle, n_prompt

    def _fail(self, requests: list[Request], exc: Exception) -> list[RequestOutput]:
        """Finish the step's still-live requests with finish reason ``error``; returns their outputs."""
        log.error("model step failed; failing %d requests", len(requests), exc_info=exc)
        outputs = []
        for req in requests:
            if not req.is_finished:
                self._finish(req, FinishReason.ERROR)
                outputs.append(RequestOutput.failed(req.request_id, str(exc)))
        return outputs

    def _process(self, handle: StepHandle) -> list[RequestOutput]:
        """Wait for a launched step and apply its samples: append tokens, check stops, finish.

        A non-fatal error while waiting fails the step's requests (a device error is re-raised).
        """
        outputs = []
        try:
            sampled_reqs, samples = handle.result()
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            if is_fatal(exc):
                raise
            for req in handle.sample_requests:
                req.num_output_placeholders -= 1
            return self._fail(handle.sample_requests, exc)
        for i, req in enumerate(sampled_reqs):
            req.num_output_placeholders -= 1
            if req.is_finished:  # aborted, failed or stopped while this step ran
                continue
            token = samples.token_ids[i]
            req.output_token_ids.append(token)
            reason = self._check_stop(req, token)
            lp = samples.logprobs[i]
            outputs.append(RequestOutput(
                req.request_id, [token], [lp] if lp is not None or req.sampling_params.logprobs is not None else [],
                finished=reason is not None, finish_reason=reason,
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                scheduled_time=req.first_scheduled_time,
            ))
            if reason is not None:
                self._finish(req, reason)
        return outputs

    def idle_stats(self) -> StepStats:
        """Queue and cache state without a step (after aborts emptied the engine)."""
        bm = self.block_manager
        return self._stats(time.perf_counter(), 0, 0, 0, bm.prefix_queries, bm.prefix_hits)

    def _stats(self, t0, n_prompt, n_gen, n_preempt, q0, h0) -> StepStats:
        bm = self.block_manager
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_usage=bm.usage,
            num_prompt_tokens=n_prompt,
            num_generation_tokens=n_gen,
            num_preemptions=n_preempt,
            prefix_queries=bm.prefix_queries - q0,
            prefix_hits=bm.prefix_hits - h0,
            step_seconds=time.perf_counter() - t0,
            **self.runner.memory_stats(),
        )

    # ----------------------------------------------------------------- offline
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (offline batch); returns the output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{id(self)}-{i}" for i in range(len(prompts))]
        reqs = [self.add_request(rid, p, sp) for rid, p, sp in zip(ids, prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [r.output_token_ids for r in reqs]
