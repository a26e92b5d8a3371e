"""The persistent GEMV chain of ``bench/grid_barrier_probe.py`` (issue 19's measurement of grid
barriers against kernel boundaries): its GEMV phases against a float32 torch chain of the same
bf16 weights, its barrier counters reset after a launch, and its argument checks. Under the
interpreter one program runs the whole chain (its barriers pass at once); on a CUDA device of
compute capability 9.0+ the SM count's programs run it, where a missing barrier or a stale
read would break the comparison."""

from __future__ import annotations

import pytest
import torch

from bench.grid_barrier_probe import layer_numel, persistent_chain, reference_chain, rows_gemv
from kernels.grid_barrier import resident_programs
from kernels.interpreter import interpreting

#: small Qwen-like dims (H, Q, A, I): every tile and block_k below divides them
DIMS = (64, 128, 64, 64)


def _weights(layers: int, device, gen) -> torch.Tensor:
    h, q, a, i = DIMS
    parts = []
    for _ in range(layers):
        for n, k in ((q, h), (h, a), (2 * i, h), (h, i)):
            parts.append(torch.randn(n * k, generator=gen) / k**0.5)
    return torch.cat(parts).to(torch.bfloat16).to(device)


@pytest.mark.parametrize(
    "layers,preload,tiles",
    [(1, 0, (16, 16, 16, 16)), (3, 0, (16, 16, 16, 16)), (2, 32, (16, 16, 16, 16)),
     (2, 64, (24, 7, 40, 5)), (2, 32, None)],
)  # fmt: skip
def test_chain_matches_torch_and_resets_its_counters(device, layers, preload, tiles):
    """Tiles that divide N, and odd ones (masked rows past a tile's count and past N); None:
    one tile per program (one program here: the whole N)."""
    gen = torch.Generator().manual_seed(1234 + layers)
    w = _weights(layers, device, gen)
    assert w.numel() == layers * layer_numel(*DIMS)
    x = torch.randn(256, generator=gen).to(torch.bfloat16).to(device)
    ref = reference_chain(w.cpu(), x.cpu(), layers, DIMS)
    a = x.clone()
    b = torch.zeros(256, dtype=torch.bfloat16, device=device)
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    compiled = device.type == "cuda" and not interpreting()
    # the SM count on a GPU (each program one tile here); the interpreter runs one program
    programs = torch.cuda.get_device_properties(device).multi_processor_count if compiled else 1
    out = persistent_chain(
        w, a, b, bar, layers, DIMS, tiles=tiles, programs=programs, block_k=32,
        num_warps=4, preload=preload,
    )  # fmt: skip
    got = out[: DIMS[0]].float().cpu()
    assert torch.isfinite(got).all()
    # float32 sums in another order, rounded to bf16 at every GEMV: some elements one bf16 ulp
    # apart (a missing barrier or the interpreter's truncating cast: 1e-2 and more)
    assert (got - ref).norm() / ref.norm() < 5e-3
    assert bar.tolist() == [0, 0]
    # a second launch from the reset counters gives the same bits
    a2 = x.clone()
    out2 = persistent_chain(
        w, a2, b, bar, layers, DIMS, tiles=tiles, programs=programs, block_k=32,
        num_warps=4, preload=preload,
    )  # fmt: skip
    assert torch.equal(out2[: DIMS[0]], out[: DIMS[0]])


def test_work_off_leaves_the_activations_alone(device):
    w = _weights(1, device, torch.Generator().manual_seed(7))
    a = torch.arange(256, dtype=torch.float32).to(torch.bfloat16).to(device)
    before = a.clone()
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    b = torch.zeros(256, dtype=torch.bfloat16, device=device)
    persistent_chain(w, a, b, bar, 1, DIMS, (16, 16, 16, 16), 1, 32, work=False, num_warps=4)
    assert torch.equal(a, before)
    assert bar.tolist() == [0, 0]


