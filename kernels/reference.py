"""Pure-torch reference implementations of the paged-KV attention operations.

They are the engine's CPU backend and the oracle the Triton kernels are tested against.
Layouts (shared with the Triton kernels):

* KV cache of one layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, H_kv, D]``.
  Token ``i`` of a sequence lives in block ``block_table[i // block_size]`` at offset
  ``i % block_size``; its *slot* is ``block * block_size + offset``.
* Packed queries: ``q`` of shape ``[T, H_q, D]`` with the tokens of all sequences of a step
  concatenated; ``cu_seqlens_q`` (int32, ``[B + 1]``) holds their start offsets.
* ``seq_lens`` (int32, ``[B]``): the number of tokens of each sequence held in the cache once
  this step's keys/values are stored (cached prefix + new tokens). Query token ``j`` of sequence
  ``b`` sits at position ``seq_lens[b] - q_len[b] + j`` and, causally, attends to keys
  ``0 .. that position``.
* ``block_tables`` (int32, ``[B, max_blocks_per_seq]``): physical block ids; entries past a
  sequence's last block are ignored (may hold any value).

Attention is softmax(q k^T * scale) v computed in float32 and returned in the query dtype.
Grouped-query attention: query head ``h`` reads KV head ``h // (H_q // H_kv)``.
"""

from __future__ import annotations

