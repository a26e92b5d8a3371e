"""Programmatic dependent launch (PDL) of the decode-step kernels on Hopper and newer.

Inside the batch-1 decode step's CUDA graph every kernel boundary costs the previous kernel's
drain, the next one's launch and its first loads' latency: ~290 kernels of 1-7 us each. With
PDL (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; Triton's
``launch_pdl`` launch option and ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``) a kernel
is launched while the previous one still runs; it must execute ``griddepcontrol.wait`` before it
reads anything the previous kernels wrote or writes anything at all, and may do independent
work first: the GEMVs ask L2 for the first K tiles of their weight slice there (the weights
are never written by a step; CUTLASS example 63 prefetches weights the same way). After its
wait a kernel calls ``griddepcontrol.launch_dependents`` so that the next kernel may start. A
wait returns once the previous grid has completed and its writes are visible, so ordering
stays transitive along the stream; a kernel launched without PDL (cuBLAS, Inductor's) simply
waits as before. The FP8 GEMV takes PDL without the prefetch (it measured slower there).

Measured on the H200 (``bench/pdl_probe.py``, 112 chained Qwen3-0.6B projections in a graph):
5.51 us per GEMV plain, 4.84 with PDL, 4.59 with PDL and the weight prefetch.

``QWEN_SERVE_PDL=0`` turns it off for the whole process (A/B runs, or a driver that refuses
it); read once at import, values 1/true/yes/on or 0/false/no/off.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from kernels.interpreter import interpreting
from kernels.switches import env_switch


def _switch() -> bool:
    return env_switch("QWEN_SERVE_PDL")


#: the process-wide switch (``QWEN_SERVE_PDL``), read once
PDL_SWITCH = _switch()

_SUPPORTED: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL: the switch is on, the device is CUDA of
    compute capability 9.0 or newer, the kernels are compiled (not the CPU interpreter, which has
    no ``griddepcontrol``), and this Triton has the ``gdc`` intrinsics. Host-side and cached per
    device index; no device synchronisation."""
    device = torch.device(device)
    if not PDL_SWITCH or device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _SUPPORTED.get(index)
    if ok is None:
        try:
            cuda = importlib.import_module("triton.language.extra.cuda")
        except ImportError:
            cuda = None
        ok = torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda, "gdc_wait")
        _SUPPORTED[index] = ok
    return ok


def launch_options(enabled: bool) -> dict:
    """The Triton launch keyword arguments of a kernel launched with or without PDL."""
    return {"launch_pdl": True} if enabled else {}


def pdl_kwargs(device: torch.device) -> dict:
    """The ``PDL`` constexpr and the launch options of a kernel taking PDL (no prefetch) on
    ``device``: ``{"PDL": pdl_enabled(device), **launch_options(...)}``."""
    enabled = pdl_enabled(device)
    return {"PDL": enabled, **launch_options(enabled)}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous kernels' completion and writes
    (``griddepcontrol.wait``), then let the next kernel launch (``launch_dependents``). Every
    read of data a previous kernel wrote, and every write, comes after this call."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(base_ptr, rows, stride_row, col_lo, col_hi, LINE: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for the first ``4 * COLS`` lines of ``base[rows, col_lo:col_hi]`` (``rows`` an
    int64 ``[R]`` tensor of row indices, ``stride_row`` elements apart): one
    ``prefetch.global.L2`` per ``LINE`` elements (a 128-byte line: 64 16-bit elements),
    ``COLS >= 1`` lines (one K tile) per row and step, four steps (columns past ``col_hi``
    clamp to its last one; callers check :func:`kernels.gemv.prefetchable`). Four K tiles
    cover the loads of the pipeline's first stages, which is what overlapping the previous
    kernel's tail needs; whole slices need not fit in L2 (Qwen3-8B's FP8 gate/up weight is
    twice the H200's 50 MB). A hint: reads nothing into registers and writes nothing, so it may
    run before :func:`pdl_wait` on data no earlier kernel of the step writes (its weights)."""
    for i in tl.static_range(4):
        c0 = col_lo + i * COLS * LINE
        cols = tl.minimum(c0 + tl.arange(0, COLS) * LINE, col_hi - 1)
        ptrs = base_ptr + rows[:, None] * stride_row + cols[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
