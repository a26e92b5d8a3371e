"""Arrival counters of kernels whose last-arriving program finishes a reduction (split-K GEMV,
the decode kernel's fused split merge): CUTLASS's serial split-K semaphore. Imports only torch.

Each kernel family has its own zeroed int32 buffer per device. Every launch leaves its counters
at zero again (the last-arriving program resets them), so launches on one stream and CUDA-graph
replays always start from zero; kernels of one family on one stream share the buffer because
their launches are ordered.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(family: str, size: int, device: torch.device | str) -> torch.Tensor:
    """The ``[size]`` int32 counters of ``family`` on ``device``, zeroed at first use.

    Made outside inference mode even when first asked for inside it (an engine forward), so a
    caller outside it may still reset them in place (``zero_()`` after a failed launch).

    Args:
        family: the kernels sharing the buffer (e.g. "gemv"); size: counters (> 0), the same at
            every call of a family.

    Raises:
        RuntimeError: asked for the first time while a CUDA graph is being captured (the zeroing
            would only be recorded; run the launch eagerly first, as the engine's warm-up does).
    """
    device = torch.device(device)
    buf = _BUFFERS.get((family, device))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{family}: the arrival counters must be made before a CUDA graph is captured"
            )
        with torch.inference_mode(False):
            buf = torch.zeros(size, dtype=torch.int32, device=device)
        _BUFFERS[(family, device)] = buf
    return buf
