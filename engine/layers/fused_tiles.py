"""The tiles of a fused small-M GEMV for one layer (:mod:`engine.layers.fused_linear`), as a
function Dynamo treats as a constant (``torch.compiler.assume_constant_result``): it reads the
environment and the device's table, which a traced forward must not do, so Dynamo calls it
while tracing and puts its result in the graph. Its own module because the decorator imports
``torch._dynamo`` (and with it Triton), which a CPU server must not import: the caller imports
this module only on the CUDA / interpreter path.
"""

from __future__ import annotations

import torch

from engine.layers import kernel_switches


@torch.compiler.assume_constant_result
def table_tiles(
    kind: str, mode: bool | None, switch: bool, m: int, n: int, k: int, device: str
) -> tuple[int, ...] | None:
    """The tiles of the fused ``kind`` GEMV for ``m`` rows (1 or 16: the table's bucket) times
    the ``[n, k]`` weight on ``device``, or None (auto mode: the switches off or no winning
    table entry; any mode: a device the kernel does not run on). Reads the environment and the
    table, so Dynamo calls it while tracing and keeps its result as a constant."""
    if mode is None and not (kernel_switches.SMALL_M_GEMV and switch):
        return None
    from kernels.gemv import GemvConfig, triton_runs_on
    from kernels.gemv_fused import fused_gemv_config

    dev = torch.device(device)
    if not triton_runs_on(dev):
        return None
    cfg = fused_gemv_config(kind, m, n, k, dev)
    if cfg is None:
        if mode is None:
            return None
        cfg = GemvConfig()
    return (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages)
