"""Process-wide on/off switches read from the environment (``QWEN_SERVE_PDL`` here, the fused
decode kernels' ``QWEN_SERVE_*`` switches in ``engine/layers/kernel_switches.py``)."""

from __future__ import annotations

import os


def env_switch(name: str) -> bool:
    """The boolean environment variable ``name``, on when unset.

    Returns:
        True for 1/true/yes/on, False for 0/false/no/off (any case, surrounding spaces ignored).

    Raises:
        ValueError: any other value, naming the variable.
    """
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1/true/yes/on or 0/false/no/off")
