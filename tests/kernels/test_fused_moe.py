"""fused_moe (Triton) against the torch reference (one expert at a time), under the interpreter.

Unaligned token counts (1, 5, 37 and, past the one-program routing, 70 and 129), top-k 1, 2 and
8, experts that get no token, every token on one expert, float32/bfloat16/float16, strided
router logits, hidden sizes that are not a multiple of the K tile and intermediate sizes that
are not a multiple of the N tile. Every case also checks the blocked layout itself: each
(token, slot) pair sits exactly once in a block of its expert, blocks hold only their expert's
pairs, every block but an expert's last is full, and unused blocks are marked -1.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import (
    FUSED_ROUTE_MAX_TOKENS,
    fused_moe,
    fused_moe_config,
    max_blocks,
    moe_experts,
    moe_route_align,
    moe_workspace,
)
from kernels.reference import fused_moe_ref, moe_experts_ref, moe_route_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _inputs(t, e, h, i, dtype, g, logits_fn=None):
    x = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if logits_fn is not None:
        logits = logits_fn(logits)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype)
    return x, logits.to(dtype), w13, w2


def check_layout(ws) -> None:
    """The blocked layout holds each pair once, in a block of its own expert."""
    t, k, bm = ws.num_tokens, ws.top_k, ws.block_m
    ids = ws.topk_ids.long().flatten().cpu()
    experts = ws.block_expert.long().cpu()
    rows = ws.block_rows.long().cpu()
    pairs = ws.sorted_pairs.long().cpu().view(-1, bm)
    seen = []
    last_used = -1
    for b in range(experts.shape[0]):
        if experts[b] < 0:
            assert rows[b] == 0
            continue
        assert b == last_used + 1, "used blocks are contiguous from block 0"
        last_used = b
        assert 1 <= rows[b] <= bm
        p = pairs[b, : rows[b]]
        assert (ids[p] == experts[b]).all(), "a block holds only its expert's pairs"
        nxt = experts[b + 1].item() if b + 1 < experts.shape[0] else -1
        if nxt == experts[b]:
            assert rows[b] == bm, "only an expert's last block is partial"
        seen.append(p)
    seen = torch.cat(seen) if seen else torch.empty(0, dtype=torch.long)
    assert sorted(seen.tolist()) == list(range(t * k)), "every pair exactly once"
    assert experts.shape[0] == max_blocks(t, ws.num_experts, k, bm)


def _skew(expert: int):
    """Logits that send every token's first choice to ``expert``."""

    def fn(logits):
        logits[:, expert] += 50.0
        return logits

    return fn


def _holes(logits):
    """Experts 1, 2 and 5 never chosen."""
    logits[:, [1, 2, 5]] = -1e4
    return logits


CASES = [
    # T, E, k, H, I, dtype, renormalize, logits
    (1, 8, 2, 64, 32, torch.float32, True, None),
    (5, 16, 8, 64, 32, torch.float32, False, None),
    (37, 8, 2, 64, 48, torch.float32, True, _holes),
    (37, 8, 1, 48, 32, torch.bfloat16, False, _skew(3)),
    (70, 8, 2, 64, 32, torch.float32, True, None),
    (129, 4, 1, 32, 16, torch.float32, False, _skew(2)),
    (16, 128, 8, 32, 16, torch.bfloat16, True, None),
    (23, 8, 4, 80, 40, torch.float16, True, _holes),
]