import torch


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into their cache slots, in place.

    Args:
        key, value: ``[T, H_kv, D]``, same dtype as the caches.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``.
        slot_mapping: int64 ``[T]``; a negative slot means "do not store" (padding).
    """
    num_blocks, block_size, h_kv, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = k_cache.view(num_blocks * block_size, h_kv, d)
    v_flat = v_cache.view(num_blocks * block_size, h_kv, d)
    k_flat[slots] = key[valid]
    v_flat[slots] = value[valid]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as in Hugging Face's Qwen3/Qwen2.

    ``weight * (x / sqrt(mean(x^2) + eps))``: the statistics and the scaling in float32, the
    normalized value cast back to ``x.dtype`` *before* the product with ``weight`` (so a
    ``weight`` in the model dtype gives a result in the model dtype, rounded twice).

    Args:
        x: ``[..., D]`` any float dtype; weight: ``[D]``; eps: added to the mean square.

    Returns:
        A new tensor of ``x``'s shape in the promoted dtype of ``weight`` and ``x``.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding with the rotate-half (GPT-NeoX) layout: ``x * cos + rotate_half(x) *
    sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``.

    Args:
        q: ``[T, H_q, D]``; k: ``[T, H_kv, D]``; cos, sin: ``[T, 1, D]`` (broadcast over the
            heads), D even. Computed in the promoted dtype, each product and the sum rounded
            (eager torch arithmetic).

    Returns:
        (rotated q, rotated k), new tensors of the inputs' shapes.
    """
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_norm_rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k (Qwen3; skipped when the weights are None, Qwen2), rotary
    embedding, then k and v stored into the paged cache: :func:`rms_norm_ref` ->
    :func:`rope_ref` -> :func:`store_kv_cache_ref`, the oracle of
    ``kernels.qk_norm_rope.qk_norm_rope_store``.

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` in the cache dtype (any strides).
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``, updated in place.
        slot_mapping: int64 ``[T]``; a negative slot stores nothing.
        cos, sin: ``[T, 1, D]`` or ``[T, D]``.
        q_weight, k_weight: ``[D]`` RMSNorm weights, both or neither; eps: RMSNorm epsilon.

    Returns:
        The rotated q, a new ``[T, H_q, D]`` tensor.

    Raises:
        ValueError: only one of the two norm weights given.
    """
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = rope_ref(q, k, cos, sin)
    store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def gather_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one sequence's first ``seq_len`` keys and values, each ``[seq_len, H_kv, D]``."""
    block_size = k_cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """softmax(q k^T) v for one sequence; q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` ->
    ``[Lq, Hq, D]``.

    Queries are the last ``Lq`` positions of the ``Lk`` keys (bottom-right causal alignment).
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    if causal:
        q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        k_pos = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Varlen attention of packed queries over the paged cache (chunked prefill / prefix reuse).

    Args:
        q: ``[T, H_q, D]`` packed queries; out: ``[T, H_q, D]``, written in place and returned.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` already holding this step's keys.
        block_tables: int32 ``[B, max_blocks]``; cu_seqlens_q: int32 ``[B + 1]``;
        seq_lens: int32 ``[B]`` (cached + new tokens).
        scale: softmax scale, usually ``D ** -0.5``.
        causal: bottom-right aligned causal mask when True; all ``seq_lens[b]`` keys otherwise.
    """
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k, v = gather_kv_ref(k_cache, v_cache, block_tables[b], lens[b])
        out[s:e] = _attend(q[s:e], k, v, scale, causal)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to all ``seq_lens[b]`` cached keys.

    Args:
        q, out: ``[B, H_q, D]``; other arguments as in :func:`prefill_attention_ref`.
    """
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        k, v = gather_kv_ref(k_cache, v_cache, block_tables[b], lens[b])
        out[b : b + 1] = _attend(q[b : b + 1], k, v, scale, causal=False)
    return out


# --------------------------------------------------------------------------- sampling
_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor | int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of two uint32 values held in int64
    (split into 16-bit halves so that no intermediate overflows int64)."""
    a_t = torch.as_tensor(a, dtype=torch.int64)
    t1 = (a_t & 0xFFFF) * b
    t2 = (a_t >> 16) * b
    lo = (((t2 & 0xFFFF) << 16) + t1) & _M32
    hi = ((t2 + (t1 >> 16)) >> 16) & _M32
    return hi, lo


def philox4x32_ref(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox-4x32 (Salmon et al., SC 2011) on uint32 words held in int64 tensors (broadcast);
    the same rounds and constants as ``triton.language.philox``. Returns the four output words."""
    for _ in range(rounds):
        hi_b, lo_b = _mul32(0xCD9E8D57, c2)
        hi_a, lo_a = _mul32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def sampling_uniforms_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms of :func:`kernels.sampling.sample_tokens`: float32 ``[N, vocab]`` in
    ``[2^-24, 1 - 2^-24]``, ``u[i, j]`` a function of ``(seeds[i], offsets[i], j)`` only."""
    dev = seeds.device
    seeds = seeds.to(torch.int64)[:, None]
    offsets = offsets.to(torch.int64)[:, None]
    counters = torch.arange((vocab + 3) // 4, dtype=torch.int64, device=dev)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    words = philox4x32_ref(
        counters, offsets & _M32, (offsets >> 32) & _M32, zero, seeds & _M32, (seeds >> 32) & _M32
    )
    r = torch.stack(words, dim=-1).reshape(seeds.shape[0], -1)[
        :, :vocab
    ]  # column j: word j % 4 of j // 4
    return ((r >> 9).to(torch.float32) + 0.5) * 2.0**-23


def sample_tokens_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Pure-torch :func:`kernels.sampling.sample_tokens`: int64 ``[N]``.

    Greedy rows (``temperature <= 1e-5``) take ``argmax logits``; the others
    ``argmax(logits * (1 / T) - log(-log(u)))`` with the kernel's Philox uniforms (Gumbel-max).
    NaN scores count as -inf. Only the rows that sample compute noise.
    """
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    out = x.argmax(dim=-1)
    rand = (temperature > 1e-5).nonzero().flatten()
    if rand.numel():
        inv_t = (1.0 / temperature[rand].float())[:, None]
        u = sampling_uniforms_ref(seeds[rand], offsets[rand], x.shape[1])
        score = x[rand] * inv_t - torch.log(-torch.log(u))
        score = torch.where(torch.isnan(score), float("-inf"), score)
        out[rand] = score.argmax(dim=-1)
    return out


# --------------------------------------------------------------------------- mixture of experts
def moe_route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of :func:`kernels.fused_moe.moe_route_align`: ``softmax`` of the logits in
    float32, the ``top_k`` largest probabilities (descending), divided by their sum when
    ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``). Returns (weights float32 ``[T, k]``,
    expert ids int64 ``[T, k]``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The routed experts, one expert at a time (the loop the fused kernel replaces).

    ``out[t] = sum_j w[t, j] * W2_e (silu(Wg_e x_t) * (Wu_e x_t))`` with ``e = ids[t, j]``,
    ``Wg_e = w13[e, :I]``, ``Wu_e = w13[e, I:]``, ``W2_e = w2[e]``; computed in float32 and
    returned in ``hidden.dtype``. Shapes: hidden ``[T, H]``, w13 ``[E, 2I, H]``, w2
    ``[E, H, I]``, topk_weights/ids ``[T, k]``. Syncs with the host (``nonzero`` per expert).
    """
    t, h = hidden.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().flatten()
        tok = pairs // topk_ids.shape[1]
        gate_up = x[tok] @ w13[e].float().t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[pairs].float()[:, None])
    return out.to(hidden.dtype)


def fused_moe_ref(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """:func:`kernels.fused_moe.fused_moe` in plain torch: :func:`moe_route_ref` then
    :func:`moe_experts_ref`; ``[T, H]`` in ``hidden.dtype``."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    return moe_experts_ref(hidden, w13, w2, weights, ids)


def apply_token_bitmask_ref(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Torch reference of :func:`kernels.token_bitmask.apply_token_bitmask`: ``logits[rows[r], j]``
    becomes ``-inf`` unless bit ``j % 32`` of ``bitmask[r, j // 32]`` (int32) is set. In place;
    returns ``logits``."""
    vocab = logits.shape[1]
    cols = torch.arange(vocab, device=logits.device)
    words = bitmask.index_select(1, cols >> 5)
    allowed = ((words >> (cols & 31).to(torch.int32)) & 1).bool()
    sub = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, sub)


# ---------------------------------------------------------------------------------------------
# Block FP8 (DeepSeek-V3's fine-grained recipe): float8_e4m3fn weights with one float32 scale per
# 128 x 128 block, activations quantized per token in groups of 128 features.
# ---------------------------------------------------------------------------------------------

#: largest finite float8_e4m3fn value
FP8_MAX = 448.0
#: floor of a group's absolute maximum (an all-zero group gets a finite scale)
FP8_AMAX_EPS = 1e-10


def fp8_group_quant_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization of activations (the kernels' exact arithmetic).

    For each row and each group of ``group`` consecutive features (the last one may be short):
    ``inv = 448 / max(amax, 1e-10)``, ``q = clamp(x * inv, -448, 448)`` rounded to
    float8_e4m3fn (round to nearest even), ``s = 1 / inv``; so ``x ~= q * s``. The scale is
    written as transformers' ``Fp8Quantize`` writes weight scales (``1 / (448 / amax)``), which
    needs one division per group instead of one per element.

    Args:
        x: ``[M, K]`` float (any float dtype; upcast to float32 first).

    Returns:
        ``q`` float8_e4m3fn ``[M, K]`` and ``s`` float32 ``[M, ceil(K / group)]``.
    """
    m, k = x.shape
    kb = -(-k // group)
    xf = x.float()
    pad = torch.nn.functional.pad(xf, (0, kb * group - k)).view(m, kb, group)
    amax = pad.abs().amax(dim=2).clamp(min=FP8_AMAX_EPS)
    # tensor / tensor: IEEE division (torch's CPU ``scalar / tensor`` may differ by an ulp)
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (pad * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, kb * group)[:, :k].contiguous(), torch.ones_like(inv) / inv


def fp8_block_dequant_ref(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``w`` float8 ``[N, K]`` times its block scales ``[ceil(N / bn), ceil(K / bk)]`` -> float32
    ``[N, K]`` (partial edge blocks take their block's scale)."""
    n, k = w.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.float() * s


def fp8_block_matmul_ref(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(xq * xs) @ (w * ws)^T (+ bias)`` in float32, cast to ``out_dtype``.

    Args:
        xq: float8 ``[M, K]``, xs: float32 ``[M, ceil(K / block[1])]`` (per-token groups).
        w: float8 ``[N, K]``, ws: float32 ``[ceil(N / block[0]), ceil(K / block[1])]``.
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    k = xq.shape[1]
    x = xq.float() * xs.float().repeat_interleave(block[1], 1)[:, :k]
    out = x @ fp8_block_dequant_ref(w, ws, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """One block-FP8 linear layer as the kernels compute it: ``x [..., K]`` quantized per token
    group (:func:`fp8_group_quant_ref`), multiplied with the dequantized weight in float32, bias
    added, cast to ``x.dtype``; ``[..., N]``. The engine's FP8 path where no FP8 matmul exists
    (CPU, GPUs before sm_89)."""
    lead = x.shape[:-1]
    xq, xs = fp8_group_quant_ref(x.reshape(-1, x.shape[-1]), block[1])
    out = fp8_block_matmul_ref(xq, xs, w, ws, block, bias, x.dtype)
    return out.reshape(*lead, w.shape[0])
