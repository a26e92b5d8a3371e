"""Turns a scheduled batch into flat step tensors, runs the model and samples; owns the KV cache."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.block_table import PersistentBlockTables
from engine.config import EngineConfig, ModelConfig
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.request import Request, SamplingParams
from engine.sampler import PendingSamples, SampleOutput, Sampler
from engine.scheduler import ScheduledBatch
from engine.weights import load_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheInfo:
    """Runtime facts decided when the runner starts: KV blocks allocated and the usable length."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_bytes_per_block: int


@dataclass
class StepInputs:
    """Host-side arrays of one step before they move to the device.

    ``input_ids``/``positions``/``slot_mapping``: ``[T]``; ``block_tables``: ``[B, M]``;
    ``seq_lens``: ``[B]``; ``cu_seqlens_q``: ``[B + 1]``; ``logits_indices``: rows of the
    packed hidden states to sample from (one per request that completes its tokens this step),
    ``sample_requests``: those requests. ``gather_dst``/``gather_src``: input tokens still in
    flight (async scheduling): ``input_ids[gather_dst[i]]`` is the previous step's sampled id
    in row ``gather_src[i]``; the host holds a 0 there until the device fills it in.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    logits_indices: np.ndarray
    sample_requests: list[Request]
    max_query_len: int
    max_seq_len: int
    gather_dst: np.ndarray | None = None
    gather_src: np.ndarray | None = None


def prepare_inputs(batch: ScheduledBatch, block_size: int, block_tables: PersistentBlockTables,
                   prev_rows: dict[str, int] | None = None) -> StepInputs:
    """Flatten a scheduled batch into the step's index arrays (host side, numpy).

    Args:
        block_tables: the runner's persistent block-table mirror (synced here).
        prev_rows: request id -> sample row of the step still in flight; a request with an
            output placeholder takes its input token from that row on the device.

    Raises:
        RuntimeError: a request has a token in flight but no row in ``prev_rows``.
    """
    reqs = batch.requests
    b = len(reqs)
    q_lens = np.fromiter(batch.num_new_tokens, dtype=np.int32, count=b)
    starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=b)
    seq_lens = starts + q_lens
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    gather_dst, gather_src = [], []
    ids: list[int] = []
    logits_indices, sample_requests = [], []
    for i, req in enumerate(reqs):
        n = int(q_lens[i])
        start = req.num_computed_tokens
        if req.num_output_placeholders:
            # decode of a token sampled by the step in flight: filled in on the device
            row = (prev_rows or {}).get(req.request_id)
            if row is None or n != 1 or start != req.num_tokens:
                raise RuntimeError(f"request {req.request_id} has a token in flight but no sample row")
            gather_dst.append(len(ids))
            gather_src.append(row)
            ids.append(0)
        elif n == 1:
            ids.append(req.token_at(start))
        else:
            ids.extend(req.all_token_ids[start:start + n])
        if start + n == req.num_tokens_with_placeholders:  # all its tokens computed: sample
            logits_indices.append(len(ids) - 1)
            sample_requests.append(req)
    rows = block_tables.rows_for(reqs)
    max_blocks = max(1, -(-int(seq_lens.max()) // block_size)) if b else 1
    tables = block_tables.gather(rows, max_blocks)
    total = int(cu[-1])
    seq_of_token = np.repeat(np.arange(b), q_lens)
    positions = (np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], q_lens) + np.repeat(starts, q_lens)).astype(
        np.int64)
    slot_mapping = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepInputs(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        sample_requests=sample_requests,
        max_query_len=int(q_lens.max()) if b else 0,
        max_seq_len=int(seq_lens.max()) if b else 0,
        gather_dst=np.asarray(gather_dst, dtype=np.int64) if gather_dst else None,
        gather_src=np.asarray(gather_src, dtype=np.int64) if gather_src else None,
    )


@dataclass
class StepHandle:
    """A step queued on the device.

    Attributes:
        sample_requests: requests sampling a token in this step, in row order.
        pending: the samples' copy to the host (None when nothing samples).
        token_ids: int64 ``[N]`` sampled ids on the device (inputs of the next step).
        rows: request id -> row in ``token_ids``.
    """

    sample_requests: list[Request]
    pending: PendingSamples | None
    token_ids: torch.Tensor | None
    rows: dict[str, int]

    def result(self) -> tuple[list[Request], SampleOutput]:
        """Wait for the step; returns its sampling requests and their samples (same order)."""
        if self.pending is None:
            return [], SampleOutput([], [])
        return self.sample_requests, self.pending.wait()


class ModelRunner:
    """Builds the model, allocates the paged KV cache and executes steps.

    Args:
        model_config: architecture; config: engine settings;
        random_weights: skip loading and fill weights from a seed (benchmarks).
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig, random_weights: bool = False):
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        default_dtype = model_config.torch_dtype if self.device.type == "cuda" else torch.float32
        self.dtype = config.dtype or default_dtype
        max_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)

        compile_mode = config.compile_mode or ("ops" if self.device.type == "cuda" else "none")
        with torch.device(self.device):
            model = Qwen3ForCausalLM(model_config, max_positions=max_len, compile_mode=compile_mode)
        model.to(self.dtype)
        model.model.rotary_emb.cos = model.model.rotary_emb.cos.float()
        model.model.rotary_emb.sin = model.model.rotary_emb.sin.float()
        if random_weights:
            model.init_random_weights(config.seed)
        else:
            load_weights(model, config.model)
        self.model = model.eval()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device)

        mc = model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = 2 * mc.num_hidden_layers * config.block_size * mc.num_key_value_heads * mc.head_dim * elem
        num_blocks = self._num_kv_blocks(per_block)
        shape = (num_blocks, config.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(mc.num_hidden_layers)
        ]
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            log.warning("KV cache holds %d tokens; max_model_len lowered from %d", capacity, max_len)
            max_len = capacity
        self.cache_info = CacheInfo(num_blocks, config.block_size, max_len, per_block)
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self._staging_events: dict[tuple[str, int], torch.cuda.Event] = {}
        self._staging_parity = 0
        self.block_tables = PersistentBlockTables(-(-max_len // config.block_size), max(64, config.max_num_seqs))
        self._gpu_total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        self._memory_stats: dict[str, int] | None = None
        self._memory_stats_time = 0.0
        self.graphs = None
        self.prefill_graphs = None
        if self.device.type == "cuda":
            self.warmup()
            torch.cuda.empty_cache()  # the graphs' private pool cannot reuse the allocator's cache
        if config.cuda_graph and self.device.type == "cuda" and self.backend.name == "triton":
            from engine.cuda_graph import DecodeGraphs, PrefillGraphs

            max_blocks = -(-max_len // config.block_size)
            graph_tokens = config.max_num_batched_tokens if config.prefill_graph_max_tokens is None \
                else config.prefill_graph_max_tokens
            if graph_tokens > 0:
                self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.backend, graph_tokens,
                                                    config.max_num_seqs, max_blocks, max_len, self.device)
                self.prefill_graphs.capture()
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, config.max_num_seqs, max_blocks, max_len,
                                       pool=self.prefill_graphs.pool if self.prefill_graphs is not None else None)
            self.graphs.capture()

    def release(self, request_id: str) -> None:
        """Forget a finished request's per-request state (block-table row, sampler state)."""
        self.block_tables.release(request_id)
        self.sampler.release(request_id)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run dummy prefill steps of the shapes serving will see, so that kernel compilation
        (Triton JIT specialisations, torch.compile) happens at start-up and not in the first
        requests' time to first token (vLLM runs a dummy batch at start-up the same way).

        The dummy tokens store nothing (slot -1) and read only block 0 of the cache.
        """
        budget = self.config.max_num_batched_tokens
        max_len = self.cache_info.max_model_len
        for num_tokens, num_seqs in ((budget, 1), (budget, 32), (97, 3)):
            num_seqs = max(1, min(num_seqs, self.config.max_num_seqs))
            num_tokens = max(1, min(num_tokens, budget, num_seqs * max_len))  # no sequence beyond max_len
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
                seq_lens=q_lens.copy(), cu_seqlens_q=cu, logits_indices=cu[1:] - 1, sample_requests=[],
                max_query_len=int(q_lens.max()), max_seq_len=int(q_lens.max()),
            )
            hidden = self._forward(inp)
            logits = self.model.compute_logits(hidden[self._to_device(inp.logits_indices, "logits_indices")])
            reqs = [Request(f"warmup-{i}", [0], SamplingParams(temperature=float(i % 2), max_tokens=1), max_len)
                    for i in range(num_seqs)]
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
            # leave room for activations of the largest step
            budget = total * cfg.gpu_memory_utilization - used - (2 << 30)
        else:
            budget = 1 << 30  # 1 GiB on the CPU
        blocks = int(budget // bytes_per_block)
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget / (1 << 30):.3f} GiB holds no block of {bytes_per_block} bytes")
        return blocks

    #: seconds between reads of the CUDA allocator's statistics (see :meth:`memory_stats`)
    MEMORY_STATS_INTERVAL_S = 1.0

    def memory_stats(self) -> dict[str, int]:
        """CUDA memory of the engine's device in bytes (empty on the CPU), at most
        ``MEMORY_STATS_INTERVAL_S`` old.

        Each ``torch.cuda.memory_allocated``/``memory_reserved`` call builds the allocator's
        whole statistics dict (~0.2 ms of host time); per step that was ~19 % of the engine
        process's samples at concurrency 64 (py-spy, H200 run of 2026-11-29), so the values are
        re-read once a second instead (metrics are scraped every few seconds).
        """
        if self.device.type != "cuda":
            return {}
        now = time.monotonic()
        if self._memory_stats is None or now - self._memory_stats_time >= self.MEMORY_STATS_INTERVAL_S:
            self._memory_stats = {
                "gpu_memory_allocated": torch.cuda.memory_allocated(self.device),
                "gpu_memory_reserved": torch.cuda.memory_reserved(self.device),
                "gpu_memory_total": self._gpu_total,
            }
            self._memory_stats_time = now
        return self._memory_stats

    def _to_device(self, a: np.ndarray, name: str) -> torch.Tensor:
        """Move a step array to the device through a reused pinned staging buffer per ``name``.

        Before a buffer is refilled, the copy that last read it must have run, so each buffer's
        last copy is tracked with a CUDA event and waited for. Consecutive steps alternate
        between two sets of buffers (``_staging_parity``): with a step in flight, the copy being
        waited for belongs to the step before it, which has finished, so the host never waits
        for the running step (a copy queued after its forward would otherwise hold it up).
        """
        t = torch.from_numpy(a)
        if self.device.type != "cuda":
            return t
        key = (name, self._staging_parity)
        pending = self._staging_events.get(key)
        if pending is not None:
            pending.synchronize()
        buf = self._staging.get(key)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 2 * (buf.numel() if buf is not None else 1024)), dtype=t.dtype,
                              pin_memory=True)
            self._staging[key] = buf
        staged = buf[: t.numel()].view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staging_events[key] = event
        return out

    def _forward(self, inp: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self._to_device(inp.slot_mapping, "slot_mapping"),
            block_tables=self._to_device(inp.block_tables, "block_tables"),
            seq_lens=self._to_device(inp.seq_lens, "seq_lens"),
            cu_seqlens_q=self._to_device(inp.cu_seqlens_q, "cu_seqlens_q"),
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            is_decode=inp.max_query_len == 1,
        )
        if input_ids is None:
            input_ids = self._to_device(inp.input_ids, "input_ids")
        return self.model(input_ids, self._to_device(inp.positions, "positions"), self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_ids: frozenset[int], prev: "StepHandle | None" = None) -> "StepHandle":
        """Queue one step on the device without waiting for it: forward over all scheduled
        tokens, sampling for the requests that reach their end, and the copy of the sampled ids
        to the host.

        Args:
            prev: the step still in flight, whose sampled ids are the input tokens of requests
                with an output placeholder (async scheduling); None when nothing is in flight.

        Returns:
            A handle; :meth:`StepHandle.result` waits for the samples.
        """
        inp = prepare_inputs(batch, self.config.block_size, self.block_tables, prev.rows if prev is not None else None)
        self._staging_parity ^= 1
        input_ids = self._to_device(inp.input_ids, "input_ids")
        if inp.gather_dst is not None:
            dst = self._to_device(inp.gather_dst, "gather_dst")
            src = self._to_device(inp.gather_src, "gather_src")
            input_ids.index_copy_(0, dst, prev.token_ids.index_select(0, src))
        use_graph = (self.graphs is not None and inp.max_query_len == 1 and len(inp.sample_requests) == len(batch)
                     and self.graphs.can_run(len(batch), inp.max_seq_len))
        if use_graph:  # a pure decode step: every row samples (a 1-token prefill chunk does not)
            logits = self.graphs.run(
                input_ids, self._to_device(inp.positions, "positions"),
                self._to_device(inp.slot_mapping, "slot_mapping"), self._to_device(inp.block_tables, "block_tables"),
                self._to_device(inp.seq_lens, "seq_lens"),
            )
        else:
            logits_indices = self._to_device(inp.logits_indices, "logits_indices")
            if self.prefill_graphs is not None and self.prefill_graphs.can_run(len(inp.input_ids), inp.max_seq_len):
                hidden = self.prefill_graphs.run(
                    input_ids, self._to_device(inp.positions, "positions"),
                    self._to_device(inp.slot_mapping, "slot_mapping"), self._to_device(inp.block_tables, "block_tables"),
                    self._to_device(inp.seq_lens, "seq_lens"), self._to_device(inp.cu_seqlens_q, "cu_seqlens_q"),
                    logits_indices,
                )
            else:
                hidden = self._forward(inp, input_ids)[logits_indices]
            if not inp.sample_requests:
                return StepHandle([], None, None, {})
            logits = self.model.compute_logits(hidden)
        samples = self.sampler(logits, inp.sample_requests, eos_ids)
        rows = {r.request_id: i for i, r in enumerate(inp.sample_requests)}
        return StepHandle(inp.sample_requests, samples.to_host(), samples.token_ids, rows)

    @torch.inference_mode()
    def logits_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits of every scheduled token ``[T, vocab]`` (tests compare these with transformers)."""
        inp = prepare_inputs(batch, self.config.block_size, self.block_tables)
        return self.model.compute_logits(self._forward(inp)).float()
