"""A decoder's elementwise op and the linear layer after it, as one small-M kernel where that is
measured to win (:mod:`kernels.gemv_fused`), else the two as before.

* :func:`norm_linear`: residual add + RMSNorm, then a column-parallel projection (q/k/v after
  ``input_layernorm``, gate/up after ``post_attention_layernorm``);
* :func:`swiglu_linear`: SwiGLU, then the down projection;
* :func:`merge_linear`: split-KV decode attention's merge of its partials, then the output
  projection (:func:`merge_tiles` says whether to ask the attention layer for partials);
* :func:`norm_qkv_rope`: residual add + RMSNorm, the q/k/v projection, then Qwen3's q/k
  RMSNorm, the rotary embedding and the KV-cache store (:func:`qkv_rope_tiles` says whether;
  the attention layer then attends over the stored cache).

Each takes a ``mode``: None ("auto", the model's default) fuses exactly where today's dispatch
(:mod:`engine.layers.dense_linear`) would run the small-M GEMV -- bf16/fp16 on CUDA, at most
``GEMV_MAX_M`` rows, the switches of :mod:`engine.layers.kernel_switches` on -- and the
device's fused table has an entry that won (``kernels.gemv_fused.fused_gemv_config``); True
fuses wherever the kernel takes the operands, the Triton interpreter on the CPU included, with
the table's tiles or the default ones (tests, A/B runs); False never fuses. Unquantized layers
only (an FP8 layer keeps its own product).

Inside a compiled (``torch.compile``) forward the choice is made while tracing, from the static
row count: the batch-1 graph (T == 1 is specialised, see ``engine.models.compile``) gets the
fused custom op (``qwen_serve::gemv_rms_norm`` / ``gemv_swiglu`` / ``gemv_attn_merge`` /
``gemv_rms_norm_qk_rope``, opaque to
Inductor, CUDA-graph capturable), and a graph whose row count is symbolic (every T >= 2, prefill
included) keeps the unfused ops, which Inductor compiles as before -- a runtime choice there
would have to run the unfused norm eagerly inside the op for large T.
"""

from __future__ import annotations

import torch

from engine.layers import kernel_switches
from engine.layers.dense_linear import GEMV_DTYPES

#: at most this many rows are fused (``kernels.gemv.GEMV_MAX_M``; not imported from there: a CPU
#: server imports no Triton)
_MAX_M = 16


def _tiles(kind: str, mode: bool | None, x: torch.Tensor, layer, switch: bool):
    """The fused kernel's tiles ``[block_n, block_k, split_k, num_warps, num_stages]``, or None
    to keep the unfused ops (see the module docstring). ``x``: the product's ``[M, K]`` input as
    the kernel sees it (gate_up's gate half for SwiGLU). Traceable by Dynamo without a guard
    on a symbolic row count (``statically_known_true``: False unless the count is static)."""
    if mode is False or getattr(layer, "quant_method", None) is not None or x.dim() != 2:
        return None
    if mode is None and (x.device.type != "cuda" or x.dtype not in GEMV_DTYPES):
        return None
    # imported here: the module imports torch._dynamo, and with it Triton (a CPU server has none)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(x.shape[0] <= _MAX_M):
        return None
    w, b = layer.weight, layer.bias
    if (
        w.dim() != 2
        or w.stride(1) != 1
        or w.dtype != x.dtype
        or w.device != x.device
        or (b is not None and (b.dim() != 1 or b.stride(0) != 1 or b.dtype != x.dtype))
    ):
        return None
    bucket = 1 if statically_known_true(x.shape[0] == 1) else _MAX_M
    from engine.layers.fused_tiles import table_tiles  # imports torch._dynamo (and Triton)

    tiles = table_tiles(kind, mode, switch, bucket, w.shape[0], w.shape[1], str(x.device))
    return None if tiles is None else list(tiles)


def _config(tiles: list[int]):
    from kernels.gemv import GemvConfig

    return GemvConfig(*tiles)


