"""One step's inputs: flat host arrays built from a scheduled batch, then device tensors.

:func:`prepare_inputs` flattens a :class:`~engine.core.scheduler.ScheduledBatch` into numpy
arrays (vectorised; kernels never see ``Request`` objects); :meth:`StepInputs.to_device`
moves them in two copies (the int64 arrays together, the int32 arrays together) through the
worker's :class:`~engine.worker.staging.HostStaging` into one :class:`StepTensors`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.core.request import Request
from engine.core.scheduler import ScheduledBatch
from engine.worker.block_table import PersistentBlockTables
from engine.worker.staging import HostStaging


@dataclass
class StepTensors:
    """One step's inputs on the device.

    Attributes:
        input_ids, positions, slot_mapping: int64 ``[T]`` (slot -1: store nothing).
        block_tables: int32 ``[B, M]``; seq_lens: int32 ``[B]``; cu_seqlens_q: int32 ``[B + 1]``.
        logits_indices: int64 ``[N]`` rows of the packed hidden states to sample from.
        max_query_len, max_seq_len: host upper bounds (see :class:`AttentionMetadata`).
        prompt_rows, prompt_targets: int64 ``[R]`` rows of the packed hidden states whose next
            prompt token is scored, and that token; None when no request of the step scores its
            prompt (see :class:`StepInputs`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def attention_metadata(self) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` (views of these tensors)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu_seqlens_q,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            is_decode=self.max_query_len == 1,
        )


@dataclass
class StepInputs:
    """Host-side arrays of one step before they move to the device.

    ``input_ids``/``positions``/``slot_mapping``: int64 ``[T]``; ``block_tables``: int32
    ``[B, M]``; ``seq_lens``: int32 ``[B]``; ``cu_seqlens_q``: int32 ``[B + 1]``;
    ``logits_indices``: int64 rows of the packed hidden states to sample from (one per request
    that completes its tokens this step), ``sample_requests``: those requests.
    ``gather_dst``/``gather_src``: int64 input tokens still in flight (async scheduling):
    ``input_ids[gather_dst[i]]`` is the previous step's sampled id in row ``gather_src[i]``; the
    host holds a 0 there until the device fills it in. ``table_rows``: int64 ``[B]``, each
    sequence's row in the block-table mirror (what rank 0 of a tensor-parallel engine sends).
    ``prompt_rows``/``prompt_targets``: int64 ``[R]``, for requests that score their prompt
    (``Request.scores_prompt``): the packed row of each prompt position ``j`` of the step with
    ``j + 1 < num_prompt_tokens`` and the prompt token ``j + 1`` it predicts; ``prompt_segments``
    gives, per such request in row order, ``(request id, first position j, number of rows, top
    alternatives k)``. None / empty when no request scores (the common case: nothing extra).
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
    table_rows: np.ndarray | None = None
    prompt_rows: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    prompt_segments: list[tuple[str, int, int, int]] | None = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, and every sequence samples (a 1-token prefill chunk does
        not)."""
        return self.max_query_len == 1 and len(self.logits_indices) == len(self.seq_lens)

    def to_device(
        self, staging: HostStaging, prev_token_ids: torch.Tensor | None = None
    ) -> StepTensors:
        """The step's tensors on the staging device, in two queued copies (no host sync).

        Args:
            prev_token_ids: int64 ``[N_prev]`` sampled ids of the step in flight, read on the
                device for the tokens in ``gather_dst``.

        Raises:
            ValueError: tokens in flight without ``prev_token_ids``.
        """
        longs = [self.input_ids, self.positions, self.slot_mapping, self.logits_indices]
        if self.gather_dst is not None:
            if prev_token_ids is None:
                raise ValueError("the step has tokens in flight but no previous sampled ids")
            longs += [self.gather_dst, self.gather_src]
        if self.prompt_rows is not None:
            longs += [self.prompt_rows, self.prompt_targets]
        dev = staging.stage_many("int64", longs)
        block_tables, seq_lens, cu = staging.stage_many(
            "int32", [self.block_tables, self.seq_lens, self.cu_seqlens_q]
        )
        input_ids = dev[0]
        if self.gather_dst is not None:
            input_ids.index_copy_(0, dev[4], prev_token_ids.index_select(0, dev[5]))
        step = StepTensors(
            input_ids,
            dev[1],
            dev[2],
            block_tables,
            seq_lens,
            cu,
            dev[3],
            self.max_query_len,
            self.max_seq_len,
        )
        if self.prompt_rows is not None:
            step.prompt_rows, step.prompt_targets = dev[-2], dev[-1]
        return step


def prepare_inputs(
    batch: ScheduledBatch,
    block_size: int,
    block_tables: PersistentBlockTables,
    prev_rows: dict[str, int] | None = None,
) -> StepInputs:
    """Flatten a scheduled batch into the step's index arrays (host side, numpy).

    Args:
        block_tables: the runner's persistent block-table mirror (the batch's changes are applied).
        prev_rows: request id -> sample row of the step still in flight; a request with an
            output placeholder takes its input token from that row on the device.

    Raises:
        RuntimeError: a request has a token in flight but no row in ``prev_rows``.
    """
    reqs = batch.requests
    rows = block_tables.apply(batch)
    b = len(reqs)
    q_lens = np.fromiter(batch.num_new_tokens, dtype=np.int32, count=b)
    starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=b)
    seq_lens = starts + q_lens
    cu = np.zeros(b + 1, dtype=np.int32)
    q_lens.cumsum(out=cu[1:])
    prev_rows = prev_rows or {}
    gather_dst, gather_src = [], []
    ids: list[int] = []
    logits_indices, sample_requests = [], []
    prompt_rows: list[np.ndarray] = []
    prompt_targets: list[int] = []
    prompt_segments: list[tuple[str, int, int, int]] = []
    for req, n in zip(reqs, batch.num_new_tokens):
        start = req.num_computed_tokens
        num_tokens = req.num_tokens
        in_flight = req.num_output_placeholders
        if in_flight:
            # decode of a token sampled by the step in flight: filled in on the device
            row = prev_rows.get(req.request_id)
            if row is None or n != 1 or start != num_tokens:
                raise RuntimeError(
                    f"request {req.request_id} has a token in flight but no sample row"
                )
            gather_dst.append(len(ids))
            gather_src.append(row)
            ids.append(0)
        elif n == 1:
            ids.append(req.token_at(start))
        else:
            ids.extend(req.token_slice(start, start + n))
        if req.sampling_params.prompt_logprobs is not None and req.scores_prompt:
            # positions start .. end-1 predict prompt tokens start+1 .. end (the last prompt
            # position predicts the first output token: that row is sampled, not scored)
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > start:
                first = len(ids) - n
                prompt_rows.append(np.arange(first, first + end - start, dtype=np.int64))
                prompt_targets.extend(req.prompt_token_ids[start + 1 : end + 1])
                prompt_segments.append(
                    (req.request_id, start, end - start, req.sampling_params.prompt_logprobs)
                )
        if start + n == num_tokens + in_flight:  # all its tokens computed: sample
            logits_indices.append(len(ids) - 1)
            sample_requests.append(req)
    max_seq_len = int(seq_lens.max()) if b else 0
    tables = block_tables.gather(rows, max(1, -(-max_seq_len // block_size)))
    total = len(ids)
    decode = total == b
    if decode:  # one token per sequence (decodes): token i is sequence i's, at its start
        seq_of_token = np.arange(b)
        positions = starts.astype(np.int64)
    else:
        seq_of_token = np.repeat(np.arange(b), q_lens)
        positions = (
            np.arange(total, dtype=np.int64)
            - np.repeat(cu[:-1], q_lens)
            + np.repeat(starts, q_lens)
        ).astype(np.int64)
    block_index, offset = np.divmod(positions, block_size)
    slot_mapping = tables[seq_of_token, block_index].astype(np.int64) * block_size + offset
    return StepInputs(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        sample_requests=sample_requests,
        max_query_len=(1 if decode else int(q_lens.max())) if b else 0,
        max_seq_len=max_seq_len,
        gather_dst=np.asarray(gather_dst, dtype=np.int64) if gather_dst else None,
        gather_src=np.asarray(gather_src, dtype=np.int64) if gather_src else None,
        table_rows=rows,
        prompt_rows=np.concatenate(prompt_rows) if prompt_rows else None,
        prompt_targets=np.asarray(prompt_targets, dtype=np.int64) if prompt_targets else None,
        prompt_segments=prompt_segments or None,
    )
