"""CUDA graphs for engine steps, replayed with padded inputs from static buffers.

A step of a small model is dominated by host work: Python, the guards of compiled functions and
~15 kernel launches per layer. Replaying a captured graph removes it (vLLM, nano-vllm). Inputs
live in static buffers that the graphs read; a step copies its tensors in, pads them to the next
captured size, replays, and reads the rows of its real tokens.

* :class:`DecodeGraphs`: one graph per decode batch size (one new token per sequence); padding
  rows store nothing (slot -1) and attend to one token of block 0. With a persistent decode
  path, batch 1 has shorter-context twins that run it.
* :class:`PrefillGraphs`: one graph per padded token count for every other step (prefills,
  prompt chunks, decodes mixed with chunks) -- vLLM's "full" CUDA-graph mode for mixed batches.
  This works because the attention kernels' grids depend only on tensor shapes (the padded token
  count and sequence count) and host ints fixed per graph (the decode kernel's split count, from
  the padded sequence count and max_model_len; the narrow twin graphs of few sequence slots
  give a mixed step's decode rows splits for long contexts), never on the step's lengths;
  padding tokens belong to no sequence and store nothing, padding sequences have no tokens.
  The Triton backend runs the decode rows of such a step through the decode kernel
  (``cu_seqlens_q`` mode) and the rest through the prefill kernel, both in the graph, where
  the graph has several sequence slots (a one-slot graph's prefill launch computes every row).
"""

from __future__ import annotations

import logging

import torch

from engine.attention.metadata import AttentionMetadata
from engine.worker.staging import HostStaging
from engine.worker.step_inputs import StepInputs, StepTensors
from kernels.decode_attention import MIXED_FEW_SLOTS
from kernels.prefill_split import UNSPLIT_MAX_KEYS, UNSPLIT_MIN_SLOTS

log = logging.getLogger(__name__)


