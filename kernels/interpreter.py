"""Whether the Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``), where
some launchers pick small tiles or emulate what the interpreter gets wrong."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is on as Triton reads it (1/true/on/yes, any case; read at
    each call: the test conftest sets it before the kernels run)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
