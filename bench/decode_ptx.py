"""PTX check of the split-KV decode kernel's synchronisation (``kernels/decode_attention.py``):
what the fused split merge and the q/k prologue rely on, which the Triton interpreter (programs
run one after another) cannot test. Used by ``bench/decode_compile_check.py``; imports nothing of
Triton, so it also runs in the interpreter's tests."""

from __future__ import annotations

import re

_ATOM_ACQ_REL = re.compile(r"atom\.[\w.]*acq_rel[\w.]*\.add|atom\.[\w.]*\.add[\w.]*acq_rel")
_ATOM_EXCH = re.compile(r"atom\.[\w.]*\.exch")
_STORE = re.compile(r"\bst\.global")
#: a load from global memory: ``ld.global``, or an async copy into shared memory from global
#: (``cp.async.cg.shared.global``, ``cp.async.bulk[.tensor].shared::cluster.global``; not the
#: bulk stores ``cp.async.bulk.global.shared::cta`` nor ``commit_group`` / ``wait_group``)
_GLOBAL_READ = re.compile(r"\bld\.global|\bcp\.async\.[\w:.]*shared[\w:.]*\.global")
_BARRIER = re.compile(r"\bbar\.sync|\bbarrier\.sync")


def _barrier_after_last_store(ptx: str, end: int) -> bool | None:
    """Whether a CTA barrier lies between the last global store before offset ``end`` and
    ``end`` (None: no store before it). Anchored to that store, not anywhere in the kernel:
    the attention loop's own barriers (shared-memory pipelining) are in every variant."""
    stores = list(_STORE.finditer(ptx, 0, end))
    if not stores:
        return None
    return _BARRIER.search(ptx, stores[-1].end(), end) is not None


def sync_error(ptx: str, constexprs: dict) -> str | None:
    """What synchronisation a variant's PTX lacks, or None.

    ``FUSED_REDUCE``: a CTA barrier (``bar.sync``) between the partials' last store and the
    arrival, an acquire-release atomic add at GPU scope (``.gpu``: the partials of other
    CTAs), the counter reset (an atomic exchange) and ``ld.global.cg`` loads of the partials
    (L1 holds no stale copy); ``FUSED_QK``: a CTA barrier between the prologue's k/v stores
    and the next global read (the attention loop's first loads of the cache). Without either,
    no atomic may appear. The prologue check is strict: a compiler that stored k, then loaded
    v's inputs, then stored v would fail it though a barrier followed both stores (the kernels
    compiled so far load both first). (Triton 3.9 also puts a barrier of its own before the
    arrival, for the atomic's shared-memory broadcast, so that barrier holds without the
    kernel's ``tl.debug_barrier``; the prologue's does not.)
    """
    atom = _ATOM_ACQ_REL.search(ptx)
    if constexprs.get("FUSED_REDUCE"):
        if atom is None:
            return "fused merge without an acq_rel atomic add"
        line = ptx[ptx.rfind("\n", 0, atom.start()) + 1 : ptx.find("\n", atom.end())]
        if ".gpu" not in line:
            return f"fused merge arrival not at GPU scope: {line.strip()}"
        if not _barrier_after_last_store(ptx, atom.start()):
            return "no CTA barrier between the partials' store and the fused merge's arrival"
        if not _ATOM_EXCH.search(ptx[atom.end() :]):
            return "fused merge without the counter reset after the arrival"
        if "ld.global.cg" not in ptx[atom.end() :]:
            return "fused merge loads the partials without .cg"
    elif atom is not None or _ATOM_EXCH.search(ptx):
        return "an atomic in a variant without the fused merge"
    if constexprs.get("FUSED_QK"):
        store = _STORE.search(ptx)
        if store is None:
            return "q/k prologue without a store"
        read = _GLOBAL_READ.search(ptx, store.end())
        if read is None or not _barrier_after_last_store(ptx, read.start()):
            return "no CTA barrier between the prologue's k/v store and the next global read"
    return None