@torch.library.custom_op("qwen_serve::gemv_rms_norm", mutates_args=())
def gemv_rms_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.gemv_fused.gemv_rms_norm` with ``tiles`` (a GemvConfig's fields):
    ``(y [M, N], new residual [M, K])`` (an empty ``[0, K]`` when ``residual`` is None; the
    caller keeps ``x``)."""
    from kernels.gemv_fused import gemv_rms_norm

    y, res = gemv_rms_norm(x, norm_weight, eps, weight, bias, residual, _config(tiles))
    return y, res if res is not None else x.new_empty((0, x.shape[1]))


@gemv_rms_norm_op.register_fake
def _gemv_rms_norm_fake(x, residual, norm_weight, eps, weight, bias, *rest):
    """The fake of the norm GEMVs' ops (``gemv_rms_norm``, ``gemv_rms_norm_qk_rope``): ``y [M,
    N]`` and the new residual (``[0, K]`` without one)."""
    rows = x.shape[0] if residual is not None else 0
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((rows, x.shape[1]))


@torch.library.custom_op("qwen_serve::gemv_swiglu", mutates_args=())
def gemv_swiglu_op(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: list[int]
) -> torch.Tensor:
    """:func:`kernels.gemv_fused.gemv_swiglu` with ``tiles``: ``[M, N]``."""
    from kernels.gemv_fused import gemv_swiglu

    return gemv_swiglu(gate_up, weight, bias, _config(tiles))


@gemv_swiglu_op.register_fake
def _gemv_swiglu_fake(gate_up, weight, bias, tiles):
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))


def norm_linear(x, residual, norm, linear, ops, mode: bool | None = None):
    """``linear(rms_norm(x + residual))`` and the new residual ``x + residual``.

    Args:
        x: ``[T, H]`` the previous sublayer's output in the model dtype.
        residual: ``[T, H]`` residual stream, or None (the first layer: the norm of ``x``, and
            ``x`` becomes the residual).
        norm: an ``engine.layers.norm.RMSNorm`` (``weight [H]``, ``eps``).
        linear: the unsplit-input linear layer after it (``LinearBase``: weight ``[N, H]``).
        ops: the model's ``PointwiseOps`` (the unfused path's norm, compiled or not).
        mode: None (auto), True (fuse wherever the kernel runs) or False (see the module
            docstring).

    Returns:
        ``(y [T, N], residual [T, H])`` in the model dtype.
    """
    tiles = None
    if norm.weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype):
        tiles = _tiles("rms_norm", mode, x, linear, kernel_switches.FUSED_NORM_GEMV)
    if tiles is None:
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return linear(h), residual
    args = (x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    if torch.compiler.is_compiling():
        y, new_res = gemv_rms_norm_op(*args, tiles)
    else:
        from kernels.gemv_fused import gemv_rms_norm

        w, b = linear.weight, linear.bias
        y, new_res = gemv_rms_norm(x, norm.weight, norm.eps, w, b, residual, _config(tiles))
    return y, (x if residual is None else new_res)


def swiglu_linear(gate_up, linear, ops, mode: bool | None = None):
    """``linear(silu_and_mul(gate_up))``: ``gate_up`` ``[T, 2I]`` (a rank's gate then up
    features) -> ``[T, N]``; ``linear`` the down projection (weight ``[N, I]``), ``ops`` the
    model's ``PointwiseOps``, ``mode`` as in :func:`norm_linear`."""
    k = gate_up.shape[-1] // 2
    tiles = None
    if gate_up.dim() == 2:
        tiles = _tiles("swiglu", mode, gate_up[:, :k], linear, kernel_switches.FUSED_SWIGLU_GEMV)
    if tiles is None:
        return linear(ops.silu_and_mul(gate_up))
    if torch.compiler.is_compiling():
        return gemv_swiglu_op(gate_up, linear.weight, linear.bias, tiles)
    from kernels.gemv_fused import gemv_swiglu

    return gemv_swiglu(gate_up, linear.weight, linear.bias, _config(tiles))


@torch.library.custom_op("qwen_serve::gemv_attn_merge", mutates_args=())
def gemv_attn_merge_op(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: list[int],
) -> torch.Tensor:
    """:func:`kernels.gemv_merge.gemv_attn_merge` with ``tiles``: ``[T, N]``."""
    from kernels.gemv_merge import gemv_attn_merge

    return gemv_attn_merge(partial_out, partial_lse, weight, bias, _config(tiles))


@gemv_attn_merge_op.register_fake
def _gemv_attn_merge_fake(partial_out, partial_lse, weight, bias, tiles):
    return weight.new_empty((partial_out.shape[0], weight.shape[0]))


def merge_tiles(q_rows: torch.Tensor, linear, mode: bool | None = None) -> list[int] | None:
    """The tiles of the merge-fused output projection, or None to attend and project as
    before (see the module docstring for ``mode``). ``q_rows``: ``[T, H_q * D]``, a stand-in
    with the attention output's rows, features, dtype and device (a view of the q projection:
    nothing is read); ``linear``: the o projection (weight ``[N, H_q * D]``). The caller
    checks the rest (a pure decode step, a backend with partials)."""
    return _tiles("attn_merge", mode, q_rows, linear, kernel_switches.FUSED_MERGE_GEMV)


def merge_linear(partial_out, partial_lse, linear, tiles: list[int]) -> torch.Tensor:
    """``linear(merge(partials))``: the split-KV partials (float32 ``[T, H_q, S, D]`` and
    ``[T, H_q, S]``, from ``PagedAttention.decode_partials_qk_rope``) merged inside the o
    projection's small-M kernel with ``tiles`` (:func:`merge_tiles`) -> ``[T, N]`` in the
    weight's dtype."""
    if torch.compiler.is_compiling():
        return gemv_attn_merge_op(partial_out, partial_lse, linear.weight, linear.bias, tiles)
    from kernels.gemv_merge import gemv_attn_merge

    return gemv_attn_merge(partial_out, partial_lse, linear.weight, linear.bias, _config(tiles))


@torch.library.custom_op("qwen_serve::gemv_rms_norm_qk_rope", mutates_args=("k_cache", "v_cache"))
def gemv_rms_norm_qk_rope_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    qk_eps: float,
    tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.gemv_qk_rope.gemv_rms_norm_qk_rope` with ``tiles``: ``(qkv [M, N] with q
    and k normalized and rotated, new residual [M, K])`` (an empty ``[0, K]`` when ``residual``
    is None); the caches are updated in place (declared mutated, so Inductor orders the
    attention op that reads them after this one)."""
    y, res = _qkv_rope(
        x, residual, norm_weight, eps, weight, bias, num_q_heads, num_kv_heads, k_cache, v_cache,
        slot_mapping, cos, sin, q_weight, k_weight, qk_eps, tiles,
    )  # fmt: skip
    return y, res if res is not None else x.new_empty((0, x.shape[1]))


def _qkv_rope(x, residual, norm_weight, eps, weight, bias, *rest):
    """The kernel call behind the custom op and the eager path: the op's arguments, ``rest``
    ending with the tiles."""
    from kernels.gemv_qk_rope import gemv_rms_norm_qk_rope

    *rope_args, tiles = rest
    return gemv_rms_norm_qk_rope(
        x, norm_weight, eps, weight, bias, residual, *rope_args, _config(tiles)
    )


gemv_rms_norm_qk_rope_op.register_fake(_gemv_rms_norm_fake)


def qkv_rope_tiles(x, residual, norm, linear, head_dim: int, mode=None, norm_mode=None):
    """The tiles of :func:`norm_qkv_rope` (N tiles of one head: ``block_n == head_dim``), or
    None to keep :func:`norm_linear` and the separate q/k norm + rotary + store launch
    (``mode`` as in :func:`norm_linear`; ``QWEN_SERVE_FUSED_QKV_ROPE_GEMV=0`` off). The norm
    runs in this kernel's prologue, so ``norm_mode`` (the norm fusion's mode) False, or in
    auto mode ``QWEN_SERVE_FUSED_NORM_GEMV=0``, keeps it unfused too. A table entry whose tiles
    are not one head wide is not used; a forced fusion (``mode`` True) gets the default tiles
    one head wide."""
    if norm_mode is False or norm.weight.dtype != x.dtype:
        return None
    if residual is not None and residual.dtype != x.dtype:
        return None
    if head_dim % 16 or head_dim & (head_dim - 1):  # the kernel's N tile: a power of two >= 16
        return None
    switch = kernel_switches.FUSED_QKV_ROPE_GEMV and kernel_switches.FUSED_NORM_GEMV
    tiles = _tiles("qkv_rope", mode, x, linear, switch)
    if tiles is None or tiles[0] == head_dim:
        return tiles
    return None if mode is None else [head_dim, *tiles[1:]]


def norm_qkv_rope(x, residual, norm, linear, tiles: list[int], heads: tuple[int, int], kv_cache,
                  slot_mapping, rope, q_norm, k_norm):  # fmt: skip
    """The input norm, q/k/v projection, q/k norm + rotary and the KV-cache store of a decoder
    layer in one small-M launch (:mod:`kernels.gemv_qk_rope`).

    Args:
        x, residual, norm, linear: as in :func:`norm_linear` (``linear`` the q/k/v projection,
            weight ``[(Hq + 2 Hkv) D, H]``).
        tiles: from :func:`qkv_rope_tiles`.
        heads: ``(Hq, Hkv)`` of this rank.
        kv_cache: this layer's ``(k_cache, v_cache)``, ``[num_blocks, block_size, Hkv, D]``,
            updated in place at ``slot_mapping`` (int64 ``[T]``, negative: not stored).
        rope: ``(cos, sin)`` ``[T, 1, D]`` rows of the tokens' positions.
        q_norm, k_norm: the per-head ``RMSNorm`` modules (Qwen3), or both None (Qwen2).

    Returns:
        ``(qkv [T, (Hq + 2 Hkv) D], residual [T, H])``: q and k normalized and rotated, v as
        projected, in the model dtype.
    """
    cos, sin = rope
    q_w = None if q_norm is None else q_norm.weight
    k_w = None if k_norm is None else k_norm.weight
    qk_eps = 0.0 if q_norm is None else q_norm.eps
    args = (x, residual, norm.weight, norm.eps, linear.weight, linear.bias, *heads, *kv_cache,
            slot_mapping, cos, sin, q_w, k_w, qk_eps, tiles)  # fmt: skip
    call = gemv_rms_norm_qk_rope_op if torch.compiler.is_compiling() else _qkv_rope
    y, new_res = call(*args)
    return y, (x if residual is None else new_res)
