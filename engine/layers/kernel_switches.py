"""Process-wide off switches of the fused decode kernels, read once at import: for A/B runs of
one tree (``bench/latency_ab.sh``) and as an escape hatch should a kernel misbehave on a GPU.

* ``QWEN_SERVE_FUSED_QK_ROPE=0``: the model applies q/k RMSNorm and rotary itself and the
  attention op stores k/v (``kernels/qk_norm_rope.py`` not used);
* ``QWEN_SERVE_SMALL_M_GEMV=0``: every unquantized projection runs on cuBLAS
  (``kernels/gemv.py`` not used; the two fusions below need it and are off too);
* ``QWEN_SERVE_FUSED_NORM_GEMV=0``: the residual add + RMSNorm before q/k/v and before gate/up
  runs as its own kernel (``kernels/gemv_fused.py``'s ``gemv_rms_norm`` not used);
* ``QWEN_SERVE_FUSED_SWIGLU_GEMV=0``: SwiGLU runs as its own kernel before the down projection
  (``gemv_swiglu`` not used).
* ``QWEN_SERVE_FUSED_MERGE_GEMV=0``: split-KV decode attention merges its splits in its own
  launch before the output projection (``kernels/gemv_merge.py`` not used).
* ``QWEN_SERVE_FUSED_QKV_ROPE_GEMV=0``: the q/k norm + rotary + KV store runs as its own
  launch after the q/k/v projection (``kernels/gemv_qk_rope.py`` not used).
* ``QWEN_SERVE_TRITON_SWIGLU=0``: SwiGLU outside the fused GEMV (prompt steps) runs as the
  compiled composition (``engine.layers.pointwise``) instead of ``kernels/swiglu.py``'s Triton
  kernel (2.8 against 1.4-1.7 TB/s on an H100; docs/benchmarks.md, 2026-12-05, fourth session).

* ``QWEN_SERVE_PERSISTENT_DECODE=0``: one-token decode steps of one sequence run the layer
  loop. On by default on CUDA devices: such steps of a dense bf16 Qwen3 model on one GPU of
  compute capability 9.0+ with up to 2,048 tokens of context run all layers in one persistent
  launch (``engine/models/persistent_decode.py``, ``kernels/persistent_decode.py``; 8-16 %
  faster than the layer loop on an H100, docs/benchmarks.md, 2026-12-06, fifteenth session),
  for models whose compiled kernel spills at most ``DEFAULT_MAX_SPILL_BYTES`` (the measured
  Qwen3-0.6B; larger ones spill kilobytes). Set to 1 it is also taken for those and under the
  Triton interpreter (the tests), and a model that cannot take it is warned about. Its
  layout's knobs: ``QWEN_SERVE_PERSISTENT_PRE_KV=0``, ``QWEN_SERVE_PERSISTENT_PRE_W=0``,
  ``QWEN_SERVE_PERSISTENT_LATE_R=0`` (on by default: the first K/V tile, the GEMVs' first
  weight chunks loaded during the barrier waits; the RMSNorm scales applied after the dot
  products), ``QWEN_SERVE_PERSISTENT_EARLY_RES=1`` (off by default: residual rows loaded
  before the K loops), ``QWEN_SERVE_PERSISTENT_ROW_SM=1``/``0`` (the attention's online
  softmax per row of head-repeated tiles for every context, or for none; by default for
  contexts over ``QWEN_SERVE_PERSISTENT_ROW_SM_AFTER`` tokens, 512),
  ``QWEN_SERVE_PERSISTENT_DOT_ATTN=0`` (on by default where the shape takes it: the per-head
  attention loop, the contexts without the per-row softmax, on tensor cores),
  ``QWEN_SERVE_PERSISTENT_MERGE_C=1`` (off by default: the attention splits merged by the
  last split of each KV head instead of in a phase of their own), and the counts
  ``QWEN_SERVE_PERSISTENT_MAX_CONTEXT`` (the longest context it takes),
  ``QWEN_SERVE_PERSISTENT_BLOCK_K`` (its K chunk), ``QWEN_SERVE_PERSISTENT_BLOCK_T`` (tokens
  per attention tile) and ``QWEN_SERVE_PERSISTENT_BLOCK_K_H`` (the o and down projections' K
  chunk), read with :func:`persistent_options`.

The others default to on (the fusions only where their table,
``kernels/configs/gemv_fused_<device>.json``, says they win; see
``engine/layers/fused_linear.py``); values 1/true/yes/on or 0/false/no/off, anything else
is refused at import with a ValueError naming the variable.
Outputs are the same model's either way (within bf16 rounding). The kernels' programmatic
dependent launch has its own switch, ``QWEN_SERVE_PDL=0``, in ``kernels/pdl.py`` (the kernel
layer reads it; it changes no result bit).
"""

from __future__ import annotations

import os

from kernels.switches import env_count, env_switch

FUSED_QK_ROPE = env_switch("QWEN_SERVE_FUSED_QK_ROPE")
SMALL_M_GEMV = env_switch("QWEN_SERVE_SMALL_M_GEMV")
FUSED_NORM_GEMV = env_switch("QWEN_SERVE_FUSED_NORM_GEMV")
FUSED_SWIGLU_GEMV = env_switch("QWEN_SERVE_FUSED_SWIGLU_GEMV")
FUSED_MERGE_GEMV = env_switch("QWEN_SERVE_FUSED_MERGE_GEMV")
FUSED_QKV_ROPE_GEMV = env_switch("QWEN_SERVE_FUSED_QKV_ROPE_GEMV")
TRITON_SWIGLU = env_switch("QWEN_SERVE_TRITON_SWIGLU")
PERSISTENT_DECODE = env_switch("QWEN_SERVE_PERSISTENT_DECODE")
#: QWEN_SERVE_PERSISTENT_DECODE set on: the path is also tried off CUDA (the Triton interpreter)
#: and a model or device that cannot take it is warned about
PERSISTENT_DECODE_ASKED = PERSISTENT_DECODE and "QWEN_SERVE_PERSISTENT_DECODE" in os.environ


#: the persistent decode path's layout switches (``QWEN_SERVE_PERSISTENT_<NAME>``)
PERSISTENT_FLAGS = ("pre_kv", "pre_w", "late_r", "early_res", "row_sm", "dot_attn", "merge_c")


def persistent_options(environ=None) -> dict:
    """The persistent decode path's keyword options for
    :func:`engine.models.persistent_decode.build` that ``environ`` (``os.environ`` when None)
    sets: the layout flags ``pre_kv``, ``pre_w``, ``late_r``, ``early_res``, ``row_sm``,
    ``dot_attn``, ``merge_c`` (``QWEN_SERVE_PERSISTENT_PRE_KV``, ...; 1/0) and the counts
    ``max_context``, ``block_k``, ``block_t``, ``block_k_h``, ``row_sm_after``
    (``QWEN_SERVE_PERSISTENT_MAX_CONTEXT``, ...). Unset ones are left out: ``build``'s
    defaults apply.

    Raises:
        ValueError: a value that is not 1/true/yes/on or 0/false/no/off for a flag, not an
            integer >= 1 for a count, naming the variable."""
    environ = os.environ if environ is None else environ
    options = {}
    for key in PERSISTENT_FLAGS:
        name = f"QWEN_SERVE_PERSISTENT_{key.upper()}"
        if name in environ:
            options[key] = env_switch(name, environ=environ)
    for key in ("max_context", "block_k", "block_t", "block_k_h", "row_sm_after"):
        value = env_count(f"QWEN_SERVE_PERSISTENT_{key.upper()}", 0, environ=environ)
        if value:
            options[key] = value
    return options