@pytest.mark.parametrize("t,e,k,h,i,dtype,renorm,logits_fn", CASES)
def test_fused_moe_matches_reference(device, t, e, k, h, i, dtype, renorm, logits_fn):
    g = torch.Generator().manual_seed(1000 * t + 10 * e + k)
    x, logits, w13, w2 = _inputs(t, e, h, i, dtype, g, logits_fn)
    x, logits, w13, w2 = (a.to(device) for a in (x, logits, w13, w2))
    ws = moe_workspace(t, e, k, h, i, dtype, device)
    assert (ws.route_programs == 1) == (t <= FUSED_ROUTE_MAX_TOKENS)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, logits, w13, w2, renorm, out, ws)

    ref_w, ref_ids = moe_route_ref(logits, k, renorm)
    torch.testing.assert_close(ws.topk_weights, ref_w, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:
        assert torch.equal(ws.topk_ids.long(), ref_ids)
    else:  # 16-bit logits tie; the kernel takes the lowest expert, torch.topk any of them
        probs = torch.softmax(logits.float(), -1)
        chosen = probs.gather(1, ws.topk_ids.long())
        torch.testing.assert_close(chosen, probs.gather(1, ref_ids), rtol=0, atol=0)
        assert (ws.topk_ids.sort(1).values.diff(dim=1) > 0).all(), "distinct experts per token"
    check_layout(ws)
    if dtype == torch.float32:
        ref = fused_moe_ref(x, logits, w13, w2, k, renorm)
    else:  # the experts of the kernel's (tied) choice
        ref = moe_experts_ref(x, w13, w2, ws.topk_weights, ws.topk_ids.long())
    assert not out.isnan().any()
    assert _rel(out, ref) < TOL[dtype], _rel(out, ref)


def test_all_tokens_on_one_expert_and_strided_logits(device):
    """Top-1 with every token on expert 6: one expert owns all blocks (several of them); the
    logits are a strided view (a column slice of a wider tensor)."""
    t, e, k, h, i = 40, 8, 1, 32, 16
    g = torch.Generator().manual_seed(5)
    x, _, w13, w2 = _inputs(t, e, h, i, torch.float32, g)
    wide = torch.randn(t, 2 * e, generator=g)
    wide[:, 6] += 50.0
    logits = wide[:, :e]
    xd, logits, w13d, w2d = (a.to(device) for a in (x, logits, w13, w2))
    ws = moe_route_align(logits, True, moe_workspace(t, e, k, h, i, torch.float32, device))
    assert (ws.topk_ids == 6).all()
    assert ws.block_expert[: -(-t // ws.block_m)].eq(6).all()
    check_layout(ws)
    out = moe_experts(xd, w13d, w2d, ws, torch.empty_like(xd))
    ref = moe_experts_ref(x, w13, w2, torch.ones(t, 1), torch.full((t, 1), 6))
    assert _rel(out.cpu(), ref) < 1e-5


def test_experts_with_given_routing(device):
    """moe_experts alone on a layout from moe_route_align, against the loop over experts with
    the same weights and ids (block size 32 via a config override)."""
    t, e, k, h, i = 50, 16, 2, 64, 32
    g = torch.Generator().manual_seed(9)
    x, logits, w13, w2 = _inputs(t, e, h, i, torch.float32, g)
    cfg = fused_moe_config(t, e, k, h, i, torch.float32, torch.device(device))
    cfg["BLOCK_M"] = 32
    ws = moe_workspace(t, e, k, h, i, torch.float32, device, config=cfg)
    moe_route_align(logits.to(device), False, ws)
    check_layout(ws)
    xd = x.to(device)
    out = moe_experts(xd, w13.to(device), w2.to(device), ws, torch.empty_like(xd))
    ref = moe_experts_ref(x, w13, w2, ws.topk_weights.cpu(), ws.topk_ids.long().cpu())
    assert _rel(out.cpu(), ref) < 1e-5


def test_zero_tokens(device):
    ws = moe_workspace(0, 8, 2, 32, 16, torch.float32, device)
    x = torch.empty(0, 32, device=device)
    out = fused_moe(
        x,
        torch.empty(0, 8, device=device),
        torch.zeros(8, 32, 32, device=device),
        torch.zeros(8, 32, 16, device=device),
        True,
        torch.empty_like(x),
        ws,
    )
    assert out.shape == (0, 32)


def test_launcher_rejects_bad_inputs(device):
    t, e, k, h, i = 4, 8, 2, 32, 16
    ws = moe_workspace(t, e, k, h, i, torch.float32, device)
    x = torch.zeros(t, h, device=device)
    logits = torch.zeros(t, e, device=device)
    w13 = torch.zeros(e, 2 * i, h, device=device)
    w2 = torch.zeros(e, h, i, device=device)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="router_logits"):
        fused_moe(x, logits[:, :4], w13, w2, True, out, ws)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, logits, w13[:, :, :16], w2, True, out, ws)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, logits, w13, w2[:, :, :8], True, out, ws)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, logits, w13.half(), w2.half(), True, out, ws)
    with pytest.raises(ValueError, match="hidden"):
        fused_moe(x[:3], logits, w13, w2, True, out, ws)
    with pytest.raises(ValueError, match="top_k"):
        moe_workspace(t, e, e + 1, h, i, torch.float32, device)


def test_config_is_static_and_covers_block_sizes():
    """The CUDA table: block rows grow with the pairs per expert; both GEMMs share BLOCK_M."""
    cuda = torch.device("cuda")
    sizes = [
        fused_moe_config(t, 128, 8, 2048, 768, torch.bfloat16, cuda)["BLOCK_M"]
        for t in (1, 16, 64, 256, 1024, 4096)
    ]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128
    a = fused_moe_config(7, 128, 8, 2048, 768, torch.bfloat16, cuda)
    assert a == fused_moe_config(7, 128, 8, 2048, 768, torch.bfloat16, cuda)
    for t in (1, 64, 4096):
        cfg = fused_moe_config(t, 128, 8, 2048, 768, torch.bfloat16, cuda)
        assert 768 % cfg["gate_up"]["BLOCK_N"] == 0 and 2048 % cfg["down"]["BLOCK_N"] == 0