def test_refuses_bad_arguments(device):
    w = _weights(1, device, torch.Generator().manual_seed(3))
    buf = torch.zeros(256, dtype=torch.bfloat16, device=device)
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="needs a row"):
        persistent_chain(w, buf, buf, bar, 1, DIMS, (0, 16, 16, 16), 1, 32)
    with pytest.raises(ValueError, match="block_k"):
        persistent_chain(w, buf, buf, bar, 1, DIMS, (16, 16, 16, 16), 1, 48)
    with pytest.raises(ValueError, match="preload 48"):
        persistent_chain(w, buf, buf, bar, 1, DIMS, (16, 16, 16, 16), 1, 16, preload=48)
    with pytest.raises(ValueError, match="one program"):
        persistent_chain(w, buf, buf, bar, 1, DIMS, (16, 16, 16, 16), 2, 32, sync=False)


@pytest.mark.parametrize("n,k,rows", [(96, 64, 16), (100, 128, 7), (64, 64, 64)])
def test_rows_gemv_matches_torch(device, n, k, rows):
    """The one-launch-per-GEMV form of the chain's tiles (no PDL: the interpreter has none)."""
    gen = torch.Generator().manual_seed(n * k + rows)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(device)
    x = torch.randn(k, generator=gen).to(torch.bfloat16).to(device)
    y = torch.full((n + 8,), 7.0, dtype=torch.bfloat16, device=device)
    rows_gemv(w, x, y, rows, block_k=32, num_warps=4)
    ref = (w.float() @ x.float()).to(torch.bfloat16)
    assert (y[:n].float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()
    assert torch.equal(y[n:].float().cpu(), torch.full((8,), 7.0))  # nothing past N written
    with pytest.raises(ValueError, match="block_k"):
        rows_gemv(w, x, y, rows, block_k=48)


def test_resident_programs_from_registers_shared_memory_and_threads():
    """The residency bound a grid barrier needs: the scarcest of threads, registers (per warp,
    in 256s) and shared memory per SM, times the SMs; None where Triton does not report."""
    from types import SimpleNamespace as NS

    props = NS(
        multi_processor_count=132, max_threads_per_multi_processor=2048,
        regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
    )  # fmt: skip
    k = NS(n_regs=128, n_spills=0, metadata=NS(shared=1024))
    assert resident_programs(k, 8, props) == (2 * 132, "128 regs, 0 B spilled")  # registers
    k = NS(n_regs=255, n_spills=24, metadata=NS(shared=0))
    assert resident_programs(k, 8, props)[0] == 132  # 256 regs per thread: one CTA
    k = NS(n_regs=32, n_spills=0, metadata=NS(shared=100_000))
    assert resident_programs(k, 4, props)[0] == 2 * 132  # shared memory
    k = NS(n_regs=16, n_spills=0, metadata=NS(shared=0))
    assert resident_programs(k, 16, props)[0] == 4 * 132  # threads
    assert resident_programs(NS(), 4, props) == (None, "")


@pytest.mark.parametrize("programs,prefetch", [(3, False), (7, True), (5, False)])
def test_chain_with_few_programs_on_gpu(device, programs, prefetch):
    """On a GPU with a handful of programs, each walks several tiles per GEMV (the grid-stride
    loops' later iterations) and the L2 prefetch runs; the interpreter runs one program only."""
    if device.type != "cuda" or interpreting():
        pytest.skip("several programs need a GPU (the interpreter runs programs one by one)")
    gen = torch.Generator().manual_seed(programs)
    w = _weights(2, device, gen)
    x = torch.randn(256, generator=gen).to(torch.bfloat16).to(device)
    ref = reference_chain(w.cpu(), x.cpu(), 2, DIMS)
    a, b = x.clone(), torch.zeros(256, dtype=torch.bfloat16, device=device)
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    out = persistent_chain(
        w, a, b, bar, 2, DIMS, (16, 8, 16, 8), programs, 32, prefetch=prefetch, num_warps=4,
        preload=32,
    )  # fmt: skip
    got = out[: DIMS[0]].float().cpu()
    assert (got - ref).norm() / ref.norm() < 5e-3
    assert bar.tolist() == [0, 0]
