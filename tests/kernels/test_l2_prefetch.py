"""The L2 prefetch kernel of ``bench/l2_prefetch_probe.py`` (``kernels/l2_prefetch.py``): its
refusals and its no-op on the CPU; on a CUDA device (compiled kernels only: the interpreter has
no L2) it runs on every range layout and grid without writing, and a GEMV chain with the
side-stream prefetch captured in a CUDA graph gives the same bits as without (the fork and
join of the side stream are captured correctly)."""

from __future__ import annotations

import pytest
import torch

from bench.l2_prefetch_probe import HIDDEN, SHAPES, chain
from bench.pdl_probe import capture_graph
from kernels.interpreter import interpreting
from kernels.l2_prefetch import MAX_RANGES, l2_prefetch, prefetch_lines


@pytest.fixture
def compiled():
    if not torch.cuda.is_available():
        pytest.skip("the L2 prefetch needs a CUDA device (none here)")
    if interpreting():
        pytest.skip("the prefetch kernel is inline PTX: set TRITON_INTERPRET=0")


def test_refuses_what_it_cannot_fetch_and_skips_the_cpu():
    with pytest.raises(ValueError, match="at most"):
        l2_prefetch([torch.zeros(4)] * (MAX_RANGES + 1))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="program"):
        l2_prefetch([torch.zeros(4)], programs=0)
    l2_prefetch([torch.zeros(4), torch.zeros(0)])  # CPU tensors: nothing to launch, no error
    assert prefetch_lines(torch.zeros(64, dtype=torch.bfloat16)) == 1
    assert prefetch_lines(torch.zeros(65, dtype=torch.bfloat16)) == 2


def test_launcher_runs_on_one_to_four_ranges(compiled):
    dev = "cuda"
    ts = [torch.randn(n, device=dev).to(dt) for n, dt in
          ((1, torch.float32), (70_000, torch.bfloat16), (5_000_000, torch.bfloat16),
           (333, torch.uint8))]  # fmt: skip
    before = [t.clone() for t in ts]
    for k in range(1, 5):
        for programs in (1, 3, 16, 1000):
            l2_prefetch(ts[:k], programs)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))  # a hint: nothing written


def test_gemv_chain_same_bits_with_side_stream_prefetch(compiled):
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(1, HIDDEN, device=dev, dtype=bf)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=bf)
    layers = [[torch.randn(n, k, device=dev, dtype=bf) / k**0.5 for _, n, k in SHAPES]
              for _ in range(3)]  # fmt: skip
    side = torch.cuda.Stream()
    ref = capture_graph(lambda: chain(x, norm_w, layers, 0, side))[1].clone()
    for d in (1, 2):
        out = capture_graph(lambda d=d: chain(x, norm_w, layers, d, side))[1]
        assert torch.equal(out, ref), d
