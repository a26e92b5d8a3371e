"""The parent-death signal of a process (Linux ``prctl(PR_SET_PDEATHSIG)``), used by the engine
core, the tensor-parallel ranks and the API servers so that none outlives the process that
started it."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the thread that started
    it) ends; 0 clears it. Returns whether it was set (False off Linux or without ``prctl``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
