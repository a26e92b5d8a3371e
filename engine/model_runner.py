"""Turns a scheduled batch into flat step tensors, runs the model and samples; owns the KV cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.request import Request
from engine.sampler import SampleOutput, Sampler
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
    ``sample_requests``: those requests.
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


def prepare_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """Flatten a scheduled batch into the step's index arrays (host side, numpy)."""
    b = len(batch)
    seq_lens = np.empty(b, dtype=np.int32)
    cu = np.zeros(b + 1, dtype=np.int32)
    ids_parts, pos_parts = [], []
    max_blocks = 1
    logits_indices, sample_requests = [], []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start = req.num_computed_tokens
        end = start + n
        seq_lens[i] = end
        cu[i + 1] = cu[i] + n
        if n == 1:
            ids_parts.append([req.token_at(start)])
        else:
            ids_parts.append(req.all_token_ids[start:end])
        pos_parts.append(np.arange(start, end, dtype=np.int64))
        max_blocks = max(max_blocks, len(req.block_table))
        if end == req.num_tokens:
            logits_indices.append(cu[i + 1] - 1)
            sample_requests.append(req)
    block_tables = np.zeros((b, max_blocks), dtype=np.int32)
    for i, req in enumerate(batch.requests):
        block_tables[i, : len(req.block_table)] = req.block_table
    positions = np.concatenate(pos_parts)
    input_ids = np.fromiter((t for part in ids_parts for t in part), dtype=np.int64, count=len(positions))
    row = np.repeat(np.arange(b), np.diff(cu))
    slot_mapping = block_tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    q_lens = np.diff(cu)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        sample_requests=sample_requests,
        max_query_len=int(q_lens.max()) if b else 0,
        max_seq_len=int(seq_lens.max()) if b else 0,
    )


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

        compile_mode = config.compile_mode or ("model" if self.device.type == "cuda" else "none")
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
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_events: dict[str, torch.cuda.Event] = {}
        self._gpu_total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        self.graphs = None
        if config.cuda_graph and self.device.type == "cuda" and self.backend.name == "triton":
            from engine.cuda_graph import DecodeGraphs

            max_blocks = -(-max_len // config.block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, config.max_num_seqs, max_blocks, max_len)
            self.graphs.capture()

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

    def memory_stats(self) -> dict[str, int]:
        """CUDA memory of the engine's device in bytes (empty on the CPU)."""
        if self.device.type != "cuda":
            return {}
        return {
            "gpu_memory_allocated": torch.cuda.memory_allocated(self.device),
            "gpu_memory_reserved": torch.cuda.memory_reserved(self.device),
            "gpu_memory_total": self._gpu_total,
        }

    def _to_device(self, a: np.ndarray, name: str) -> torch.Tensor:
        """Move a step array to the device through a reused pinned staging buffer per ``name``.

        Before a buffer is refilled, the copy that last read it must have run: a step that
        samples nothing (a prefill chunk) returns without a host sync, so each buffer's last copy
        is tracked with a CUDA event and waited for.
        """
        t = torch.from_numpy(a)
        if self.device.type != "cuda":
            return t
        pending = self._staging_events.get(name)
        if pending is not None:
            pending.synchronize()
        buf = self._staging.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 2 * (buf.numel() if buf is not None else 1024)), dtype=t.dtype,
                              pin_memory=True)
            self._staging[name] = buf
        staged = buf[: t.numel()].view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staging_events[name] = event
        return out

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self._to_device(inp.slot_mapping, "slot_mapping"),
            block_tables=self._to_device(inp.block_tables, "block_tables"),
            seq_lens=self._to_device(inp.seq_lens, "seq_lens"),
            cu_seqlens_q=self._to_device(inp.cu_seqlens_q, "cu_seqlens_q"),
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            is_decode=inp.max_query_len == 1,
        )
        ids, pos = self._to_device(inp.input_ids, "input_ids"), self._to_device(inp.positions, "positions")
        return self.model(ids, pos, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_ids: frozenset[int]) -> tuple[list[Request], SampleOutput]:
        """Run one step: forward over all scheduled tokens, sample for requests that reached their end.

        Returns:
            The requests that sampled a token this step and their samples (same order).
        """
        inp = prepare_inputs(batch, self.config.block_size)
        use_graph = (self.graphs is not None and inp.max_query_len == 1 and len(inp.sample_requests) == len(batch)
                     and self.graphs.can_run(len(batch), inp.max_seq_len))
        if use_graph:  # a pure decode step: every row samples (a 1-token prefill chunk does not)
            logits = self.graphs.run(
                self._to_device(inp.input_ids, "input_ids"), self._to_device(inp.positions, "positions"),
                self._to_device(inp.slot_mapping, "slot_mapping"), self._to_device(inp.block_tables, "block_tables"),
                self._to_device(inp.seq_lens, "seq_lens"),
            )
            return inp.sample_requests, self.sampler(logits, inp.sample_requests, eos_ids)
        hidden = self._forward(inp)
        if not inp.sample_requests:
            return [], SampleOutput([], [])
        logits = self.model.compute_logits(hidden[self._to_device(inp.logits_indices, "logits_indices")])
        return inp.sample_requests, self.sampler(logits, inp.sample_requests, eos_ids)

    @torch.inference_mode()
    def logits_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits of every scheduled token ``[T, vocab]`` (tests compare these with transformers)."""
        return self.model.compute_logits(self._forward(prepare_inputs(batch, self.config.block_size)))
