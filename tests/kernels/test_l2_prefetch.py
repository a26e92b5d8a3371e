"""The L2 weight prefetch on a CUDA device (compiled kernels only: the interpreter has no L2):
the launcher runs on every range layout, a GEMV chain with the side-stream prefetch gives the
same bits as without, and a model's batch-1 decode step captured in a CUDA graph with the
switch on launches one prefetch per point and gives the same hidden states bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.l2_prefetch as l2
from bench.l2_prefetch_probe import chain
from bench.pdl_probe import capture_graph
from engine.layers import kernel_switches
from engine.loader.dummy import init_random_weights
from engine.models.qwen3 import Qwen3ForCausalLM
from kernels.interpreter import interpreting
from kernels.l2_prefetch import l2_prefetch
from tests.unit.test_model_compile import _config, _step

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the L2 prefetch needs a CUDA device (none here)"
)


@pytest.fixture
def compiled():
    if interpreting():
        pytest.skip("the prefetch kernel is inline PTX: set TRITON_INTERPRET=0")


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
    from bench.l2_prefetch_probe import HIDDEN, SHAPES

    x = torch.randn(1, HIDDEN, device=dev, dtype=bf)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=bf)
    layers = [[torch.randn(n, k, device=dev, dtype=bf) / k**0.5 for _, n, k in SHAPES]
              for _ in range(3)]  # fmt: skip
    side = torch.cuda.Stream()
    ref = capture_graph(lambda: chain(x, norm_w, layers, 0, side))[1].clone()
    for d in (1, 2):
        out = capture_graph(lambda d=d: chain(x, norm_w, layers, d, side))[1]
        assert torch.equal(out, ref), d


def test_model_decode_graph_same_bits_with_prefetch(compiled, monkeypatch):
    cfg = dataclasses.replace(_config(), dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg, 512, "triton").to("cuda")
    init_random_weights(model, 0, std=0.08)
    model = model.to(torch.bfloat16).eval()
    ids, pos, meta = _step(torch.Generator().manual_seed(3), [1], [37])
    ids, pos = ids.cuda(), pos.cuda()
    meta = dataclasses.replace(
        meta,
        **{
            f: getattr(meta, f).cuda()
            for f in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q")
        },  # fmt: skip
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    caches0 = [
        tuple(torch.randn(48, 16, 2, 16, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2))
        for _ in range(cfg.num_hidden_layers)
    ]  # fmt: skip
    l2.warm_up(torch.device("cuda"))  # before counting: the warm-up launch is not a point's
    launches = []
    real = l2.l2_prefetch  # looked up at each point (a lazy import: no Triton on a CPU server)
    monkeypatch.setattr(l2, "l2_prefetch", lambda ts: (launches.append(len(ts)), real(ts)))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(kernel_switches, "L2_PREFETCH", on)
        monkeypatch.setattr(kernel_switches, "L2_PREFETCH_DISTANCE", 2)
        caches = [(k.clone(), v.clone()) for k, v in caches0]
        launches.clear()
        with torch.inference_mode():
            outs[on] = capture_graph(lambda c=caches: model(ids, pos, c, meta))[1].clone()
        # the warm-up runs eagerly (no prefetch); the capture launches one per point
        assert launches == ([1] * 4 * cfg.num_hidden_layers if on else []), launches
    assert torch.equal(outs[True], outs[False])
