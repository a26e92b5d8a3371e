"""Device facts for the worker: torch dtypes from names, device-error classification, memory,
and the host threads of a GPU engine."""

from __future__ import annotations

import os
import time

import torch

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name (``engine.core.config.parse_dtype``).

    Raises:
        ValueError: unknown name.
    """
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; expected one of {sorted(_TORCH_DTYPES)}"
        ) from None


def limit_host_threads() -> bool:
    """One torch intra-op CPU thread for an engine whose model runs on a GPU, unless
    ``OMP_NUM_THREADS`` is set (then torch already follows it); returns whether it changed.

    The host side of a GPU step does small array work plus a few larger copies (a step's packed
    grammar bitmasks are ~1.2 MB at batch 64 on a 150k vocabulary). Torch splits such a copy
    over its OpenMP pool, one thread per core, and libgomp's threads then spin-wait for the
    next parallel region: they hold the cores that llguidance's mask threads and the rest of
    the engine core need. Measured on a 16-core H200 host (``bench/structured_steps.py``,
    2026-12-01): the mask fill of 64 requests took 3.5 ms per step inside the engine against
    0.29 ms alone, and 1.4 ms with one torch thread (and the staging copies done by numpy);
    served at concurrency 64 with a JSON schema on every request, output tok/s went from 0.49x
    to 0.93x of the unconstrained run. vLLM sets ``OMP_NUM_THREADS=1`` in its worker processes
    for the same reason.
    """
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1:
        return False
    torch.set_num_threads(1)
    return True


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for ``torch.bfloat16`` etc."""
    return str(dtype).removeprefix("torch.")


def is_device_error(exc: BaseException) -> bool:
    """A CUDA error (illegal access, launch failure): it poisons the CUDA context, so every
    later step would fail too. Out-of-memory and ordinary exceptions are not."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


class MemoryStats:
    """CUDA memory of one device in bytes, re-read at most every ``interval_s`` seconds.

    Each ``torch.cuda.memory_allocated``/``memory_reserved`` call builds the allocator's whole
    statistics dict; read every step, that was a large share of the engine process's host time
    at high concurrency (docs/benchmarks.md, third session), and metrics are scraped every few
    seconds anyway.

    Args:
        device: the engine's device (on the CPU :meth:`read` returns {}).
        interval_s: the longest age of a returned figure.
    """

    def __init__(self, device: torch.device, interval_s: float = 1.0):
        self.device = device
        self.interval_s = interval_s
        self._total = (
            torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        )
        self._stats: dict[str, int] | None = None
        self._time = 0.0

    def read(self) -> dict[str, int]:
        """``gpu_memory_allocated``, ``gpu_memory_reserved``, ``gpu_memory_total`` (empty on the
        CPU)."""
        if self.device.type != "cuda":
            return {}
        now = time.monotonic()
        if self._stats is None or now - self._time >= self.interval_s:
            self._stats = {
                "gpu_memory_allocated": torch.cuda.memory_allocated(self.device),
                "gpu_memory_reserved": torch.cuda.memory_reserved(self.device),
                "gpu_memory_total": self._total,
            }
            self._time = now
        return self._stats
