"""Triton attention backend: the engine's backend on CUDA (see ``engine.attention.backend``).

Stores the step's keys/values with :func:`kernels.kv_cache.store_kv_cache` (or, in
``forward_qk_rope``, normalizes and rotates q/k and stores k/v in one launch of
:func:`kernels.qk_norm_rope.qk_norm_rope_store`), then runs the
split-KV paged decode kernel when every sequence has one new token. Any other step (prefill, or
a mixed step of decodes and prompt chunks) runs the decode kernel in its varlen mode on the
sequences with one new token and the varlen paged prefill kernel on the others
(``split_mixed_steps``, in steps of several sequence slots; otherwise, and in a step of one
sequence, the prefill kernel computes every row); the decode rows of a
mixed step of at most 16 sequences get the splits of a single decoding sequence within a program
cap (``kernels.decode_attention.choose_mixed_splits``), so a stream decoding over a long context
next to a prompt chunk is not read by one program per KV head. A prefill launch whose
grid would leave most SMs idle (a short prompt chunk over a long cached prefix) runs in the
kernel's split-KV mode, its split count chosen from host ints (``kernels.prefill_split``). A
step that is one whole prompt of at least ``dense_prefill_min_tokens`` tokens with nothing cached
before it runs its attention in cuDNN's fused kernel instead
(:mod:`engine.attention.dense_prefill`). Off CUDA it runs only under the Triton interpreter
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.attention.dense_prefill import dense_causal_attention, is_lone_fresh_prompt
from engine.attention.dense_prefill import warm_up as warm_up_dense
from engine.attention.metadata import AttentionMetadata
from kernels.decode_attention import (
    QKRope,
    choose_mixed_splits,
    choose_num_splits,
    decode_attention,
    decode_scratch,
)
from kernels.kv_cache import store_kv_cache
from kernels.prefill_attention import prefill_attention
from kernels.prefill_split import (
    MAX_PARTIAL_ROWS,
    prefill_num_splits,
    prefill_scratch,
    scratch_numel,
)
from kernels.qk_norm_rope import qk_norm_rope_store
from kernels.switches import env_count, env_switch

log = logging.getLogger(__name__)

#: shortest lone fresh prompt whose attention runs in cuDNN (``dense_prefill_min_tokens``)
DENSE_PREFILL_MIN_TOKENS = 16384


#: what SDPA or cuDNN says when it will not take the inputs (a refusal, not a failure)
_REFUSALS = (
    "No available kernel",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "No execution plans",
    "No valid engine",
    "not supported",
)


def _cudnn_refused(exc: RuntimeError) -> bool:
    """Whether SDPA refused the inputs under ``sdpa_kernel([CUDNN_ATTENTION])`` rather than
    failing (out of memory, a CUDA error, cuDNN's execution or allocation failures)."""
    text = str(exc)
    return (
        not isinstance(exc, torch.OutOfMemoryError)
        and "CUDA error" not in text
        and any(r in text for r in _REFUSALS)
    )


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device or TRITON_INTERPRET=1")


class TritonAttentionBackend:
    """Attention through the Triton kernels in ``kernels/``.

    The decode scratch (``partial_out``, ``partial_lse``) is allocated on first use for each
    (batch, heads, head_dim, num_splits, device) and reused by later steps and layers, so
    repeated steps allocate nothing but their outputs.

    Args:
        split_mixed_steps: in steps that are not pure decode, compute the rows of sequences with
            one new token with the split-KV decode kernel (GQA-packed, each KV block read once
            per KV head) and only the others with the prefill kernel, instead of a whole
            query tile (``BLOCK_M`` rows of one query head, or ``BLOCK_M // G`` tokens x the G
            heads of a KV head when GQA-packed) for each of them. Both launches have
            shape-only grids, so the step stays capturable in a CUDA graph. A step of one
            sequence slot has no such rows (its one prefill launch computes every row). False
            restores the single prefill launch (benchmarks).
        split_prefill: let prefill launches take the split-KV mode where
            :func:`kernels.prefill_split.prefill_num_splits` says the grid underfills the GPU
            (split count from the token count, heads and ``max_seq_len``: fixed per captured
            graph). Its scratch is one flat buffer per (device, heads, head_dim) of
            ``MAX_PARTIAL_ROWS`` rows, allocated on first use and shared by every launch. False
            keeps the single-pass launch (benchmarks, A/B runs).
        dense_prefill_min_tokens: a step that is one prompt of at least this many tokens with
            no cached prefix runs its attention through cuDNN
            (:func:`engine.attention.dense_prefill.dense_causal_attention`) on CUDA, outside
            graph capture; 0 = never. None = :data:`DENSE_PREFILL_MIN_TOKENS` unless
            ``QWEN_SERVE_DENSE_PREFILL=0``. If cuDNN refuses the inputs once, the Triton kernel
            takes every later step (logged).
        fused_decode_qk_rope: in pure decode steps, :meth:`forward_qk_rope` leaves the q/k
            norm, rotary and k/v store to the decode launch's prologue
            (``decode_attention(..., qk_rope=...)``: one launch per layer less). None = the
            ``QWEN_SERVE_DECODE_FUSED_QK_ROPE`` switch, off when unset (until the GPU measures
            it).
        max_decode_splits: most KV splits of a pure decode launch (``choose_num_splits``'
            ``max_splits``; 1: one program per (sequence, KV head) and no merge launch). None
            = ``QWEN_SERVE_DECODE_MAX_SPLITS``, 64 when unset (a benchmark knob).

    Raises:
        ValueError: ``max_decode_splits`` below 1, or a malformed environment value.
    """

    name = "triton"

    def __init__(
        self,
        split_mixed_steps: bool = True,
        split_prefill: bool = True,
        dense_prefill_min_tokens: int | None = None,
        fused_decode_qk_rope: bool | None = None,
        max_decode_splits: int | None = None,
    ) -> None:
        self.split_mixed_steps = split_mixed_steps
        if max_decode_splits is None:
            max_decode_splits = env_count("QWEN_SERVE_DECODE_MAX_SPLITS", 64)
        if max_decode_splits < 1:
            raise ValueError(f"max_decode_splits must be >= 1, got {max_decode_splits}")
        self.max_decode_splits = max_decode_splits
        if fused_decode_qk_rope is None:
            fused_decode_qk_rope = env_switch("QWEN_SERVE_DECODE_FUSED_QK_ROPE", default=False)
        self.fused_decode_qk_rope = fused_decode_qk_rope
        self.split_prefill = split_prefill
        if dense_prefill_min_tokens is None:
            dense_prefill_min_tokens = (
                DENSE_PREFILL_MIN_TOKENS if env_switch("QWEN_SERVE_DENSE_PREFILL") else 0
            )
        self.dense_prefill_min_tokens = dense_prefill_min_tokens
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefill_scratch: dict[tuple, torch.Tensor] = {}
        self._num_sms: dict[torch.device, int] = {}

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            if device.type == "cuda":
                self._num_sms[device] = torch.cuda.get_device_properties(
                    device
                ).multi_processor_count
            else:
                self._num_sms[device] = 4  # interpreter: a few splits still exercise the reduction
        return self._num_sms[device]

    def _dense_prefill(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this launch takes the cuDNN path (host checks only, no sync)."""
        t = q.shape[0]
        return (
            0 < self.dense_prefill_min_tokens <= t
            and q.device.type == "cuda"
            and is_lone_fresh_prompt(meta, t)
            and not torch.cuda.is_current_stream_capturing()
        )

    def warm_up_dense_prefill(
        self,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float,
    ) -> int:
        """Build cuDNN's plans for the lone prompts of up to ``max_tokens`` tokens that take the
        cuDNN path (:func:`engine.attention.dense_prefill.warm_up`), on the calling thread; the
        engine calls it at start-up from the thread that runs its steps.

        Returns:
            The number of padded lengths built (0 when the path is off, off CUDA, or cuDNN
            refused the shape: the path is then turned off, logged).
        """
        low = self.dense_prefill_min_tokens
        if low <= 0 or device.type != "cuda" or max_tokens < low:
            return 0
        built = self._cudnn(
            warm_up_dense, max_tokens, low, num_heads, head_dim, dtype, device, scale
        )
        return built or 0

    def _cudnn(self, fn, *args):
        """``fn(*args)`` with SDPA restricted to cuDNN; None when cuDNN refuses the inputs, which
        turns the cuDNN path off for the process (logged). Other errors (out of memory, a CUDA
        error, cuDNN's execution failures) propagate."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return fn(*args)
        except RuntimeError as exc:
            if not _cudnn_refused(exc):
                raise
            log.warning("cuDNN prompt attention unavailable, using the Triton kernel: %s", exc)
            self.dense_prefill_min_tokens = 0
            return None

    def scratch(
        self, batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
    ):
        """The cached decode scratch for this shape (allocated once)."""
        key = (batch, num_heads, head_dim, num_splits, device)
        buf = self._scratch.get(key)
        if buf is None:
            buf = decode_scratch(batch, num_heads, head_dim, num_splits, device)
            self._scratch[key] = buf
        return buf

    def prefill_splits(
        self,
        q: torch.Tensor,
        meta: AttentionMetadata,
        num_kv_heads: int | None = None,
        page_size: int | None = None,
    ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """``(num_splits, partial_out, partial_lse)`` of this step's prefill launch: 1 and no
        scratch unless the split-KV mode is on and chosen (host ints only, no sync).
        ``num_kv_heads`` lets the split model count a GQA-packed launch's programs, ``page_size``
        (the cache's tokens per block) picks the tiles the launch will use."""
        if not self.split_prefill:
            return 1, None, None
        t, num_heads, head_dim = q.shape
        splits = prefill_num_splits(
            t,
            num_heads,
            head_dim,
            q.dtype,
            q.device,
            meta.max_seq_len,
            self._sm_count(q.device),
            num_seqs=meta.block_tables.shape[0],
            num_kv_heads=num_kv_heads,
            page_size=page_size,
        )
        if splits == 1:
            return 1, None, None
        key = (q.device, num_heads, head_dim)
        buf = self._prefill_scratch.get(key)
        if buf is None:
            numel = scratch_numel(MAX_PARTIAL_ROWS, num_heads, head_dim)
            buf = torch.empty(numel, dtype=torch.float32, device=q.device)
            self._prefill_scratch[key] = buf
        po, plse = prefill_scratch(buf, splits, t, num_heads, head_dim)
        return splits, po, plse

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's k/v, then attend; shapes as in ``AttentionBackend.forward``.

        Returns:
            ``[T, H_q, D]`` in ``q.dtype``.

        Raises:
            ValueError: on a non-CUDA device without ``TRITON_INTERPRET=1``.
        """
        _check_device(q)
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_stored(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention over caches that already hold this step's keys and values, for a ``q``
        already normalized and rotated: what :meth:`forward_qk_rope` does after its q/k norm +
        rotary + store launch, when the q/k/v projection did that work in its epilogue
        (``kernels.gemv_qk_rope``). ``q``: ``[T, H_q, D]``, any strides (a view of the
        projection output).

        Returns:
            ``[T, H_q, D]`` in ``q.dtype``.

        Raises:
            ValueError: on a non-CUDA device without ``TRITON_INTERPRET=1``; what the kernels
                raise.
        """
        _check_device(q)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """q/k RMSNorm, rotary and the k/v store in one launch
        (:func:`kernels.qk_norm_rope.qk_norm_rope_store`), then attention as :meth:`forward`;
        shapes as in ``AttentionBackend.forward_qk_rope``.

        Returns:
            ``[T, H_q, D]`` in ``q.dtype``.

        Raises:
            ValueError: on a non-CUDA device without ``TRITON_INTERPRET=1``; what the kernel
                raises (shapes, dtypes).
        """
        _check_device(q)
        decode = self._pure_decode(q, meta)
        q, rope = self._qk_rope(
            decode, q, k, v, k_cache, v_cache, meta, cos, sin, q_weight, k_weight, eps
        )
        if rope is not None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q is a strided view
            return self._decode(q, k_cache, v_cache, meta, scale, out, rope)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _qk_rope(self, decode: bool, q, k, v, k_cache, v_cache, meta, cos, sin, q_w, k_w, eps):
        """``(q, None)`` with q/k normalized and rotated and k/v stored
        (:func:`qk_norm_rope_store`), or, in a pure decode step (``decode``) with
        ``fused_decode_qk_rope``, ``(q, QKRope)``: the raw q and the work left to the decode
        launch's prologue."""
        if self.fused_decode_qk_rope and decode:
            return q, QKRope(k, v, meta.slot_mapping, cos, sin, q_w, k_w, eps)
        q = qk_norm_rope_store(
            q, k, v, k_cache, v_cache, meta.slot_mapping, cos, sin, q_w, k_w, eps
        )
        return q, None

    def partial_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """The split count of :meth:`decode_partials_qk_rope` for ``num_seqs`` decoding
        sequences: the count that fills the GPU (:func:`choose_num_splits` for a context too
        long to cap it), a host int fixed by the batch size and the device alone, so a traced
        graph's partials have a constant shape (a short context leaves the later splits empty,
        as a CUDA graph captured at the model length does)."""
        return choose_num_splits(
            num_seqs, num_kv_heads, 1 << 30, self._sm_count(device),
            max_splits=self.max_decode_splits,
        )  # fmt: skip

    def decode_partials_qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        num_splits: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_qk_rope` of a pure decode step up to the split-KV partials: q/k norm,
        rotary and the k/v store as there, then the decode kernel's splits without their merge
        (``decode_attention(..., merge=False)``); the caller merges them, fused into the output
        projection (:func:`kernels.gemv_merge.gemv_attn_merge`).

        Args:
            q, k, v, k_cache, v_cache, meta, scale, cos, sin, q_weight, k_weight, eps: as in
                :meth:`forward_qk_rope`.
            num_splits: host int >= 1 (:meth:`partial_splits`).

        Returns:
            New float32 tensors ``(partial_out [T, H_q, num_splits, D], partial_lse [T, H_q,
            num_splits])`` (log2-domain log-sum-exps, ``-inf`` for an empty split).

        Raises:
            ValueError: not a pure decode step (one new token per sequence), a non-CUDA device
                without ``TRITON_INTERPRET=1``, or what the kernels raise.
        """
        _check_device(q)
        if not self._pure_decode(q, meta):
            raise ValueError("decode_partials_qk_rope needs a pure decode step")
        t, num_heads, head_dim = q.shape
        po, plse = decode_scratch(t, num_heads, head_dim, num_splits, q.device)
        q, rope = self._qk_rope(
            True, q, k, v, k_cache, v_cache, meta, cos, sin, q_weight, k_weight, eps
        )
        decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            None,
            scale,
            po,
            plse,
            num_splits,
            qk_rope=rope,
            merge=False,
        )
        return po, plse

    @staticmethod
    def _pure_decode(q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """One new token per sequence (the decode launch alone computes the step)."""
        return meta.is_decode and q.shape[0] == meta.block_tables.shape[0]

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        qk_rope: QKRope | None = None,
    ) -> torch.Tensor:
        """The split-KV decode launch: every row of a pure decode step, or (a mixed step) the
        rows of sequences with one new token."""
        num_seqs = meta.block_tables.shape[0]
        decode = self._pure_decode(q, meta)
        _, num_heads, head_dim = q.shape
        args = (num_seqs, k_cache.shape[2], meta.max_seq_len, self._sm_count(q.device))
        if decode:
            splits, min_keys = choose_num_splits(*args, max_splits=self.max_decode_splits), 0
        else:
            splits, min_keys = choose_mixed_splits(*args)
        po, plse = self.scratch(num_seqs, num_heads, head_dim, splits, q.device)
        return decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            out,
            scale,
            po,
            plse,
            splits,
            cu_seqlens_q=None if decode else meta.cu_seqlens_q,
            min_split_keys=min_keys,
            qk_rope=qk_rope,
        )

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``q`` over the caches (this step's k/v already stored)."""
        out = torch.empty_like(q)
        if self._dense_prefill(q, meta):
            done = self._cudnn(
                dense_causal_attention, q, k_cache, v_cache, meta.block_tables[0], out, scale
            )
            if done is not None:
                return done
        decode = self._pure_decode(q, meta)
        # a mixed step's decode rows go to the decode kernel only where the step has several
        # sequence slots: one sequence of several tokens (a lone prompt or chunk, the lone
        # prefill graphs) has none, and its launch would be all empty programs
        mixed_decode = self.split_mixed_steps and meta.block_tables.shape[0] > 1
        if decode or mixed_decode:
            # pure decode: one row per sequence; mixed step: the rows of sequences with one new
            # token (row cu_seqlens_q[b]), the others left to the prefill launch below
            self._decode(q, k_cache, v_cache, meta, scale, out)
            if decode:
                return out
        splits, po, plse = self.prefill_splits(q, meta, k_cache.shape[2], k_cache.shape[1])
        return prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            out,
            scale,
            causal=True,
            skip_decode_rows=mixed_decode,
            num_splits=splits,
            partial_out=po,
            partial_lse=plse,
        )
