"""Per-device kernel tile tables measured on the GPU (``<kernel>_<device name>.json``).

Each kernel with static tiles (no autotuning at serve time: launches stay CUDA-graph capturable
and the first request pays no search) reads its table through :func:`kernel_table`; the
benchmark that measured it (``bench/gemv.py --sweep --write-table`` and the like) writes it
with :func:`table_path`. A device without a table gets each kernel's documented fallback.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device ("NVIDIA H200"); "cpu" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_path(kernel: str, name: str) -> Path:
    """Where the table of ``kernel`` ("gemv", "fp8_gemm", ...) for device ``name`` lives."""
    return CONFIG_DIR / f"{kernel}_{name.replace(' ', '_')}.json"


@cache
def kernel_table(kernel: str, name: str) -> dict:
    """The parsed table of ``kernel`` for device ``name``; ``{}`` when none was measured.

    Raises:
        json.JSONDecodeError: a table file that is not JSON (a broken checkout; not hidden).
    """
    path = table_path(kernel, name)
    if not path.exists():
        return {}
    return json.loads(path.read_text())
