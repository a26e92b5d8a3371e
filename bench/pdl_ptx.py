"""PTX check of a kernel launched with programmatic dependent launch (``kernels/pdl.py``): no
memory access or CTA barrier may come before ``griddepcontrol.wait``. Used by the sm_90 compile
checks (``bench/gemv_compile_check.py``, ``bench/fp8_compile_check.py``); imports nothing of
Triton, so it also runs under the interpreter's tests."""

from __future__ import annotations

import re

#: PTX instructions that touch memory other than kernel parameters, or synchronise a CTA
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld\.(?!param)|st\.|atom\.|red\.|cp\.|bar\.)")


def pdl_order_error(ptx: str) -> str | None:
    """Where a PDL kernel's PTX reads, writes or synchronises before ``griddepcontrol.wait``
    (the race ``kernels/pdl.py`` rules out: the previous kernel may still be writing), the
    offending instruction; None when the wait comes first (``prefetch.global.L2`` may precede
    it) or when there is no wait."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return None
    for line in ptx[:wait].splitlines():
        if _MEMORY_OP.match(line):
            return f"before griddepcontrol.wait: {line.strip()}"
    return None
