"""Batch-1 decode of a dense Qwen3 model through one persistent launch for all its layers.

:mod:`kernels.persistent_decode` runs every decoder layer of one decode token in one launch
(grid barriers between the phases of a layer instead of ~7 kernel boundaries). This module is
the glue: it checks that a model can take that path, builds the kernel's pointer table over the
model's own parameters and KV caches (no copy), and runs a one-token decode step through it --
the embedding and the rotary rows before, the final RMSNorm after, as
``Qwen3ForCausalLM._forward_impl`` does. Everything else (prefill, mixed and batched decode
steps, contexts over :data:`MAX_CONTEXT`, tensor parallelism, quantized or MoE models, Qwen2's
q/k/v bias) stays on the model's own layer loop, which is also the oracle of its tests. (A
one-token prompt chunk of one sequence is a decode step by its metadata and takes this path
too, in the layout its metadata's ``max_seq_len`` picks.)

On by default on CUDA devices (``QWEN_SERVE_PERSISTENT_DECODE=0`` turns it off, ``engine/
layers/kernel_switches.py``). Inside the engine on an H100 (docs/benchmarks.md, 2026-12-06,
fifteenth session), batch-1 step against the layer loop: 0.942 against 1.122 ms at ~128 tokens
of context, 0.962 at 449-512, 1.055 against 1.177 at ~1k and 1.118 against 1.217 at ~2k. The
attention's per-head loop is faster up to :data:`ROW_SM_AFTER` tokens and its per-row softmax
(``ROW_SM``) above (at ~1k: 1.055 against 1.132 ms), so the path runs two compilations of the
kernel, chosen by the step's context; contexts over :data:`MAX_CONTEXT` run the layer loop.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch
import triton

from engine.attention.metadata import AttentionMetadata
from engine.layers.kernel_switches import PERSISTENT_FLAGS
from kernels.interpreter import interpreting
from kernels.persistent_decode import Scratch, dot_attn_fits, layer_table, persistent_layers

#: the longest context (tokens, the new one counted) a step may have to take the persistent path;
#: longer ones run the layer loop (the decode graphs capture batch-1 twins bounded at it and at
#: :data:`ROW_SM_AFTER`). Measured faster than the layer loop up to ~2k tokens on an H100
#: (docs/benchmarks.md, 2026-12-06, fifteenth session: 1.118 against 1.217 ms at 2,001-2,064
#: tokens); longer contexts were not measured (the attention items' tiles are walked one after
#: another, so the kernel's attention phase grows faster with the context than the engine's
#: split-KV decode kernel)
MAX_CONTEXT = 2048

#: contexts (tokens) up to which the kernel's attention runs its per-head loop; longer ones run
#: the per-row softmax (``ROW_SM``), unless ``row_sm`` is given to :func:`build`. H100, fifteenth
#: session: per-head 0.942 / 0.962 ms against per-row 0.975 / 0.991 at ~128 / 449-512 tokens,
#: per-row 1.055 against 1.132 at ~1k (docs/benchmarks.md)
ROW_SM_AFTER = 512

#: the kernel's layout options :func:`build` passes on (the names the environment's switches
#: use too): ``PRE_KV``, ``PRE_W`` (the first K/V tile, each GEMV's first weight chunk loaded
#: during the barrier waits), ``LATE_R`` (the RMSNorm scales applied after the dot products),
#: ``EARLY_RES`` (residual rows loaded before the K loops), ``ROW_SM`` (the attention's online
#: softmax per row of head-repeated tiles), ``DOT`` (the per-head loop of the steps without
#: ``ROW_SM`` on tensor cores), ``MERGE_C`` (the splits merged by the last split of each KV head,
#: no merge phase and its barrier); :func:`kernels.persistent_decode.persistent_layers`
LAYOUT_FLAGS = PERSISTENT_FLAGS

#: ``row_sm_after`` for a ``row_sm`` forced off: above any context
NEVER = sys.maxsize

#: the layout :func:`build` uses for flags not given (the others off; ``row_sm`` by context,
#: :data:`ROW_SM_AFTER`), each measured faster in the engine on an H100 at ~128 tokens:
#: ``PRE_KV`` and ``PRE_W`` 1.047 against 1.054-1.059 ms (docs/benchmarks.md, 2026-12-06,
#: fourteenth session), ``LATE_R`` 0.942 against 0.969 (fifteenth session, with the wide o/down
#: K chunk, :data:`BLOCK_K_H`), ``DOT`` 0.933 against 0.957-0.961 (seventeenth session, two
#: calls; it applies to the contexts without ``row_sm`` and is dropped for a shape it cannot
#: take, :func:`kernels.persistent_decode.dot_attn_fits`)
DEFAULT_FLAGS = {"pre_kv": True, "pre_w": True, "late_r": True, "dot_attn": True}

#: the widest K chunk of the o and down projections (the kernel's ``BK_H``) :func:`build` picks
#: when none is given (the widest power of two up to it dividing both widths): on an H100, 0.969
#: against 1.044 ms with ``block_k``'s 256 at ~128 tokens (fifteenth session)
BLOCK_K_H = 1024

#: the spills per thread (bytes) up to which the engine takes the path without being asked
#: (``QWEN_SERVE_PERSISTENT_DECODE`` unset): Qwen3-0.6B's probe layouts compile to 2-6 B on the
#: device's Triton 3.6; the default layout's own figure was not read (the timed engine runs
#: set the switch, which lifts the bound, so their times include whatever it spills), hence
#: room above that; the larger models spill kilobytes (offline: 1.7B 1.4 KB, 8B 78 KB)
DEFAULT_MAX_SPILL_BYTES = 256

#: K-chunk widths tried, widest first (the kernel's ``block_k`` must divide H, FF and HQ x D)
_BLOCK_KS = (256, 128, 64, 32, 16)


@dataclass
class PersistentDecode:
    """The kernel's state for one model: its pointer table ``[L, 10]`` (int64), ``dims`` =
    ``(H, HQ, HKV, D, FF)``, the caches' ``block_size``, the RMSNorm ``eps``, the scratch
    buffers, and the launch shape (``programs``: the SM count, all resident; ``block_k``;
    ``num_warps``)."""

    table: torch.Tensor
    dims: tuple[int, int, int, int, int]
    block_size: int
    eps: float
    scratch: Scratch
    programs: int
    block_k: int
    num_warps: int = 8
    #: tokens per attention tile (a power of two)
    block_t: int = 32
    #: the o and down projections' K chunk (None: ``block_k``)
    block_k_h: int | None = None
    #: the longest context it runs (:data:`MAX_CONTEXT`; a step's ``meta.max_seq_len``)
    max_context: int = MAX_CONTEXT
    #: the first layer's q/k/v weight address when the table was made (a moved weight: stale)
    first_weight: int = 0
    #: the kernel's layout options (:data:`LAYOUT_FLAGS` but ``row_sm``: bool each), passed
    #: to every launch
    flags: dict = dataclasses.field(default_factory=dict)
    #: steps whose ``meta.max_seq_len`` exceeds it launch with ``row_sm`` (0: all of them;
    #: :data:`NEVER`: none, whatever ``max_context`` becomes)
    row_sm_after: int = ROW_SM_AFTER

    @property
    def context_bounds(self) -> tuple[int, ...]:
        """The context bounds (ascending) of the launches' two layouts: a CUDA graph captured
        with ``meta.max_seq_len`` at one of them replays the right one for every step within
        it (the decode graphs' batch-1 twins)."""
        low = min(self.row_sm_after, self.max_context)
        return (self.max_context,) if low in (0, self.max_context) else (low, self.max_context)

    def row_sm_contexts(self) -> str:
        """Which contexts launch with ``row_sm``, in words (the start-up log): "never",
        "always" or "over N tokens"."""
        if self.row_sm_after >= self.max_context:
            return "never"
        return f"over {self.row_sm_after} tokens" if self.row_sm_after else "always"

    def dot_attn_contexts(self) -> str:
        """Which contexts launch with ``dot_attn`` (the per-head loop's option, so only those
        without ``row_sm``), in words (the start-up log): "never", "always" or "up to N
        tokens"."""
        if not self.flags.get("dot_attn") or self.row_sm_after == 0:
            return "never"
        return "always" if self.row_sm_after >= self.max_context else (
            f"up to {self.row_sm_after} tokens"
        )  # fmt: skip

    def layout_summary(self) -> str:
        """The launches' layouts in words (the start-up log, ``bench/engine_check.py``): which
        contexts take the per-row softmax and the tensor-core attention, and whether the last
        split of each KV head merges the splits."""
        return (
            f"attention softmax per row: {self.row_sm_contexts()}; attention on tensor cores: "
            f"{self.dot_attn_contexts()}; splits merged by the last one: "
            f"{'yes' if self.flags.get('merge_c') else 'no'}"
        )

    def launch_flags(self, max_seq_len: int) -> dict:
        """The layout options of a step whose contexts are at most ``max_seq_len`` tokens:
        :attr:`flags` with ``row_sm`` above :attr:`row_sm_after` (``dot_attn``, a per-head
        loop's option, only without it)."""
        row_sm = max_seq_len > self.row_sm_after
        dot_attn = self.flags.get("dot_attn", False) and not row_sm
        return {**self.flags, "row_sm": row_sm, "dot_attn": dot_attn}

    def launch(
        self, x, block_table, slot, seq_len, cos, sin, max_seq_len: int, check: bool,
        info: dict | None = None,
    ) -> None:  # fmt: skip
        """One :func:`kernels.persistent_decode.persistent_layers` launch over every layer on
        ``x [H]`` (bf16, in place) in the layout of a step whose contexts are at most
        ``max_seq_len`` tokens (:meth:`launch_flags`); ``block_table``, ``slot``, ``seq_len``,
        ``cos``/``sin`` and ``check``, ``info``: that function's."""
        persistent_layers(
            x, self.table, self.dims, self.block_size, block_table, slot, seq_len, cos, sin,
            self.eps, self.scratch, self.programs, self.block_k, self.block_t, self.num_warps,
            fuse_b=True, info=info, check=check, block_k_h=self.block_k_h,
            **self.launch_flags(max_seq_len),
        )  # fmt: skip

    def forward(
        self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[1, H]`` of a one-token decode step (``input_ids``, ``positions``
        int64 ``[1]``; ``meta`` with ``is_decode`` and one sequence), the token's k/v stored in
        every layer's cache at ``meta.slot_mapping[0]`` (none when negative): embedding,
        :func:`kernels.persistent_decode.persistent_layers`, final RMSNorm. The kernel's output
        is the residual stream after the last layer's add, as the layer loop's; its roundings
        are eager torch's at the same points unless ``late_r`` (float32 through the norms),
        ``row_sm`` (float32 sums in another order) or ``dot_attn`` (the attention's products on
        tensor cores, its probabilities rounded to bf16) is on -- ``late_r`` always,
        ``dot_attn`` for short contexts and ``row_sm`` for long ones are by default, so outputs
        are close to the layer loop's, not bit-equal -- and its sums run in another order on a
        GPU.

        Raises:
            RuntimeError: the model's weights moved since the table was made."""
        inner = model.model
        if inner.layers[0].self_attn.qkv_proj.weight.data_ptr() != self.first_weight:
            raise RuntimeError("the model's weights moved after its persistent-decode table")
        x = inner.embed_tokens(input_ids).reshape(-1).contiguous()
        cos, sin = inner.rotary_emb.lookup(positions, x.dtype)
        self.launch(
            x, meta.block_tables[0], meta.slot_mapping[:1], meta.seq_lens[:1], cos.reshape(-1),
            sin.reshape(-1), meta.max_seq_len, check=False,
        )  # fmt: skip
        norm = inner.norm
        return model.ops.rms_norm(x[None], norm.weight, norm.eps)


def unsupported_reason(model, kv_caches) -> str | None:
    """Why ``model`` (a ``Qwen3ForCausalLM``) with ``kv_caches`` (per layer ``(k, v)``, each
    ``[blocks, BS, HKV, D]``) cannot take the persistent decode path, or None when it can:
    one GPU of compute capability 9.0+ (or the Triton interpreter), no tensor parallelism, no
    quantization, Qwen3's q/k norms without a q/k/v bias, bf16 everywhere, power-of-two head
    counts and head size, and a K chunk dividing the hidden, intermediate and attention widths.
    (Residency is checked by :func:`build`, which compiles the kernel.)"""
    cfg = model.config
    layers = model.model.layers
    if model.tp is not None:
        return "tensor parallel"
    if getattr(cfg, "quantization", None) is not None:
        return "quantized weights"
    if not cfg.qk_norm or cfg.attention_bias:
        return "not Qwen3's attention (q/k norm, no q/k/v bias)"
    if not layers or any(not hasattr(layer, "mlp") or not hasattr(layer.mlp, "gate_up_proj")
                         for layer in layers):  # fmt: skip
        return "not a dense model"
    first = layers[0].self_attn.qkv_proj.weight
    if first.device.type == "cuda":
        if torch.cuda.get_device_capability(first.device)[0] < 9:
            return "needs compute capability 9.0+"
    elif not interpreting():
        return "needs a CUDA device (or the Triton interpreter)"
    attn = layers[0].self_attn
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if any(v & (v - 1) for v in (hq, hkv, d)):
        return "head counts and head size must be powers of two"
    if _widest(_BLOCK_KS, cfg.hidden_size, cfg.intermediate_size, hq * d) is None:
        return "no K chunk divides the hidden, intermediate and attention widths"
    for t in _layer_tensors(model, kv_caches):
        if t.dtype != torch.bfloat16:
            return "needs bf16 weights and KV caches"
    return None


def build(
    model, kv_caches, block_size: int, *, max_context: int = MAX_CONTEXT,
    block_k: int | None = None, block_t: int = 32, block_k_h: int | None = None,
    row_sm_after: int = ROW_SM_AFTER, max_spill_bytes: int | None = None, **flags: bool,
) -> PersistentDecode:  # fmt: skip
    """The kernel's state over ``model``'s parameters and ``kv_caches`` (no copies: the table
    holds their addresses, so they must not be reallocated afterwards). Call before any CUDA
    graph is captured: the table and the scratch are allocated here, and one launch per layout
    that stores nothing compiles the kernel and checks its residency. ``max_context``: the
    longest context (tokens) a step may have to take this path; ``block_k``: the kernel's K
    chunk (None: the widest of :data:`_BLOCK_KS` that fits); ``block_t``: tokens per attention
    tile (a power of two, 16 or more); ``block_k_h``: the o and down projections' K chunk (None:
    the widest power of two up to :data:`BLOCK_K_H` dividing the intermediate and attention
    widths; given: such a power of two); ``row_sm_after``: steps with longer contexts launch
    with ``ROW_SM`` (the attention's softmax per row), shorter ones without (ignored when
    ``row_sm`` is given: then every step takes that value); ``max_spill_bytes``: refuse a
    compiled kernel that spills more bytes per thread than this (None: any; the engine's
    default path passes a bound: larger models than the measured Qwen3-0.6B spill kilobytes,
    e.g. 1.4 KB for 1.7B and 78 KB for 8B offline, and would be slower); ``flags``: the
    kernel's layout options (:data:`LAYOUT_FLAGS`; :data:`DEFAULT_FLAGS` for those not given).
    The engine reads them from the environment
    (``engine.layers.kernel_switches.persistent_options``).

    Raises:
        ValueError: :func:`unsupported_reason` gives a reason, a flag not in
            :data:`LAYOUT_FLAGS`, a negative ``row_sm_after``, a ``block_t`` that is no power
            of two from 16, ``block_k``
            does not divide the hidden, intermediate and attention widths, ``block_k_h`` is no
            power of two dividing the intermediate and attention widths, a compiled layout
            spills more than ``max_spill_bytes`` (``dot_attn`` not given: also without
            ``DOT``, which is then left off), or the kernel's programs cannot all be
            resident on this GPU (:func:`kernels.grid_barrier.launch_resident`).
    """
    reason = unsupported_reason(model, kv_caches)
    if reason is not None:
        raise ValueError(f"persistent decode unavailable: {reason}")
    unknown = sorted(set(flags) - set(LAYOUT_FLAGS))
    if unknown:
        raise ValueError(f"persistent decode: unknown layout options {unknown}")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"persistent decode block_t {block_t} must be a power of two >= 16")
    cfg = model.config
    attn = model.model.layers[0].self_attn
    h, ff = cfg.hidden_size, cfg.intermediate_size
    dims = (h, attn.num_heads, attn.num_kv_heads, attn.head_dim, ff)
    if block_k is None:  # (a given one that does not divide: the launch below refuses it)
        block_k = _widest(_BLOCK_KS, h, ff, dims[1] * dims[3])
    if block_k_h is None:  # (the widths are multiples of block_k: some power of two divides)
        powers = (BLOCK_K_H >> i for i in range(BLOCK_K_H.bit_length()))
        block_k_h = _widest(powers, ff, dims[1] * dims[3])
    if "row_sm" in flags:  # one layout for every context
        row_sm_after = 0 if flags.pop("row_sm") else NEVER
    if row_sm_after < 0:
        raise ValueError(f"persistent decode row_sm_after {row_sm_after} must be >= 0")
    defaults = dict(DEFAULT_FLAGS)  # (DOT by default only where the shape takes it)
    defaults["dot_attn"] = defaults["dot_attn"] and dot_attn_fits(*dims[1:4], block_t)
    tensors = _layer_tensors(model, kv_caches)
    per = len(tensors) // len(model.model.layers)
    table = layer_table([tensors[i : i + per] for i in range(0, len(tensors), per)])
    device = table.device
    programs = torch.cuda.get_device_properties(device).multi_processor_count if (
        device.type == "cuda" and not interpreting()
    ) else 1  # fmt: skip
    splits = triton.next_power_of_2(max(1, programs // dims[2]))
    state = PersistentDecode(
        table=table,
        dims=dims,
        block_size=block_size,
        eps=cfg.rms_norm_eps,
        scratch=Scratch(dims, splits, device),
        programs=programs,
        block_k=block_k,
        block_t=block_t,
        block_k_h=block_k_h,
        num_warps=8 if device.type == "cuda" else 4,
        max_context=max_context,
        first_weight=tensors[0].data_ptr(),
        flags={k: bool(v) for k, v in {**defaults, **flags}.items()},
        row_sm_after=row_sm_after,
    )
    # one launch per layout now, storing nothing (slot -1): compiles the kernel and checks that
    # all its programs can be resident, before any request or graph capture needs it
    x = torch.zeros(dims[0], dtype=torch.bfloat16, device=device)
    rows = torch.zeros(2 * dims[3], dtype=torch.bfloat16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)

    def spills() -> int:  # the most any layout spills (bytes per thread)
        most = 0
        for bound in state.context_bounds:
            info: dict = {}
            state.launch(
                x, torch.zeros(1, dtype=torch.int32, device=device),
                torch.full((1,), -1, dtype=torch.int64, device=device), one, rows[: dims[3]],
                rows[dims[3] :], bound, check=True, info=info,
            )  # fmt: skip
            most = max(most, info.get("spills", 0))
        return most

    def too_many(spilled: int) -> bool:
        return max_spill_bytes is not None and spilled > max_spill_bytes

    most = spills()
    if too_many(most) and "dot_attn" not in flags and state.flags["dot_attn"]:
        state.flags["dot_attn"] = False  # DOT by default only: without it before giving up
        most = spills()
    if too_many(most):
        raise ValueError(
            f"persistent decode kernel spills {most} B per thread for this model (at "
            f"most {max_spill_bytes} taken by default: only the measured shapes run it)"
        )
    return state


def _widest(chunks, *widths: int) -> int | None:
    """The first of ``chunks`` (widest first) dividing every one of ``widths``, or None."""
    return next((bk for bk in chunks if all(w % bk == 0 for w in widths)), None)


def _layer_tensors(model, kv_caches) -> list[torch.Tensor]:
    """Every layer's ten tensors in :data:`kernels.persistent_decode.LAYER_TENSORS` order,
    flattened over the layers."""
    out = []
    for layer, (k_cache, v_cache) in zip(model.model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        out += [
            attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
            mlp.down_proj.weight, layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight, attn.q_norm.weight, attn.k_norm.weight,
            k_cache, v_cache,
        ]  # fmt: skip
    return out
