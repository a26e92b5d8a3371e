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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """softmax(q k^T) v for one sequence; q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` -> ``[Lq, Hq, D]``.

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
