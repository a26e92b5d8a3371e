"""How long a whole-prompt step may be (``EngineConfig.lone_prompt_min_tokens``).

A long prompt on an idle engine prefilled in one step instead of 1,024-token chunks runs its
GEMMs at full size and, from 16k tokens, takes cuDNN's fused attention
(:mod:`engine.attention.dense_prefill`): on the H200 a 32,000-token prompt of Qwen3-0.6B reached
its first token in 305 ms in one step against 328 ms in 33 chunks with the Triton kernel, 280 ms
with cuDNN (docs/benchmarks.md, 2026-12-04, second session). Such a step never delays a decoding
stream: the scheduler takes it only when nothing runs. Its activations must fit in the memory
the runner leaves outside the KV cache, which bounds its length.

Pure arithmetic on the model's shape, no torch.
"""

from __future__ import annotations

from engine.core.config import ModelConfig

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "STEP_RESERVE_BYTES",
    "activation_bytes_per_token",
    "max_step_tokens",
]

#: bytes the runner leaves below the memory-utilization line for the CUDA graphs' pools and a
#: step's activations (``ModelRunner._num_kv_blocks``) where whole-prompt steps can run: 3 GiB,
#: so that after the graphs (a few hundred MB) a whole 40,960-token prompt of Qwen3-0.6B still
#: fits the estimate below
ACTIVATION_RESERVE_BYTES = 3 << 30
#: the same where they cannot (rule off, no chunked prefill, mixture-of-experts models)
STEP_RESERVE_BYTES = 2 << 30

#: headroom over the counted tensors (allocator rounding, temporaries not counted)
SAFETY = 1.25


def activation_bytes_per_token(mc: ModelConfig, tp_size: int, elem: int) -> int:
    """Bytes of activations one prompt token holds at the peak of a layer, on one rank.

    Counts the larger of two phases: attention (residual and normed input, the q/k/v projection,
    q after norm and rotary, the attention output, and the cuDNN path's padded q, k and v with
    the KV heads repeated and its output) and the MLP (residual and normed input, gate/up, the
    activation); times :data:`SAFETY`.

    Args:
        mc: a dense model's config; tp_size: tensor-parallel ranks (heads and the intermediate
            size are split over them); elem: bytes per activation element (2 for bf16).

    Returns:
        Bytes per token (an int > 0). Raises nothing.
    """
    hq = max(1, mc.num_attention_heads // tp_size)
    hkv = max(1, mc.num_key_value_heads // tp_size)
    d, hidden = mc.head_dim, mc.hidden_size
    attention = 2 * hidden + (hq + 2 * hkv) * d + 2 * hq * d + 4 * hq * d + 2 * hkv * d
    mlp = 2 * hidden + 3 * (mc.intermediate_size // tp_size)
    return int(elem * max(attention, mlp) * SAFETY)


def max_step_tokens(
    mc: ModelConfig,
    tp_size: int,
    elem: int,
    max_model_len: int,
    memory_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """The most tokens of a whole-prompt step whose activations fit ``memory_bytes``, at most
    ``max_model_len``.

    Mixture-of-experts models get 0 (no whole-prompt steps): their routed activations
    (``top_k`` copies of each token, sorted) are not counted by
    :func:`activation_bytes_per_token`.

    Args:
        mc, tp_size, elem: as :func:`activation_bytes_per_token`; max_model_len: the cap;
        memory_bytes: the memory the step may use (the runner measures what is left after the
            KV cache and the CUDA graphs).

    Returns:
        Tokens (an int >= 0). Raises nothing.
    """
    if mc.num_experts:
        return 0
    per_token = activation_bytes_per_token(mc, tp_size, elem)
    return max(0, min(max_model_len, int(memory_bytes) // per_token))