def capture_graphs(sizes: list, run, graphs: dict, outputs: dict, pool=None):
    """Capture ``run(size)`` once per size, the last of ``sizes`` first (give them in ascending
    order of memory, so the largest graph is captured first and the others reuse its memory).
    A size is any key ``run`` takes (a batch size, or a ``(token count, slots, short)`` key).

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


class GraphInputs:
    """The static input buffers a set of graphs reads, filled from a step by :meth:`copy_from`
    or, for a decode step, by :meth:`stage_decode`.

    Sized for the largest captured step: ``max_tokens`` tokens and ``max_seqs`` sequences of at
    most ``max_blocks_per_seq`` blocks. Between replays the buffers may hold stale values;
    :meth:`copy_from` and :meth:`stage_decode` rewrite every entry a padded step of the given
    size reads. The int64 token buffers are the rows of one tensor (``input_ids``,
    ``positions``, ``slot_mapping``, then two rows for a decode step's tokens in flight) and
    ``seq_lens`` and ``block_tables`` two parts of one int32 tensor, so a decode step reaches
    them in one copy per dtype; each part starts on a 16-byte boundary.
    """

    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device
    ):
        width = -(-max_tokens // 2) * 2  # rows of 16-byte multiples
        self.longs = torch.zeros(5, width, dtype=torch.int64, device=device)
        self.input_ids = self.longs[0, :max_tokens]
        self.positions = self.longs[1, :max_tokens]
        self.slot_mapping = self.longs[2, :max_tokens]
        self.slot_mapping.fill_(-1)
        # a staged decode step's tokens in flight: input_ids[dst[i]] = prev_token_ids[src[i]]
        self.gather_dst, self.gather_src = self.longs[3], self.longs[4]
        self.seq_lens_room = -(-max_seqs // 4) * 4  # block_tables start 16-byte aligned
        self.max_blocks_per_seq = max_blocks_per_seq
        self.ints = torch.zeros(
            self.seq_lens_room + max_seqs * max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.seq_lens = self.ints[:max_seqs]
        self.block_tables = self.ints[self.seq_lens_room :].view(max_seqs, max_blocks_per_seq)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(max_seqs, dtype=torch.int64, device=device)

    def stage_decode(
        self,
        inp: StepInputs,
        num_seqs: int,
        staging: HostStaging,
        prev_token_ids: torch.Tensor | None = None,
    ) -> None:
        """Write a decode step's host inputs (``inp``: one token per sequence, B sequences)
        straight into the buffers, padded to ``num_seqs`` sequences as :meth:`copy_from`
        pads a decode step (padding rows store nothing and attend one token of block 0; their
        ids and positions are 0).

        Host buffers laid out like :attr:`longs` and :attr:`ints` are filled with numpy and
        copied in one host-to-device copy each (the int32 one up to row ``num_seqs`` of the
        block tables); the tokens in flight (``inp.gather_dst``/``gather_src``) are then
        read from ``prev_token_ids`` on the device. That replaces staging the step's seven
        arrays as tensors of their own and copying each into the buffers.

        Raises:
            ValueError: tokens in flight without ``prev_token_ids``.
        """
        b, m = inp.block_tables.shape
        if inp.gather_dst is not None and prev_token_ids is None:
            raise ValueError("the step has tokens in flight but no previous sampled ids")
        key_l, longs, rows = staging.host_buffer("graph.longs", self.longs.shape, torch.int64)
        rows[0, :b] = inp.input_ids
        rows[1, :b] = inp.positions
        rows[2, :b] = inp.slot_mapping
        g = 0
        if inp.gather_dst is not None:
            g = len(inp.gather_dst)
            rows[3, :g] = inp.gather_dst
            rows[4, :g] = inp.gather_src
        used = self.seq_lens_room + num_seqs * self.max_blocks_per_seq
        key_i, ints, flat = staging.host_buffer("graph.ints", self.ints.shape, torch.int32)
        flat[:b] = inp.seq_lens
        tables = flat[self.seq_lens_room : used].reshape(num_seqs, self.max_blocks_per_seq)
        tables[:b, :m] = inp.block_tables
        if num_seqs > b:  # padding rows
            rows[:2, b:num_seqs] = 0
            rows[2, b:num_seqs] = -1
            flat[b:num_seqs] = 1
            tables[b:] = 0
        staging.copy_into(key_l, longs, self.longs)
        staging.copy_into(key_i, ints[:used], self.ints[:used])
        if g:
            self.input_ids.index_copy_(
                0, self.gather_dst[:g], prev_token_ids.index_select(0, self.gather_src[:g])
            )

    def metadata(
        self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int
    ) -> AttentionMetadata:
        """Views of the buffers for a padded step of ``num_tokens`` tokens and ``num_seqs``
        sequences."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            cu_seqlens_q=self.cu_seqlens_q[: num_seqs + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            is_decode=max_query_len == 1,
        )

    def copy_from(self, step: StepTensors, num_tokens: int, num_seqs: int, decode: bool) -> None:
        """Copy a step's tensors in and pad them to ``num_tokens`` tokens and ``num_seqs``
        sequences.

        Padding tokens store nothing (slot -1). ``decode``: one token per sequence; a padding
        sequence attends to one token of block 0 (``cu_seqlens_q`` is not read, logits are
        taken for every row). Otherwise padding tokens lie past ``cu_seqlens_q[B]`` (no sequence
        attends with them), padding sequences have no tokens, padding sample rows read row 0.
        """
        t, b, n = step.num_tokens, step.num_seqs, step.logits_indices.shape[0]
        # padding is written only where there is some: an empty slice still costs a torch call
        self.input_ids[:t].copy_(step.input_ids, non_blocking=True)
        self.positions[:t].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:t].copy_(step.slot_mapping, non_blocking=True)
        if num_tokens > t:
            self.slot_mapping[t:num_tokens].fill_(-1)
        self.block_tables[:b, : step.block_tables.shape[1]].copy_(
            step.block_tables, non_blocking=True
        )
        self.seq_lens[:b].copy_(step.seq_lens, non_blocking=True)
        if decode:
            if num_seqs > b:
                self.block_tables[b:num_seqs].zero_()
                self.seq_lens[b:num_seqs].fill_(1)
            return
        self.cu_seqlens_q[: b + 1].copy_(step.cu_seqlens_q, non_blocking=True)
        if num_seqs > b:
            self.cu_seqlens_q[b + 1 : num_seqs + 1].fill_(t)
        self.logits_indices[:n].copy_(step.logits_indices, non_blocking=True)
        if num_seqs > n:
            self.logits_indices[n:num_seqs].zero_()


