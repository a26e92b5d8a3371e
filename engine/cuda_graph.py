"""CUDA graphs for decode steps: one captured graph per batch size, replayed with padded inputs.

Decode steps of a small model are dominated by kernel-launch overhead; replaying a captured
graph removes it (the approach of vLLM and nano-vllm). Inputs live in static buffers that the
graphs read; a step copies its tensors in, pads the batch to the next captured size (padding
rows store nothing: slot -1, and attend to one token of block 0), replays, and reads the logits
of its real rows.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_batch`` (at most 512)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, min(max_batch, 512) + 1, 16))
    if max_batch > sizes[-1] and max_batch <= 512:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode graphs of one model and KV cache.

    Args:
        model: the engine's model; kv_caches: its cache tensors; backend: must be graph-safe
            (the Triton backend: no host syncs, scratch reused). With ``compile_mode="model"``
            the warm-up run of each size compiles (or reuses) the model's decode graph -- one
            for batch 1, one for every larger size -- before capture, and the capture records
            the Inductor kernels, cuBLAS calls and the attention op's Triton launches; Python
            (guards, wrapper) runs only at capture, not at replay.
        max_batch: largest decode batch; max_blocks_per_seq: block-table width;
        max_seq_len: the engine's max_model_len (sizes the decode split count at capture).
    """

    def __init__(self, model, kv_caches, backend, max_batch: int, max_blocks_per_seq: int, max_seq_len: int):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        dev = model.model.embed_tokens.weight.device
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1], max_query_len=1, max_seq_len=self.max_seq_len, is_decode=True,
        )

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs), self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs share its memory pool."""
        for bs in reversed(self.sizes):
            self._run(bs)  # warm up (Triton and torch.compile compilation, allocator)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._run(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: int, max_seq_len: int) -> bool:
        return batch <= self.sizes[-1] and max_seq_len <= self.max_seq_len

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens) -> torch.Tensor:
        """Replay the graph for a decode batch of B sequences; returns logits ``[B, vocab]`` (model dtype).

        Args: device tensors of one decode step (``[B]`` each, block_tables ``[B, M]``).
        """
        b = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        m = block_tables.shape[1]
        self.block_tables[:b, :m].copy_(block_tables, non_blocking=True)
        self.block_tables[b:bs].zero_()
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
