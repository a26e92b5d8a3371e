"""Process-wide on/off switches read from the environment (``QWEN_SERVE_PDL`` here, the fused
decode kernels' ``QWEN_SERVE_*`` switches in ``engine/layers/kernel_switches.py``)."""

from __future__ import annotations

import os

#: every variable read through :func:`env_switch` (the server names the QWEN_SERVE_* variables
#: that neither a flag nor one of these reads)
SWITCH_NAMES = (
    "QWEN_SERVE_PDL",
    "QWEN_SERVE_FUSED_QK_ROPE",
    "QWEN_SERVE_SMALL_M_GEMV",
    "QWEN_SERVE_FUSED_NORM_GEMV",
    "QWEN_SERVE_FUSED_SWIGLU_GEMV",
    "QWEN_SERVE_FUSED_MERGE_GEMV",
    "QWEN_SERVE_FUSED_QKV_ROPE_GEMV",
    "QWEN_SERVE_DENSE_PREFILL",
    "QWEN_SERVE_DECODE_FUSED_REDUCE",
    "QWEN_SERVE_DECODE_FUSED_QK_ROPE",
    "QWEN_SERVE_TRITON_SWIGLU",
    "QWEN_SERVE_PERSISTENT_DECODE",
    "QWEN_SERVE_PERSISTENT_PRE_KV",
    "QWEN_SERVE_PERSISTENT_PRE_W",
    "QWEN_SERVE_PERSISTENT_LATE_R",
    "QWEN_SERVE_PERSISTENT_EARLY_RES",
    "QWEN_SERVE_PERSISTENT_ROW_SM",
    "QWEN_SERVE_PERSISTENT_DOT_ATTN",
    "QWEN_SERVE_PERSISTENT_MERGE_C",
)


def env_switch(name: str, default: bool = True, environ=None) -> bool:
    """The boolean environment variable ``name`` (one of :data:`SWITCH_NAMES`); ``default`` when
    unset (on, except for switches of variants still to be measured). ``environ``: the
    variables to read (``os.environ`` when None).

    Returns:
        True for 1/true/yes/on, False for 0/false/no/off (any case, surrounding spaces ignored).

    Raises:
        ValueError: any other value, naming the variable; a name not in :data:`SWITCH_NAMES`.
    """
    if name not in SWITCH_NAMES:
        raise ValueError(f"{name} is not a registered switch (kernels.switches.SWITCH_NAMES)")
    environ = os.environ if environ is None else environ
    value = environ.get(name, "1" if default else "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1/true/yes/on or 0/false/no/off")


#: the integer settings read by :func:`env_count` (benchmark knobs, A/B runs of one tree)
COUNT_NAMES = (
    "QWEN_SERVE_DECODE_MAX_SPLITS",
    "QWEN_SERVE_PERSISTENT_MAX_CONTEXT",
    "QWEN_SERVE_PERSISTENT_BLOCK_K",
    "QWEN_SERVE_PERSISTENT_BLOCK_T",
    "QWEN_SERVE_PERSISTENT_BLOCK_K_H",
    "QWEN_SERVE_PERSISTENT_ROW_SM_AFTER",
)


def env_count(name: str, default: int, environ=None) -> int:
    """The positive integer environment variable ``name`` (one of :data:`COUNT_NAMES`);
    ``default`` when unset or empty.

    Raises:
        ValueError: a value that is not an integer >= 1, naming the variable; a name not in
            :data:`COUNT_NAMES`.
    """
    if name not in COUNT_NAMES:
        raise ValueError(f"{name} is not a registered count (kernels.switches.COUNT_NAMES)")
    environ = os.environ if environ is None else environ
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: use an integer >= 1")
    return int(value)
