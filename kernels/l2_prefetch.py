"""Ask the GPU's L2 cache for whole tensors ahead of the kernels that read them: a measurement
tool (``bench/l2_prefetch_probe.py``), not used by the engine.

The question it answers (issue 19): the batch-1 decode step's GEMVs reach 1-1.8 TB/s of the
H200's ~4.8 -- is that the weight fetch each kernel starts on its own, which a prefetch into L2
ahead of the kernel would hide (the overlap of whole-model decode megakernels, Hazy Research,
"Look Ma, No Bubbles", 2025), or the kernels' fixed costs? This kernel issues one
``prefetch.global.L2`` per 128-byte line of up to four tensors, from a small grid looping over
its chunks, and returns; launched on a side stream of a CUDA graph it fills L2 while the main
stream computes. Measured on an H100 (docs/benchmarks.md, 2026-12-05, sixth session): a chain
of 112 Qwen3-0.6B GEMVs with every weight already in L2 runs only 10 % faster than from HBM,
and the engine's batch-1 step with the side-stream prefetch was no faster (batch 4: 4 %
slower), so the engine does not prefetch -- the step's time is in the kernels' fixed costs.

A hint with no effect on any result: it loads nothing into registers and writes nothing. Under
the CPU interpreter there is no L2 and no inline PTX: :func:`l2_prefetch` does nothing there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpreter import interpreting

#: bytes per L2 cache line (Hopper), one prefetch each
LINE_BYTES = 128
#: cache lines one program asks for (8 per thread with 4 warps)
LINES_PER_PROGRAM = 1024
#: byte ranges one launch takes
MAX_RANGES = 4
#: programs of one launch (each loops over its chunks), unless the caller says otherwise
DEFAULT_PROGRAMS = 16


@triton.jit
def _prefetch_range(base, n_lines, pid, programs, LINES: tl.constexpr):
    """Program ``pid`` of ``programs`` asks for chunks ``pid, pid + programs, ...`` of ``LINES``
    lines of the ``n_lines`` lines starting at ``base`` (a uint8 pointer)."""
    for chunk in range(pid, tl.cdiv(n_lines, LINES), programs):
        line = chunk * LINES + tl.arange(0, LINES)
        line = tl.minimum(line, n_lines - 1)  # the last chunk's tail repeats the last line
        ptrs = base + line.to(tl.int64) * 128
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def bulk_prefetch_l2(ptr, nbytes, CHUNK: tl.constexpr):
    """Ask L2 for the ``nbytes`` bytes from ``ptr`` (any pointer type; 16-byte aligned, and
    ``nbytes`` a multiple of 16; 0 or less: nothing) with sm_90's bulk prefetch
    (``cp.async.bulk.prefetch.L2.global``, PTX ISA 8.0: the TMA unit fetches the whole range,
    one instruction per ``CHUNK`` bytes, no registers), issued by thread 0 of the program only
    (the other threads' copies of the scalar are predicated off). A hint: reads nothing into
    registers, writes nothing. GPU only (inline PTX): callers leave it out under the
    interpreter."""
    base = ptr.to(tl.pointer_type(tl.int8))
    for off in range(0, nbytes, CHUNK):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; }",
            "=r,l,r",
            [base + off, tl.minimum(nbytes - off, CHUNK)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3"])
def _l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, LINES: tl.constexpr):
    """Every program takes its share of each range (``pK`` a uint8 pointer, ``nK`` its length
    in lines, 0 for an unused range)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    _prefetch_range(p0, n0, pid, programs, LINES)
    _prefetch_range(p1, n1, pid, programs, LINES)
    _prefetch_range(p2, n2, pid, programs, LINES)
    _prefetch_range(p3, n3, pid, programs, LINES)


def prefetch_lines(t: torch.Tensor) -> int:
    """Cache lines of ``t``'s storage span (a contiguous tensor's bytes, rounded up)."""
    return triton.cdiv(t.numel() * t.element_size(), LINE_BYTES)


def l2_prefetch(tensors: list[torch.Tensor], programs: int = DEFAULT_PROGRAMS) -> None:
    """Launch one kernel on the current stream asking L2 for every line of ``tensors``.

    Args:
        tensors: at most ``MAX_RANGES`` contiguous CUDA tensors of any dtype (the weights of the
            projections about to run); empty ones are skipped.
        programs: the grid (at most one program per ``LINES_PER_PROGRAM`` lines): few, so that
            the prefetch takes few SMs from the kernels running beside it.

    Does nothing under the CPU interpreter or for CPU tensors (no cache to fill). No host
    synchronisation and no allocation; one compiled variant for every tensor size (the line
    counts are not specialised), so once launched eagerly it can be captured in a CUDA graph
    (a module load is not allowed during capture).

    Raises:
        ValueError: more than ``MAX_RANGES`` tensors, a non-contiguous one (its lines would
            not be the bytes its readers touch), or ``programs < 1``.
    """
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"l2_prefetch takes at most {MAX_RANGES} tensors, got {len(tensors)}")
    if programs < 1:
        raise ValueError(f"l2_prefetch needs at least one program, got {programs}")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"l2_prefetch needs contiguous tensors, got stride {t.stride()}")
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or interpreting() or tensors[0].device.type != "cuda":
        return
    args, total = [], 0
    for t in tensors:
        lines = prefetch_lines(t)
        args += [t.view(-1).view(torch.uint8), lines]
        total += lines
    while len(args) < 2 * MAX_RANGES:  # unused ranges: no lines
        args += [args[0], 0]
    grid = min(programs, triton.cdiv(total, LINES_PER_PROGRAM))
    _l2_prefetch_kernel[(grid,)](*args, LINES=LINES_PER_PROGRAM, num_warps=4)
