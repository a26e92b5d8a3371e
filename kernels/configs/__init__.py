"""Per-device kernel tile tables measured on the GPU (``<kernel>_<device name>.json``).

Each kernel with static tiles (no autotuning at serve time: launches stay CUDA-graph capturable
and the first request pays no search) reads its table through :func:`kernel_table`; the
benchmark that measured it (``bench/gemv.py --sweep --write-table`` and the like) writes it
with :func:`table_path`. A device with no table of its own reads the tables of its
architecture's measured device (:data:`FAMILY_TABLES`: an H100 reads the H200's); one of
another architecture gets each kernel's documented fallback.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent


#: compute capability -> the device whose tables serve a GPU of that capability that has none
#: of its own: the tiles are valid on every GPU of the architecture (same instructions, shared
#: memory and registers per SM), only their speed was measured on that one. Hopper (sm_90: H100,
#: H800, H20, GH200): the H200's -- on an H100 80GB HBM3 they took the batch-1 decode step from
#: 1.37 ms (cuBLAS projections, no table) to 1.19 ms (docs/benchmarks.md, 2026-12-05, sixth
#: session).
FAMILY_TABLES = {(9, 0): "NVIDIA H200"}

#: names seen by :func:`device_name` -> their compute capability (for :func:`table_device`)
_CAPABILITY: dict[str, tuple[int, int]] = {}


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device ("NVIDIA H200"); "cpu" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA ``device`` (132 on an H200), cached per device index; host-side,
    no sync.

    Raises:
        ValueError: ``device`` is not CUDA.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"num_sms: {device} is not a CUDA device")
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def _cuda_name(index: int) -> str:
    name = torch.cuda.get_device_name(index)
    _CAPABILITY[name] = tuple(torch.cuda.get_device_capability(index))
    return name


def table_device(kernel: str, name: str) -> str:
    """The device whose table of ``kernel`` the device called ``name`` reads: itself where that
    table was measured on it, else its architecture's (:data:`FAMILY_TABLES`, by the compute
    capability :func:`device_name` saw), else itself (no table: the kernel's documented
    fallback)."""
    if table_path(kernel, name).exists():
        return name
    return FAMILY_TABLES.get(_CAPABILITY.get(name), name)


def table_path(kernel: str, name: str) -> Path:
    """Where the table of ``kernel`` ("gemv", "fp8_gemm", ...) for device ``name`` lives."""
    return CONFIG_DIR / f"{kernel}_{name.replace(' ', '_')}.json"


@cache
def kernel_table(kernel: str, name: str) -> dict:
    """The parsed table of ``kernel`` for device ``name`` -- its own, or its architecture's
    where none was measured on it (:func:`table_device`); ``{}`` when there is none. Cached:
    ``name`` must come from :func:`device_name` in this process, or the architecture's table
    is not found (and ``{}`` is kept). Callers must not modify the result
    (:func:`current_table` gives a copy).

    Raises:
        json.JSONDecodeError: a table file that is not JSON (a broken checkout; not hidden).
    """
    path = table_path(kernel, table_device(kernel, name))
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def current_table(kernel: str, name: str) -> dict:
    """A copy of the table of ``kernel`` the device called ``name`` reads now (its own, or its
    architecture's: :func:`kernel_table`), the base a partial sweep on that device merges its
    rows into, so the rows it did not time stay as the device ran them. ``name`` must come
    from :func:`device_name` in this process (which records the capability the architecture's
    table is found by)."""
    return json.loads(json.dumps(kernel_table(kernel, name)))


#: the kernels that read tables (``<kernel>_<device>.json``)
TABLE_KERNELS = ("gemv", "gemv_fused", "prefill_attention", "fp8_gemm")


def tables_summary(name: str) -> str:
    """One start-up line on whose tables the device called ``name`` (from :func:`device_name`)
    reads: "own" when every kernel's is its own, else per kernel the device measured
    ("gemv: NVIDIA H200, ...") or "none" (the kernel's built-in tiles or cuBLAS)."""
    sources = {}
    for kernel in TABLE_KERNELS:
        source = table_device(kernel, name)
        sources[kernel] = source if table_path(kernel, source).exists() else "none"
    if all(v == name for v in sources.values()):
        return "own"
    return ", ".join(f"{k}: {v}" for k, v in sources.items())
