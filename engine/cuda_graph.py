"""CUDA graphs for engine steps, replayed with padded inputs from static buffers.

A step of a small model is dominated by host work: Python, the guards of compiled functions and
~15 kernel launches per layer. Replaying a captured graph removes it (vLLM, nano-vllm). Inputs
live in static buffers that the graphs read; a step copies its tensors in, pads them to the next
captured size, replays, and reads the rows of its real tokens.

* :class:`DecodeGraphs`: one graph per decode batch size (one new token per sequence); padding
  rows store nothing (slot -1) and attend to one token of block 0.
* :class:`PrefillGraphs`: one graph per padded token count for every other step (prefills,
  prompt chunks, decodes mixed with chunks) -- vLLM's "full" CUDA-graph mode for mixed batches.
  This works because the attention kernels' grids depend only on tensor shapes (the padded token
  count and sequence count) and host ints fixed per graph (the decode kernel's split count, from
  the padded sequence count and max_model_len), never on the step's lengths; padding tokens
  belong to no sequence and store nothing, padding sequences have no tokens. The Triton backend
  runs the decode rows of such a step through the decode kernel (``cu_seqlens_q`` mode) and the
  rest through the prefill kernel, both in the graph.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def capture_graphs(sizes: list[int], run, graphs: dict, outputs: dict, pool=None):
    """Capture ``run(size)`` once per size, largest first so smaller graphs reuse its memory.

    Each size is run once eagerly first (Triton and torch.compile compilation, allocator
    warm-up), then captured; ``graphs[size]`` gets the graph and ``outputs[size]`` the tensor
    the captured run returned (overwritten by every replay).

    Returns:
        The memory pool the graphs share (``pool`` itself when one was given).
    """
    for size in reversed(sizes):
        run(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = run(size)
        if pool is None:
            pool = graph.pool()
        graphs[size] = graph
        torch.cuda.synchronize()
    return pool


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
        pool: a CUDA graph memory pool to share (``PrefillGraphs.pool``), or None for a new one.
    """

    def __init__(self, model, kv_caches, backend, max_batch: int, max_blocks_per_seq: int, max_seq_len: int,
                 pool=None):
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
        self.pool = pool  # memory pool shared with other graphs (e.g. PrefillGraphs.pool)

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
        self.pool = capture_graphs(self.sizes, self._run, self.graphs, self.logits, self.pool)
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


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for prefill/mixed steps: a step of ``t`` tokens pads to at most
    ``1.25 * t + 16`` (every 16 up to 128, then steps that double at 256, 512, 1024, 2048 and
    4096), and the last size is ``max_tokens`` rounded up to a multiple of 16."""
    sizes = list(range(16, 129, 16))
    for step, stop in ((32, 256), (64, 512), (128, 1024), (256, 2048), (512, 4096), (1024, 1 << 30)):
        while sizes[-1] < stop and sizes[-1] < max_tokens:
            sizes.append(sizes[-1] + step)
    top = -(-max(1, max_tokens) // 16) * 16
    return [s for s in sizes if s < top] + [top]


class PrefillGraphs:
    """Captured graphs of prefill and mixed steps, one per padded token count.

    A step of ``T`` tokens from ``B`` sequences replays the graph of the smallest captured size
    ``T_pad >= T``; that graph has ``S = min(max_seqs, T_pad)`` sequence slots (``B <= T``, as
    every scheduled sequence brings at least one token). Padding tokens ``T .. T_pad`` have slot
    -1 (nothing stored) and lie past ``cu_seqlens_q[B]`` (no sequence attends with them);
    padding sequences ``B .. S`` have no tokens. The graph ends with the final hidden states of
    the rows to sample (``logits_indices``, padded with row 0); the LM head and the sampler run
    after the replay on the real rows only, so the graphs hold no ``[S, vocab]`` logits.

    Args:
        model: the engine's model; kv_caches: its cache tensors; backend: graph-safe (Triton:
            no host syncs, grid from shapes only).
        max_tokens: largest step to capture (the engine's token budget); max_seqs: most
            sequences in a step; max_blocks_per_seq: block-table width; max_seq_len: the
            engine's max_model_len.
        device: where the static buffers live; without CUDA nothing is captured and
            :meth:`run` executes the same padded forward eagerly (the tests' CPU check of the
            padding).
    """

    def __init__(self, model, kv_caches, backend, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 max_seq_len: int, device: torch.device):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        t, s = self.sizes[-1], min(max_seqs, self.sizes[-1])
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(s, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(s, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None

    def _num_seqs(self, size: int) -> int:
        return min(self.max_seqs, size)

    def _run(self, size: int) -> torch.Tensor:
        s = self._num_seqs(size)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:s], seq_lens=self.seq_lens[:s],
            cu_seqlens_q=self.cu_seqlens_q[: s + 1], max_query_len=size, max_seq_len=self.max_seq_len,
            is_decode=False,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.backend)
        return hidden[self.logits_indices[:s]]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs share its memory pool.

        The static buffers hold an empty step meanwhile (no sequence has tokens, every slot is
        -1): the warm-up and captured runs store nothing and read nothing from the cache.
        """
        self.slot_mapping.fill_(-1)
        self.cu_seqlens_q.zero_()
        self.logits_indices.zero_()
        self.pool = capture_graphs(self.sizes, self._run, self.graphs, self.hidden, self.pool)
        log.info("captured prefill/mixed-step CUDA graphs for token counts %s", self.sizes)

    def can_run(self, num_tokens: int, max_seq_len: int) -> bool:
        return num_tokens <= self.sizes[-1] and max_seq_len <= self.max_seq_len

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
            logits_indices) -> torch.Tensor:
        """Run one step of ``T`` tokens from ``B`` sequences through the graph of its padded size.

        Args: device tensors of the step: ``input_ids``, ``positions``, ``slot_mapping`` ``[T]``
            (int64), ``block_tables`` int32 ``[B, M]``, ``seq_lens`` int32 ``[B]``,
            ``cu_seqlens_q`` int32 ``[B + 1]``, ``logits_indices`` int64 ``[N]`` (rows to sample).

        Returns:
            Final hidden states ``[N, hidden]`` (model dtype) of the rows to sample; a view of a
            static buffer, valid until the next replay.
        """
        t, b, n = input_ids.shape[0], seq_lens.shape[0], logits_indices.shape[0]
        size = next(s for s in self.sizes if s >= t)
        s = self._num_seqs(size)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[t:size].fill_(-1)
        self.block_tables[:b, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.cu_seqlens_q[: b + 1].copy_(cu_seqlens_q, non_blocking=True)
        self.cu_seqlens_q[b + 1: s + 1].fill_(t)
        self.logits_indices[:n].copy_(logits_indices, non_blocking=True)
        self.logits_indices[n:s].zero_()
        graph = self.graphs.get(size)
        if graph is None:  # not captured (no CUDA): the same padded forward, eagerly
            return self._run(size)[:n]
        graph.replay()
        return self.hidden[size][:n]
