"""PTX check of a kernel launched with programmatic dependent launch (``kernels/pdl.py``): no
memory access or CTA barrier may come before ``griddepcontrol.wait``. Used by the sm_90 compile
checks (``bench/gemv_compile_check.py``, ``bench/fp8_compile_check.py``); imports nothing of
Triton, so it also runs under the interpreter's tests."""

from __future__ import annotations

import re

#: PTX instructions that touch memory other than kernel parameters, or synchronise a CTA
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld\.(?!param)|st\.|atom\.|red\.|cp\.|bar\.)")


def pdl_order_error(ptx: str, pdl: bool) -> str | None:
    """What is wrong with a kernel's PTX for PDL, or None: compiled with ``pdl`` (its ``PDL``
    constexpr) but without ``griddepcontrol.wait``; or a read, write or barrier before the wait
    (the race ``kernels/pdl.py`` rules out: the previous kernel may still be writing), named.
    ``prefetch.global.L2`` may precede the wait; a kernel without a wait and without ``pdl``
    passes."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "PDL on but no griddepcontrol.wait in the PTX" if pdl else None
    for line in ptx[:wait].splitlines():
        if _MEMORY_OP.match(line):
            return f"before griddepcontrol.wait: {line.strip()}"
    return None