class DecodeGraphs:
    """Captured decode graphs of one model and KV cache.

    Args:
        model: the engine's model (its attention backend must be graph-safe: the Triton backend,
            no host syncs, scratch reused); kv_caches: its cache tensors. With
            ``compile_mode="model"`` the warm-up run of each size compiles (or reuses) the
            model's decode graph before capture, and the capture records the Inductor kernels,
            cuBLAS calls and the attention op's Triton launches; Python (guards, wrapper) runs
            only at capture, not at replay.
        max_batch: largest decode batch; max_blocks_per_seq: block-table width;
        max_seq_len: the engine's max_model_len (sizes the decode split count at capture).
        pool: a CUDA graph memory pool to share (``PrefillGraphs.pool``), or None for a new one.

    Before :meth:`capture` (and without CUDA) a run executes the same padded forward eagerly
    (the tests' CPU check of the padding and of the staged inputs).

    A model with a persistent decode path (``model.persistent_decode``, which takes one-token
    steps of one sequence up to its ``max_context``, in a layout chosen by context up to each
    of its ``context_bounds``) gets a batch-1 twin keyed ``(1, bound)`` for each bound below
    ``max_seq_len``: captured with that bound (the persistent launch of that layout) and
    replayed for batch-1 steps whose contexts fit it and no smaller bound; batch 1's own graph,
    captured with ``max_seq_len``, runs the layer loop for longer ones (or, where the model
    length is within ``max_context``, the persistent launch of the longest layout).
    """

    def __init__(
        self, model, kv_caches, max_batch: int, max_blocks_per_seq: int, max_seq_len: int, pool=None
    ):
        self.model, self.kv_caches = model, kv_caches
        dev = model.model.embed_tokens.weight.device
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.inputs = GraphInputs(n, n, max_blocks_per_seq, dev)
        self.inputs.seq_lens.fill_(1)
        self.inputs.cu_seqlens_q.copy_(torch.arange(n + 1, dtype=torch.int32, device=dev))
        #: keyed by batch size, and the batch-1 twin by ``(1, context bound)``
        self.graphs: dict[int | tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[int | tuple[int, int], torch.Tensor] = {}
        self.pool = pool  # memory pool shared with other graphs (e.g. PrefillGraphs.pool)
        bounds = getattr(getattr(model, "persistent_decode", None), "context_bounds", ())
        #: the batch-1 twins' keys ``(1, context bound)``, ascending (the persistent path's)
        self.twin_keys = [(1, b) for b in bounds if b < max_seq_len] if self.sizes[0] == 1 else []

    def _run(self, key: int | tuple[int, int]) -> torch.Tensor:
        """The padded forward of a key: a batch size (contexts up to ``max_seq_len``) or a
        twin's ``(1, context bound)``."""
        bs, max_len = key if isinstance(key, tuple) else (key, self.max_seq_len)
        meta = self.inputs.metadata(bs, bs, 1, max_len)
        hidden = self.model(
            self.inputs.input_ids[:bs], self.inputs.positions[:bs], self.kv_caches, meta
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs share its memory pool (the
        batch-1 twins last)."""
        keys = self.twin_keys + self.sizes
        self.pool = capture_graphs(keys, self._run, self.graphs, self.logits, self.pool)
        bounds = "/".join(str(k[1]) for k in self.twin_keys)
        twin = f"; batch 1 up to {bounds} tokens persistent" if bounds else ""
        log.info("captured decode CUDA graphs for batch sizes %s%s", self.sizes, twin)

    def can_run(self, batch: int, max_seq_len: int) -> bool:
        return batch <= self.sizes[-1] and max_seq_len <= self.max_seq_len

    def run_inputs(
        self,
        inp: StepInputs,
        staging: HostStaging,
        prev_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Replay the graph for a decode step of B sequences from its host inputs; returns
        logits ``[B, vocab]`` (model dtype), or None on a tensor-parallel rank other than 0 (its
        graph ends with the logits' gather, whose result only rank 0 keeps).

        The inputs are staged straight into the graphs' buffers
        (:meth:`GraphInputs.stage_decode`), the tokens in flight read from ``prev_token_ids``;
        the buffers then hold what ``copy_from(inp.to_device(staging, prev_token_ids))`` would
        have written."""
        b = len(inp.seq_lens)
        bs = self.padded_size(b)
        self.inputs.stage_decode(inp, bs, staging, prev_token_ids)
        key = bs
        if bs == 1:  # the twin of the smallest context bound the step fits, if any
            key = next((k for k in self.twin_keys if inp.max_seq_len <= k[1]), bs)
        return self._replay(key, b)

    def padded_size(self, batch: int) -> int:
        """The captured batch size a decode step of ``batch`` sequences replays."""
        return next(s for s in self.sizes if s >= batch)

    def _replay(self, key: int | tuple[int, int], b: int) -> torch.Tensor | None:
        graph = self.graphs.get(key)
        if graph is None:  # not captured (no CUDA): the same padded forward, eagerly
            logits = self._run(key)
        else:
            graph.replay()
            logits = self.logits[key]
        return None if logits is None else logits[:b]


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for prefill/mixed steps: a step of ``t`` tokens pads to at most
    ``1.25 * t + 16`` (every 16 up to 128, then steps that double at 256, 512, 1024, 2048 and
    4096), and the last size is ``max_tokens`` rounded up to a multiple of 16."""
    sizes = list(range(16, 129, 16))
    for step, stop in (
        (32, 256),
        (64, 512),
        (128, 1024),
        (256, 2048),
        (512, 4096),
        (1024, 1 << 30),
    ):
        while sizes[-1] < stop and sizes[-1] < max_tokens:
            sizes.append(sizes[-1] + step)
    top = -(-max(1, max_tokens) // 16) * 16
    return [s for s in sizes if s < top] + [top]


#: sequence slots of the narrow prefill/mixed-step graphs (see :class:`PrefillGraphs`): the
#: most whose mixed decode rows get long-context splits
NARROW_SEQS = MIXED_FEW_SLOTS


class PrefillGraphs:
    """Captured graphs of prefill and mixed steps, one per padded token count.

    A step of ``T`` tokens from ``B`` sequences replays the graph of the smallest captured size
    ``T_pad >= T``; that graph has ``S = min(max_seqs, T_pad)`` sequence slots (``B <= T``, as
    every scheduled sequence brings at least one token). Each size above :data:`NARROW_SEQS`
    slots is also captured with ``S = NARROW_SEQS``, and a step of 2 to that many sequences
    replays the narrow graph: its kernels' grids have fewer empty sequence slots, and the decode
    rows of a mixed step get a split count sized for few sequences
    (``kernels.decode_attention.choose_mixed_splits``), so a stream decoding over a long
    context next to a prompt chunk reads its keys with the whole GPU. Where ``max_seq_len``
    exceeds ``kernels.prefill_split.UNSPLIT_MAX_KEYS``, each wide size is also captured as if
    that were the model length (its "short" twin), and a wide step whose sequences all fit in
    it replays that twin: its launches size their split counts for the step's real contexts
    (no prefill split over many slots, ``kernels.prefill_split.prefill_num_splits``) instead of
    for the model length. Each size is also captured with one slot (its "lone" twin), which
    a step of one sequence replays (a lone prompt, or one chunk of it): the backend launches
    no decode kernel for the mixed decode rows a one-slot step cannot have (``num_seqs > 1``,
    ``engine.attention.triton_backend``) and the prompt launch has no empty slots; in the
    16-slot graph a lone 1,024-token prompt paid ~0.14 ms of its first-token step for the
    empty decode launches (docs/benchmarks.md, 2026-12-05, third session). Padding tokens
    ``T .. T_pad`` have slot -1 (nothing stored) and lie past ``cu_seqlens_q[B]`` (no sequence
    attends with them); padding sequences ``B .. S`` have no tokens. The graph ends with the
    final hidden states of the rows to sample (``logits_indices``, padded with row 0); the LM
    head and the sampler run after the replay on the real rows only, so the graphs hold no
    ``[S, vocab]`` logits.

    Args:
        model: the engine's model (graph-safe attention: Triton, grid from shapes only);
            kv_caches: its cache tensors.
        max_tokens: largest step to capture (the engine's token budget); max_seqs: most
            sequences in a step; max_blocks_per_seq: block-table width; max_seq_len: the
            engine's max_model_len.
        device: where the static buffers live; without CUDA nothing is captured and
            :meth:`run` executes the same padded forward eagerly (the tests' CPU check of the
            padding).
    """

    def __init__(
        self,
        model,
        kv_caches,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
    ):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_seq_len = max_seq_len
        self.inputs = GraphInputs(
            self.sizes[-1], min(max_seqs, self.sizes[-1]), max_blocks_per_seq, device
        )
        # graph keys: (padded token count, sequence slots, short). Each size has its wide
        # graph (min(max_seqs, size) slots); its lone twin (1 slot) and narrow twin
        # (NARROW_SEQS slots) where the wide graph has more; its short twin where the model
        # length exceeds UNSPLIT_MAX_KEYS and the wide graph has enough slots for the unsplit
        # rule. Listed in ascending order of memory (captured in reverse).
        # (no lone twin of a size equal to the model length: its warm-up run, outside capture,
        # would look like a whole fresh prompt and take the cuDNN path of the backend)
        wide = {t: min(max_seqs, t) for t in self.sizes}
        self.keys = [(t, 1, False) for t in self.sizes if 1 < wide[t] and t != max_seq_len]
        self.keys += [(t, NARROW_SEQS, False) for t in self.sizes if wide[t] > NARROW_SEQS]
        if max_seq_len > UNSPLIT_MAX_KEYS:
            self.keys += [(t, wide[t], True) for t in self.sizes if wide[t] > UNSPLIT_MIN_SLOTS]
        self.keys += [(t, wide[t], False) for t in self.sizes]
        self._wide = wide
        self._key_set = set(self.keys)
        self._short_sizes = {t for t, _, short in self.keys if short}
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.pool = None

    def key(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> tuple[int, int, bool]:
        """The graph of a step of ``num_tokens`` tokens from ``num_seqs`` sequences whose
        longest holds ``max_seq_len`` tokens: the smallest captured size that fits, with the
        fewest slots that hold the sequences (1, then :data:`NARROW_SEQS`), else the wide
        graph, short when the contexts fit ``UNSPLIT_MAX_KEYS``.

        Returns:
            ``(padded token count, sequence slots, short)``, a key of :attr:`graphs`.

        Raises:
            StopIteration: ``num_tokens`` above the largest size (check :meth:`can_run`).
        """
        size = next(s for s in self.sizes if s >= num_tokens)
        wide = self._wide[size]
        for slots in (1, NARROW_SEQS):
            if num_seqs <= slots < wide and (size, slots, False) in self._key_set:
                return size, slots, False
        return size, wide, size in self._short_sizes and max_seq_len <= UNSPLIT_MAX_KEYS

    def _run(self, key: tuple[int, int, bool]) -> torch.Tensor:
        size, s, short = key
        max_seq_len = UNSPLIT_MAX_KEYS if short else self.max_seq_len
        meta = self.inputs.metadata(size, s, size, max_seq_len)
        hidden = self.model(
            self.inputs.input_ids[:size], self.inputs.positions[:size], self.kv_caches, meta
        )
        return hidden[self.inputs.logits_indices[:s]]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size: the wide graphs largest first (the pool's largest), then their
        short twins, then the narrow ones, then the lone ones, each largest first, all sharing
        one memory pool.

        The static buffers hold an empty step meanwhile (no sequence has tokens, every slot is
        -1): the warm-up and captured runs store nothing and read nothing from the cache.
        """
        self.inputs.slot_mapping.fill_(-1)
        self.inputs.cu_seqlens_q.zero_()
        self.inputs.logits_indices.zero_()
        # reversed order: the wide graphs, largest first, then the short, narrow and lone ones
        self.pool = capture_graphs(self.keys, self._run, self.graphs, self.hidden, self.pool)
        log.info(
            "captured prefill/mixed-step CUDA graphs for token counts %s (also with one sequence "
            "slot, with %d slots from %s tokens, and for contexts of at most %d tokens from %s "
            "tokens)",
            self.sizes,
            NARROW_SEQS,
            min((t for t, s, _ in self.keys if s == NARROW_SEQS), default="no"),
            UNSPLIT_MAX_KEYS,
            min(self._short_sizes, default="no"),
        )

    def can_run(self, num_tokens: int, max_seq_len: int) -> bool:
        return num_tokens <= self.sizes[-1] and max_seq_len <= self.max_seq_len

    def run(self, step: StepTensors) -> torch.Tensor:
        """Run one step of ``T`` tokens from ``B`` sequences through the graph of its padded size.

        Returns:
            Final hidden states ``[N, hidden]`` (model dtype) of the rows to sample
            (``step.logits_indices``); a view of a static buffer, valid until the next replay.
        """
        n = step.logits_indices.shape[0]
        key = self.key(step.num_tokens, step.num_seqs, step.max_seq_len)
        self.inputs.copy_from(step, key[0], key[1], decode=False)
        graph = self.graphs.get(key)
        if graph is None:  # not captured (no CUDA): the same padded forward, eagerly
            return self._run(key)[:n]
        graph.replay()
        return self.hidden[key][:n]
