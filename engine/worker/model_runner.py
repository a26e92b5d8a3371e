"""Runs scheduled batches on one device: builds the model, owns the paged KV cache, launches steps.

The engine core (``engine.core.llm_engine``) hands each :class:`ScheduledBatch` to
:meth:`ModelRunner.launch`, which builds the step's inputs once (``engine.worker.step_inputs``),
replays a CUDA graph or runs the model eagerly, samples, and queues the copy of the samples to
the host without waiting (:class:`StepHandle`).

In a tensor-parallel engine every rank has a runner over its shard of the model, its KV heads,
its CUDA graphs; rank 0's is driven by the engine core (through
``engine.worker.tp_executor.TensorParallelExecutor``), the others by the step messages they
receive (``engine.worker.tp_worker``); both run :meth:`ModelRunner.execute`, so the ranks issue
the same collectives in the same order. Rank 0 samples and broadcasts the sampled ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.registry import default_backend_name, get_attention_backend
from engine.core.config import (
    DEFAULT_LONE_PROMPT_MIN_TOKENS,
    CacheInfo,
    EngineConfig,
    ModelConfig,
    check_max_model_len,
    resolve_quantization,
)
from engine.core.layout import RankLayout
from engine.core.outputs import SampleOutput
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import ScheduledBatch
from engine.layers import kernel_switches
from engine.loader.dummy import init_random_weights
from engine.loader.safetensors_loader import load_weights
from engine.models.registry import model_class
from engine.worker.block_table import PersistentBlockTables
from engine.worker.device import (
    MemoryStats,
    dtype_name,
    is_device_error,
    limit_host_threads,
    torch_dtype,
)
from engine.worker.parallel_state import RankContext
from engine.worker.prefill_budget import (
    ACTIVATION_RESERVE_BYTES,
    STEP_RESERVE_BYTES,
    max_step_tokens,
)
from engine.worker.prompt_logprobs import (
    DevicePromptLogprobs,
    PendingPromptLogprobs,
    score_prompt_rows,
)
from engine.worker.sampler import PendingSamples, Sampler
from engine.worker.staging import HostStaging
from engine.worker.step_inputs import StepInputs, StepTensors, prepare_inputs

log = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A step queued on the device.

    Attributes:
        sample_requests: requests sampling a token in this step, in row order.
        pending: the samples' copy to the host (None when nothing samples).
        token_ids: int64 ``[N]`` sampled ids on the device (inputs of the next step).
        rows: request id -> row in ``token_ids``.
        prompt: the copy of the step's prompt log-probabilities (None when no request scored
            its prompt); prompt_segments: their layout (``StepInputs.prompt_segments``).
    """

    sample_requests: list[Request]
    pending: PendingSamples | None
    token_ids: torch.Tensor | None
    rows: dict[str, int]
    prompt: PendingPromptLogprobs | None = None
    prompt_segments: list[tuple[str, int, int, int]] | None = None

    def result(self) -> SampleOutput:
        """Wait for the step; returns its samples (rows in ``sample_requests`` order) and its
        prompt log-probabilities."""
        out = self.pending.wait() if self.pending is not None else SampleOutput([], [])
        if self.prompt is not None:
            out.prompt_logprobs = self.prompt.wait(self.prompt_segments)
        return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Create parameters in ``dtype`` (``torch.set_default_dtype``) within the block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """Builds the model, allocates the paged KV cache and executes steps (the engine's
    :class:`~engine.core.executor.ModelExecutor` on one device).

    Args:
        model_config: architecture; config: engine settings (``load_format="dummy"``: no
            checkpoint is read, weights are drawn on the device from ``config.seed``;
            ``quantization``: see ``engine.core.config.resolve_quantization``).
        rank: this rank of a tensor-parallel engine (its device, process groups); None: the
            whole model on ``config.device``. The ranks agree on the number of KV blocks (the
            smallest any rank fits), so the scheduler's blocks exist on every rank.

    Attributes:
        rank_layout: where this runner's shard lives (device, weight and KV bytes); layout:
            the executor's, ``(rank_layout,)`` on one device.

    Raises:
        ValueError: an unsupported architecture, dtype, quantization or attention backend, a
            checkpoint that does not match the model, or a KV cache budget that holds no block.
    """

    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, rank: RankContext | None = None
    ):
        self._built_on_thread = threading.get_ident()  # where warm-up made per-thread caches
        quantization = resolve_quantization(model_config, config.quantization)
        if rank is not None and rank.tp is not None:  # the executors checked it already
            model_config.check_tensor_parallel(rank.tp.size, quantization)
        model_config = dataclasses.replace(model_config, quantization=quantization)
        self.model_config = model_config
        self.config = config
        self.rank = rank
        self.tp = rank.tp if rank is not None else None
        self.device = rank.device if rank is not None else torch.device(config.device)
        cuda = self.device.type == "cuda"
        self.dtype = torch_dtype(config.dtype or (model_config.dtype if cuda else "float32"))
        max_len = check_max_model_len(config, model_config)

        compile_mode = config.compile_mode or ("ops" if cuda else "none")
        self.backend_name = config.attention_backend or default_backend_name(self.device.type)
        with torch.device(self.device), _default_dtype(self.dtype):
            model = model_class(model_config.architecture)(
                model_config,
                max_positions=max_len,
                attention_backend=self.backend_name,
                compile_mode=compile_mode,
                **({} if self.tp is None else {"tp": self.tp}),
            )
        if config.load_format == "dummy":
            init_random_weights(model, config.seed)
        else:
            load_weights(model, config.model)
        self.model = model.eval()
        if model_config.quantization is not None:
            from engine.layers.quantization import fp8_backend

            backend = fp8_backend(self.device)
            log.info(
                "block FP8 linear layers (%s, 128x128 weight blocks, activations per token in "
                "groups of 128): %s",
                "from the checkpoint"
                if model_config.quantization.checkpoint_quantized
                else "quantized at load",
                "Triton FP8 GEMM"
                if backend == "triton"
                else f"reference path: no FP8 matmul on {self.device}, weights dequantized to "
                "float32 at every call",
            )
        log.info(
            "%s (%s): %s",
            model_config.architecture,
            f"random weights, seed {config.seed}"
            if config.load_format == "dummy"
            else "loaded from " + config.model,
            model.weight_summary(),
        )
        if cuda and (rank is None or rank.rank == 0):
            from kernels.configs import device_name, tables_summary

            name = device_name(self.device)
            log.info("kernel tile tables of this %s: %s", name, tables_summary(name))
        self.staging = HostStaging(self.device)
        # rank 0 samples (a tensor-parallel engine's other ranks receive the ids)
        first = rank is None or rank.rank == 0
        self.sampler = Sampler(self.device, staging=self.staging) if first else None

        mc = model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        kv_heads = model.model.layers[0].self_attn.num_kv_heads  # this rank's
        per_block = 2 * mc.num_hidden_layers * config.block_size * kv_heads * mc.head_dim * elem
        num_blocks = self._num_kv_blocks(per_block)
        if rank is not None:
            num_blocks = rank.min_across_ranks(num_blocks)
        shape = (num_blocks, config.block_size, kv_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]
        # the persistent decode path (before the warm-up and the graph captures): on by default
        # on CUDA devices for the shapes it was measured on (a kernel that spills is refused);
        # elsewhere (the Triton interpreter) and for any shape only when asked for
        asked = kernel_switches.PERSISTENT_DECODE_ASKED
        if kernel_switches.PERSISTENT_DECODE and (cuda or asked):
            # (imported here: it imports Triton, which a CPU server never loads)
            from engine.models.persistent_decode import DEFAULT_MAX_SPILL_BYTES

            enable = getattr(model, "enable_persistent_decode", None)
            options = kernel_switches.persistent_options()
            options["max_spill_bytes"] = None if asked else DEFAULT_MAX_SPILL_BYTES
            try:
                reason = (
                    enable(self.kv_caches, config.block_size, **options)
                    if enable
                    else "not this model"
                )
            except Exception as exc:  # e.g. a compile error: the layer loop stays
                reason = f"{type(exc).__name__}: {exc}"
            if reason is None:
                pd = model.persistent_decode
                log.info(
                    "one-token decode steps of one sequence with up to %d tokens of context run "
                    "all layers in one persistent launch (%s)",
                    pd.max_context,
                    pd.layout_summary(),
                )
            elif asked:
                log.warning("QWEN_SERVE_PERSISTENT_DECODE=1 not applied: %s", reason)
            else:
                log.info(
                    "one-token decode steps run the layer loop (no persistent path: %s)", reason
                )
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            log.warning(
                "KV cache holds %d tokens; max_model_len lowered from %d", capacity, max_len
            )
            max_len = capacity
        lone_min = self._lone_prompt_min()
        # on CUDA the range is set after the graphs are captured, from the memory they leave
        # (_resolve_lone_prompts); until then no whole-prompt steps
        self.cache_info = CacheInfo(
            num_blocks,
            config.block_size,
            max_len,
            per_block,
            dtype_name(self.dtype),
            *((0, 0) if cuda else self._check_lone_range(lone_min, max_len)),
        )
        self.description = (
            f"{mc.architecture} on {self.device} ({dtype_name(self.dtype)}), "
            f"attention {self.backend_name}"
        )
        if rank is not None:
            self.description += f", tensor parallel {rank.size} (rank {rank.rank})"
        self.rank_layout = RankLayout(
            rank=rank.rank if rank is not None else 0,
            device=str(self.device),
            host=socket.gethostname(),
            pid=os.getpid(),
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            kv_cache_bytes=num_blocks * per_block,
            kv_heads=kv_heads,
        )
        self.layout = (self.rank_layout,)
        self.block_tables = PersistentBlockTables(
            -(-max_len // config.block_size),
            max(64, config.max_num_seqs),
            record_changes=rank is not None and rank.rank == 0,
        )
        self._memory = MemoryStats(self.device)
        self.graphs = None
        self.prefill_graphs = None
        # before anything is compiled: torch.compile guards on the thread count, so a change
        # after the warm-up recompiled every compiled function in the first eager step (0.9 s)
        if cuda and limit_host_threads():
            log.info("torch CPU threads set to 1 for the GPU engine (OMP_NUM_THREADS overrides)")
        if cuda:
            self.warmup()
            torch.cuda.empty_cache()  # the graphs' private pool cannot reuse the allocator's cache
        if config.cuda_graph and cuda and self.backend_name == "triton":
            from engine.worker.cuda_graph import DecodeGraphs, PrefillGraphs

            max_blocks = -(-max_len // config.block_size)
            graph_tokens = (
                config.max_num_batched_tokens
                if config.prefill_graph_max_tokens is None
                else config.prefill_graph_max_tokens
            )
            if graph_tokens > 0:
                self.prefill_graphs = PrefillGraphs(
                    self.model,
                    self.kv_caches,
                    graph_tokens,
                    config.max_num_seqs,
                    max_blocks,
                    max_len,
                    self.device,
                )
                self.prefill_graphs.capture()
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                max_blocks,
                max_len,
                pool=self.prefill_graphs.pool if self.prefill_graphs is not None else None,
            )
            self.graphs.capture()
        if cuda and lone_min:
            self._resolve_lone_prompts(lone_min, rank.size if rank is not None else 1, elem)

    def _lone_prompt_min(self) -> int:
        """The shortest whole-prompt step configured for this runner:
        ``lone_prompt_min_tokens``, its default on CUDA when unset (0 elsewhere), 0 without
        chunked prefill (0 = no whole-prompt steps)."""
        cfg = self.config
        if not cfg.enable_chunked_prefill:
            return 0
        if cfg.lone_prompt_min_tokens is not None:
            return cfg.lone_prompt_min_tokens
        return DEFAULT_LONE_PROMPT_MIN_TOKENS if self.device.type == "cuda" else 0

    def _check_lone_range(self, lone_min: int, lone_max: int) -> tuple[int, int]:
        """``(lone_min, lone_max)``, or ``(0, 0)`` (logged when configured) when empty."""
        if 0 < lone_min <= lone_max:
            return lone_min, lone_max
        if lone_min > lone_max and self.config.lone_prompt_min_tokens:
            log.warning(
                "lone_prompt_min_tokens %d is above the longest whole-prompt step (%d tokens: "
                "max_model_len, or the activations the memory outside the KV cache and the "
                "CUDA graphs holds): no whole-prompt steps",
                lone_min,
                lone_max,
            )
        return 0, 0

    def _warm_up_dense_prefill(self, max_tokens: int) -> None:
        """cuDNN's plans for the lone prompts of up to ``max_tokens`` tokens that take the
        attention backend's cuDNN path (built on this thread; none when the path is off)."""
        attn = self.model.model.layers[0].self_attn
        backend = get_attention_backend(self.backend_name)
        if not hasattr(backend, "warm_up_dense_prefill"):
            return
        built = backend.warm_up_dense_prefill(
            max_tokens, attn.num_heads, attn.head_dim, self.dtype, self.device, attn.attn.scale
        )
        if built:
            log.info(
                "cuDNN attention for lone prompts of %d-%d tokens (%d padded lengths)",
                backend.dense_prefill_min_tokens,
                max_tokens,
                built,
            )

    @torch.inference_mode()
    def _resolve_lone_prompts(self, lone_min: int, tp_size: int, elem: int) -> None:
        """The longest whole-prompt step, from the memory left after the KV cache and the CUDA
        graphs (below ``gpu_memory_utilization``; with an explicit KV cache size, what is free
        less 512 MiB): cuDNN's plans for its lengths are built and one step of that length is
        run (a step that would not fit fails here, not in serving: then no whole-prompt
        steps). Sets ``cache_info``'s range."""
        cfg, info = self.config, self.cache_info
        torch.cuda.empty_cache()  # blocks the allocator keeps from the capture count as used
        free, total = torch.cuda.mem_get_info(self.device)
        if cfg.num_kv_blocks is None and cfg.kv_cache_memory_gb is None:
            memory = total * cfg.gpu_memory_utilization - (total - free)
        else:
            memory = free - (512 << 20)
        lone_max = max_step_tokens(self.model_config, tp_size, elem, info.max_model_len, memory)
        if self.rank is not None:  # every rank runs the same steps
            lone_max = self.rank.min_across_ranks(lone_max)
        lone_min, lone_max = self._check_lone_range(lone_min, lone_max)
        if lone_max:
            try:
                self._warm_up_dense_prefill(lone_max)
                self.warmup(((lone_max, 1),))
            except torch.OutOfMemoryError:
                if self.rank is not None:
                    # the other ranks may be inside the step's collectives: fail the start-up
                    raise
                log.warning(
                    "a whole-prompt step of %d tokens does not fit in GPU memory: no "
                    "whole-prompt steps",
                    lone_max,
                )
                lone_min = lone_max = 0
            torch.cuda.empty_cache()
        self.cache_info = dataclasses.replace(
            info, lone_prompt_min_tokens=lone_min, lone_prompt_max_tokens=lone_max
        )

    # ------------------------------------------------------------- executor API
    def prepare_thread(self) -> None:
        """Build, on the calling thread, what the device libraries cache per host thread: a cuBLAS
        handle and workspace (one small product), and cuDNN's attention plans for the lone
        prompts of the cuDNN path (torch keeps its cuDNN SDPA graph cache thread-local:
        ``MHAGraphCache`` in ``aten/src/ATen/native/cudnn/MHA.cpp``).
        Start-up built them on the constructing thread; an engine loop on another thread
        (``--engine-mode thread``) would otherwise build each length on its first use (~74 ms
        on the H200). A no-op on the constructing thread and on the CPU; the plans only with
        whole-prompt steps. Raises nothing: what cannot be made now is made on first use
        (logged)."""
        lone_max = self.cache_info.lone_prompt_max_tokens
        if threading.get_ident() == self._built_on_thread or self.device.type != "cuda":
            return
        steps = [("cuBLAS handle", self._warm_up_blas)]  # cuBLAS(Lt) handles are per thread too
        if lone_max:
            steps.append(("cuDNN plans", lambda: self._warm_up_dense_prefill(lone_max)))
        for what, step in steps:
            try:
                with torch.inference_mode():
                    step()
            except Exception as exc:  # noqa: BLE001 - serving goes on; made on first use
                log.warning("%s not made on the engine thread (made on first use): %s", what, exc)

    def _warm_up_blas(self) -> None:
        """One small product in the model dtype on this thread (its cuBLAS handle and
        workspace)."""
        a = torch.ones(16, 16, dtype=self.dtype, device=self.device)
        torch.matmul(a, a)

    def memory_stats(self) -> dict[str, int]:
        """CUDA memory of the engine's device in bytes (empty on the CPU), at most a second old
        (see :class:`~engine.worker.device.MemoryStats`)."""
        return self._memory.read()

    def is_fatal(self, exc: BaseException) -> bool:
        """A device error: the CUDA context is unusable (see :func:`is_device_error`)."""
        return is_device_error(exc)

    def shutdown(self) -> None:
        """Nothing to release on one device (the tensor-parallel executor stops its ranks)."""

    @torch.inference_mode()
    def launch(
        self,
        batch: ScheduledBatch,
        eos_token_ids: frozenset[int],
        prev: StepHandle | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepHandle:
        """Queue one step on the device without waiting for it: forward over all scheduled
        tokens, sampling for the requests that reach their end, and the copy of the sampled ids
        to the host.

        Args:
            batch: the step; its block-table changes are applied to the runner's mirror.
            eos_token_ids: masked for requests below ``min_tokens``.
            prev: the step still in flight, whose sampled ids are the input tokens of requests
                with an output placeholder (async scheduling); None when nothing is in flight.
            before_sampling: called once the forward is queued and before the sampling is
                (deferred sampling): the engine applies ``prev``'s samples to the host state
                there and fills ``batch.grammar_bitmask`` while the device runs the forward.
                Not called for a step that samples nothing.

        A step in which a request scores its prompt (``StepInputs.prompt_rows``) runs eagerly,
        not as a CUDA graph: the prefill graphs end with the hidden states of the sampled rows
        only, and a step of prompt scoring needs the rows of every scored position (sized by the
        step, at most the token budget). Steps without such a request are unchanged.

        Returns:
            A handle; :meth:`StepHandle.result` waits for the samples.

        Raises:
            RuntimeError: a request with a token in flight that ``prev`` did not sample.
        """
        return self.launch_inputs(
            self.prepare(batch, prev), batch, eos_token_ids, prev, before_sampling
        )

    def prepare(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepInputs:
        """The step's host inputs (the batch's block-table changes applied to the mirror).

        Raises:
            RuntimeError: a request with a token in flight that ``prev`` did not sample.
        """
        return prepare_inputs(
            batch,
            self.config.block_size,
            self.block_tables,
            prev.rows if prev is not None else None,
        )

    def launch_inputs(
        self,
        inp: StepInputs,
        batch: ScheduledBatch,
        eos_token_ids: frozenset[int],
        prev: StepHandle | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepHandle:
        """:meth:`launch` after :meth:`prepare`: run, call ``before_sampling``, sample (rank 0
        of a tensor-parallel engine then broadcasts the ids to the other ranks, on the
        device), queue the copy to the host. Call it under ``torch.inference_mode()``
        (:meth:`launch` does)."""
        logits, prompt = self.execute(inp, prev.token_ids if prev is not None else None)
        pending_prompt = prompt.to_host() if prompt is not None else None
        if logits is None or not inp.sample_requests:
            return StepHandle([], None, None, {}, pending_prompt, inp.prompt_segments)
        if before_sampling is not None:
            before_sampling()
        samples = self.sampler(
            logits, inp.sample_requests, eos_token_ids, batch.grammar_rows, batch.grammar_bitmask
        )
        if self.tp is not None:
            self.tp.broadcast_from_first(samples.token_ids)
        rows = {r.request_id: i for i, r in enumerate(inp.sample_requests)}
        return StepHandle(
            inp.sample_requests,
            samples.to_host(),
            samples.token_ids,
            rows,
            pending_prompt,
            inp.prompt_segments,
        )

    def execute(
        self, inp: StepInputs, prev_token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, DevicePromptLogprobs | None]:
        """Run one step's forward on the device (queued, no host sync): a CUDA graph or the
        eager model; its keys/values go to the KV cache. Call it under
        ``torch.inference_mode()``. Every rank of a tensor-parallel engine calls it with the
        same inputs, so the ranks issue the same collectives in the same order.

        Args:
            inp: the step's host inputs.
            prev_token_ids: int64 ``[N_prev]`` sampled ids of the step in flight (the inputs
                of ``inp.gather_dst``), or None.

        Returns:
            ``(logits, prompt)``: logits ``[N, vocab]`` (model dtype) of the
            ``N = len(inp.logits_indices)`` rows that sample, None when no row samples; the
            step's prompt log-probabilities on the device when ``inp.prompt_rows`` is set,
            else None. Both are None on the ranks of a tensor-parallel engine other than 0
            (they take part in the logits' gathers, rank 0 keeps the result).
        """
        self.staging.next_step()
        if (
            self.graphs is not None
            and inp.is_decode
            and self.graphs.can_run(len(inp.seq_lens), inp.max_seq_len)
        ):  # staged straight into the graphs' input buffers
            return self.graphs.run_inputs(inp, self.staging, prev_token_ids), None
        step = inp.to_device(self.staging, prev_token_ids)
        prompt = None
        if (
            step.prompt_rows is None
            and self.prefill_graphs is not None
            and self.prefill_graphs.can_run(step.num_tokens, inp.max_seq_len)
        ):
            hidden = self.prefill_graphs.run(step)
        else:
            full = self.forward(step)
            hidden = full[step.logits_indices]
            if step.prompt_rows is not None:
                k = max((seg[3] for seg in inp.prompt_segments or ()), default=0)
                prompt = score_prompt_rows(
                    self.model.compute_logits,
                    full[step.prompt_rows],
                    step.prompt_targets,
                    k,
                    self.model_config.vocab_size,
                )
            del full
        if not len(inp.logits_indices):
            return None, prompt
        return self.model.compute_logits(hidden), prompt

    # --------------------------------------------------------------- internals
    def forward(self, step: StepTensors) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of an eager forward over a step (writes its k/v)."""
        return self.model(step.input_ids, step.positions, self.kv_caches, step.attention_metadata())

    @torch.inference_mode()
    def warmup(self, shapes: tuple[tuple[int, int], ...] | None = None) -> None:
        """Run dummy prefill steps of the shapes serving will see, so that kernel compilation
        (Triton JIT specialisations, torch.compile) happens at start-up and not in the first
        requests' time to first token (vLLM runs a dummy batch at start-up the same way).

        Args:
            shapes: ``(tokens, sequences)`` of the steps; None: the step budgets' shapes.

        The dummy tokens store nothing (slot -1) and read only block 0 of the cache.
        """
        budget = self.config.max_num_batched_tokens
        solo = max(budget, self.config.prefill_only_token_budget or 0)
        max_len = self.cache_info.max_model_len
        if shapes is None:
            shapes = ((solo, 1), (budget, 1), (budget, 32), (97, 3))
            if self.device.type == "cuda":  # a lone prompt within the budgets may take cuDNN
                self._warm_up_dense_prefill(min(solo, max_len))
        else:
            solo = max(t for t, _ in shapes)
        for num_tokens, num_seqs in dict.fromkeys(shapes):
            num_seqs = max(1, min(num_seqs, self.config.max_num_seqs))
            num_tokens = max(
                1, min(num_tokens, solo, num_seqs * max_len)
            )  # no sequence beyond max_len
            num_seqs = min(num_seqs, num_tokens)
            q_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
            q_lens[: num_tokens % num_seqs] += 1
            cu = np.zeros(num_seqs + 1, dtype=np.int32)
            cu[1:] = np.cumsum(q_lens)
            blocks = -(-int(q_lens.max()) // self.config.block_size)
            inp = StepInputs(
                input_ids=np.zeros(num_tokens, dtype=np.int64),
                positions=np.concatenate([np.arange(n, dtype=np.int64) for n in q_lens]),
                slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
                block_tables=np.zeros((num_seqs, blocks), dtype=np.int32),
                seq_lens=q_lens.copy(),
                cu_seqlens_q=cu,
                logits_indices=(cu[1:] - 1).astype(np.int64),
                sample_requests=[],
                max_query_len=int(q_lens.max()),
                max_seq_len=int(q_lens.max()),
            )
            self.staging.next_step()
            step = inp.to_device(self.staging)
            logits = self.model.compute_logits(self.forward(step)[step.logits_indices])
            if logits is None:  # not rank 0 of a tensor-parallel engine: it does not sample
                continue
            reqs = [
                Request(
                    f"warmup-{i}",
                    [0],
                    SamplingParams(temperature=float(i % 2), max_tokens=1),
                    max_len,
                )
                for i in range(num_seqs)
            ]
            self.sampler(logits, reqs, frozenset()).to_host().wait()

    def _num_kv_blocks(self, bytes_per_block: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * (1 << 30)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # leave room for the graphs and the activations of the largest step
            whole_prompts = self._lone_prompt_min() and not self.model_config.num_experts
            reserve = ACTIVATION_RESERVE_BYTES if whole_prompts else STEP_RESERVE_BYTES
            budget = total * cfg.gpu_memory_utilization - used - reserve
        else:
            budget = 1 << 30  # 1 GiB on the CPU
        blocks = int(budget // bytes_per_block)
        if blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget / (1 << 30):.3f} GiB holds no block of "
                f"{bytes_per_block} bytes"
            )
        return blocks
