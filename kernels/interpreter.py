"""Whether the Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``), where
some launchers pick small tiles or emulate what the interpreter gets wrong."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (read at each call: the test conftest sets it before
    the kernels run)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
