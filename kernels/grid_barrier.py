"""Grid-wide barriers inside one persistent Triton launch, and the residency check they need.

A persistent kernel (one program per SM, all resident) walks several operations that would
otherwise be separate launches; between two, every program must see every other program's
stores. :func:`grid_arrive` counts a program's arrival (a CTA barrier, then one release atomic
per program at GPU scope on an int32 counter) and :func:`grid_wait` spins on acquire loads of
the counter until every program has arrived: cooperative groups' ``grid.sync()`` split in two,
so that loads of data nothing writes (weights, earlier keys/values) can be issued between the
two and overlap the wait (Hazy Research's "No Bubbles" megakernel, 2025, overlaps the next
operation's weight loads the same way). The caller keeps the counter monotonic within a launch
(target ``phases x programs``); :func:`grid_leave` resets it when every program has left.

Measured (``bench/grid_barrier_probe.py``, H100, 2026-12-06): ~1.05 us per barrier with 132
programs, where a kernel boundary with programmatic dependent launch costs ~2.5 us more for the
same tiles. Every program must be resident or the wait never returns: :func:`launch_resident`
checks the compiled kernel's registers, shared memory and threads against the SMs first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpreter import interpreting


@triton.jit
def grid_arrive(bar_ptr):
    """Count this program's arrival at a grid barrier: a CTA barrier (every thread's stores are
    issued), then one release atomic per program at GPU scope on the int32 ``bar_ptr``."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(bar_ptr, target):
    """Spin (acquire atomics at GPU scope) until the counter at ``bar_ptr`` reaches ``target``:
    then every store issued before the arrivals counted is visible. Loads issued between
    :func:`grid_arrive` and this call (weights, which no program writes) are not ordered by the
    barrier: their latency overlaps the wait. All programs of the grid must be resident at once
    (a grid within the SMs' capacity), or this never returns."""
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def grid_sync(bar_ptr, target):
    """:func:`grid_arrive` then :func:`grid_wait` for ``target``: a grid barrier with nothing
    issued in between."""
    grid_arrive(bar_ptr)
    grid_wait(bar_ptr, target)


@triton.jit
def grid_leave(bar_ptr, nprog):
    """A program's last step after its last :func:`grid_wait`: count its departure on
    ``bar_ptr[1]``; the last of the ``nprog`` programs to leave sets both counters
    (``bar_ptr[0]``: the barrier, ``bar_ptr[1]``: departures) back to zero, so the next launch
    (or CUDA-graph replay) starts from zero while no program still spins on them."""
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == nprog - 1:  # every program has passed the last barrier
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


def resident_programs(compiled, num_warps: int, props) -> tuple[int | None, str]:
    """How many programs of a compiled Triton kernel a CUDA ``device`` holds at once (per SM:
    the fewest its threads, registers -- allocated per warp in 256s -- and shared memory allow,
    times the SMs; ``props``: ``torch.cuda.get_device_properties``), and ``"R regs, S B
    spilled"``; ``(None, "")`` where Triton does not say. A grid barrier needs every program
    resident: a larger grid spins forever."""
    try:
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        regs, spills = int(compiled.n_regs), int(compiled.n_spills)
        smem = int(compiled.metadata.shared)
    except Exception:  # another Triton: no check (and say so where it is printed)
        return None, ""
    threads = 32 * num_warps
    warp_regs = -(-regs * 32 // 256) * 256
    per_sm = min(
        getattr(props, "max_threads_per_multi_processor", 2048) // threads,
        getattr(props, "regs_per_multiprocessor", 65536) // max(1, warp_regs * num_warps),
        props.shared_memory_per_multiprocessor // smem if smem else 1 << 30,
    )
    return per_sm * props.multi_processor_count, f"{regs} regs, {spills} B spilled"


def launch_resident(
    kernel, grid: tuple[int], args: tuple, num_warps: int, device, check: bool = True
) -> str:
    """Launch ``kernel[grid](*args, num_warps=...)`` after checking (with ``check``, on a CUDA
    device, compiled kernels) that all ``grid[0]`` programs can be resident; returns the
    register line of :func:`resident_programs` ("" under the interpreter or unchecked).

    Raises:
        ValueError: more programs than the device holds at once (the launch would hang).
    """
    usage = ""
    if check and torch.device(device).type == "cuda" and not interpreting():
        compiled = kernel.warmup(*args, grid=grid, num_warps=num_warps)
        props = torch.cuda.get_device_properties(device)
        fit, usage = resident_programs(compiled, num_warps, props)
        if fit is not None and grid[0] > fit:
            raise ValueError(
                f"{grid[0]} programs cannot all be resident ({fit} fit, {usage}): "
                "the grid barrier would never return"
            )
    kernel[grid](*args, num_warps=num_warps)
    return usage
