"""PTX check of the split-KV decode kernel's synchronisation (``kernels/decode_attention.py``):
what the fused split merge and the q/k prologue rely on, which the Triton interpreter (programs
run one after another) cannot test. Used by ``bench/decode_compile_check.py``; imports nothing of
Triton, so it also runs in the interpreter's tests."""

from __future__ import annotations

import re

_ATOM_ACQ_REL = re.compile(r"atom\.[\w.]*acq_rel[\w.]*\.add|atom\.[\w.]*\.add[\w.]*acq_rel")
_ATOM_EXCH = re.compile(r"atom\.[\w.]*\.exch")


def sync_error(ptx: str, constexprs: dict) -> str | None:
    """What synchronisation a variant's PTX lacks, or None.

    ``FUSED_REDUCE``: a CTA barrier (``bar.sync``) before the arrival, an acquire-release atomic
    add at GPU scope (``.gpu``: the partials of other CTAs), the counter reset (an atomic
    exchange) and ``ld.global.cg`` loads of the partials (L1 holds no stale copy);
    ``FUSED_QK``: a CTA barrier after the k/v store. Without either, no atomic may appear.
    """
    atom = _ATOM_ACQ_REL.search(ptx)
    if constexprs.get("FUSED_REDUCE"):
        if atom is None:
            return "fused merge without an acq_rel atomic add"
        line = ptx[ptx.rfind("\n", 0, atom.start()) + 1 : ptx.find("\n", atom.end())]
        if ".gpu" not in line:
            return f"fused merge arrival not at GPU scope: {line.strip()}"
        if "bar.sync" not in ptx[: atom.start()] and "barrier.sync" not in ptx[: atom.start()]:
            return "no CTA barrier before the fused merge's arrival"
        if not _ATOM_EXCH.search(ptx[atom.end() :]):
            return "fused merge without the counter reset after the arrival"
        if "ld.global.cg" not in ptx[atom.end() :]:
            return "fused merge loads the partials without .cg"
    elif atom is not None or _ATOM_EXCH.search(ptx):
        return "an atomic in a variant without the fused merge"
    if constexprs.get("FUSED_QK"):
        store = ptx.find("st.global")
        if store < 0:
            return "q/k prologue without a store"
        if "bar.sync" not in ptx[store:] and "barrier.sync" not in ptx[store:]:
            return "no CTA barrier after the prologue's k/v store"
    return None
