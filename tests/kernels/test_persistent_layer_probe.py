"""The persistent decode-layer prototype of ``bench/persistent_layer_probe.py`` (issue 19)
against the torch composition of :mod:`kernels.reference`'s operations: the hidden state after
every layer and the k/v it stores in the paged caches. Under the interpreter one program runs
every phase (its grid barriers pass at once); on a CUDA device of compute capability 9.0+ the
SM count's programs run it, where a missing barrier or a stale read breaks the comparison."""

from __future__ import annotations

import pytest
import torch

from bench.persistent_layer_probe import (
    Scratch,
    layer_ref,
    layer_table,
    persistent_layers,
    setup,
)
from kernels.interpreter import interpreting

#: (H, HQ, HKV, D, FF): GQA groups of 2, a small head dim, FF unequal to H
DIMS = (64, 4, 2, 16, 96)


def _reference(wt, x0, kc, vc, bt, context, cos, sin, eps):
    """Every layer of ``wt`` by :func:`layer_ref` from ``x0``, on copies of the caches ``kc``/
    ``vc``: ``(hidden state, k caches, v caches)`` after the last layer."""
    kr, vr = [t.clone() for t in kc], [t.clone() for t in vc]
    ref = x0.clone()
    for layer in range(wt.layers):
        ref = layer_ref(ref, wt, layer, kr[layer], vr[layer], bt, context, cos, sin, eps)
    return ref, kr, vr


class _Case:
    """A two-layer case of :data:`DIMS` at ``context`` tokens over ``splits`` splits: its
    inputs (:func:`setup`, ``seed``), the torch reference after the last layer
    (:func:`_reference`: ``ref``, ``kr``, ``vr``), the program count (``programs``, else the SM
    count compiled on a GPU, else 1) and a fresh scratch."""

    def __init__(self, device, context, splits, seed, eps=1e-6, programs=None):
        self.layers, self.context, self.eps = 2, context, eps
        self.wt, self.kc, self.vc, self.bt, self.cos, self.sin, self.x0 = setup(
            self.layers, DIMS, context, 16, device, seed=seed
        )
        self.ref, self.kr, self.vr = _reference(
            self.wt, self.x0, self.kc, self.vc, self.bt, context, self.cos, self.sin, eps
        )
        self.compiled = device.type == "cuda" and not interpreting()
        self.programs = programs or (
            torch.cuda.get_device_properties(device).multi_processor_count if self.compiled else 1
        )
        self.scratch = Scratch(DIMS, splits, device)

    def run(self, x, kc=None, vc=None, scratch=None, **kw):
        """``persistent_layers`` on ``x`` (updated in place) over the case's caches (or
        ``kc``/``vc``) and scratch (or ``scratch``), ``kw`` its options."""
        persistent_layers(
            x, self.wt, self.kc if kc is None else kc, self.vc if vc is None else vc, self.bt,
            self.context, self.cos, self.sin, self.eps,
            self.scratch if scratch is None else scratch, self.programs, **kw,
        )  # fmt: skip

    def check_close(self, x, tol=1e-2):
        """``x`` within ``tol`` of the reference (relative norm), the caches' stored k/v (and
        nothing else) as the reference stored them, the barrier and merge counters back at
        zero."""
        rel = ((x.float() - self.ref.float()).norm() / self.ref.float().norm()).item()
        assert rel < tol, rel
        kerr = max((a.float() - b.float()).abs().max().item() for a, b in zip(self.kc, self.kr))
        verr = max((a.float() - b.float()).abs().max().item() for a, b in zip(self.vc, self.vr))
        assert kerr < 0.1 and verr < 0.1, (kerr, verr)
        assert self.scratch.bar.tolist() == [0, 0]
        assert self.scratch.count.tolist() == [0] * DIMS[2]


@pytest.mark.parametrize(
    "fuse_b,merge_e,pre_kv,merge_c,pre_w",
    [(0, 0, 0, 0, 0), (1, 0, 0, 0, 0), (1, 1, 0, 0, 0), (1, 0, 1, 0, 0), (1, 0, 1, 1, 0),
     (0, 0, 0, 1, 0), (1, 0, 1, 0, 1), (0, 0, 0, 0, 1), (1, 1, 0, 0, 1)],
)  # fmt: skip
@pytest.mark.parametrize("context,splits", [(37, 4), (16, 2), (5, 8), (150, 2), (17, 2), (1, 2)])
def test_layers_match_torch(device, context, splits, fuse_b, merge_e, pre_kv, merge_c, pre_w):
    """Every phase layout (B folded into C, D into E or C, K/V loaded during the wait, each
    GEMV's first weight chunk loaded during the wait -- under the interpreter the program's
    later tiles then load theirs in the loop): the
    new token in the first, a middle or the last split, splits left empty (context 5 over 8),
    splits longer than the preloaded keys (150 over 2), the new token alone in its split (17
    over 2) or in the context (1). Under the interpreter (one program, the reference's order
    of operations) the results are bit-equal; on a GPU sums run in another order."""
    case = _Case(device, context, splits, seed=context)
    x = case.x0.clone()
    case.run(
        x, block_k=32, block_t=16, fuse_b=bool(fuse_b), merge_e=bool(merge_e),
        pre_kv=bool(pre_kv), merge_c=bool(merge_c), pre_w=bool(pre_w),
    )  # fmt: skip
    if not case.compiled:
        assert torch.equal(x, case.ref)
        assert all(torch.equal(a, b) for a, b in zip(case.kc + case.vc, case.kr + case.vr))
    case.check_close(x)


@pytest.mark.parametrize(
    "late_r,early_res,row_sm,pre_kv,fuse_b,merge_e,merge_c",
    [(1, 0, 0, 1, 1, 0, 0), (0, 1, 0, 1, 1, 0, 0), (1, 1, 0, 1, 1, 0, 0), (0, 0, 1, 1, 1, 0, 0),
     (0, 0, 1, 0, 1, 0, 0), (1, 1, 1, 1, 1, 0, 0), (0, 0, 1, 0, 0, 0, 0), (0, 0, 1, 1, 1, 0, 1),
     (0, 0, 1, 0, 1, 1, 0)],
)  # fmt: skip
@pytest.mark.parametrize("context,splits", [(37, 4), (17, 2), (150, 2), (5, 8), (1, 2)])
def test_late_norm_scale_early_residual_row_softmax(
    device, context, splits, late_r, early_res, row_sm, pre_kv, fuse_b, merge_e, merge_c
):
    """``late_r`` (the RMSNorm scales applied to the dot products: float32, not the reference's
    bf16 rounding of the normalized input) and ``row_sm`` (the attention's online softmax per
    row of head-repeated tiles, merged per head: float32 sums in another order) close to the
    torch layers -- splits of several tiles (150 over 2), empty ones (5 over 8), the new token
    alone (1), with phase B separate (the queries read from ``q``), D folded into E or C;
    ``early_res`` alone (the residual rows loaded before the K loops) the same arithmetic:
    bit-equal under the interpreter. ``row_sm``'s float32 partials differ from the per-head
    loop's where a split holds several tiles (so the option reached the kernel)."""
    case = _Case(device, context, splits, seed=context + 5)
    x = case.x0.clone()
    caches = [t.clone() for t in case.kc + case.vc]
    flags = dict(
        fuse_b=bool(fuse_b), merge_e=bool(merge_e), merge_c=bool(merge_c), pre_kv=bool(pre_kv),
        pre_w=True, late_r=bool(late_r), early_res=bool(early_res), block_k=32, block_t=16,
    )  # fmt: skip
    case.run(x, row_sm=bool(row_sm), **flags)
    if row_sm and context == 150:  # two 16-token tiles per split: other float32 partials
        heads = Scratch(DIMS, splits, device)
        kh, vh = caches[: case.layers], caches[case.layers :]
        case.run(case.x0.clone(), kh, vh, heads, row_sm=False, **flags)
        assert not torch.equal(case.scratch.part, heads.part)
    if not case.compiled and not (late_r or row_sm):
        assert torch.equal(x, case.ref)
    if not case.compiled and late_r:
        assert not torch.equal(x, case.ref)  # the late scale's arithmetic did run
    case.check_close(x)


@pytest.mark.parametrize("pre_w", [0, 1])
@pytest.mark.parametrize("context,splits", [(37, 4), (150, 2)])
def test_wider_k_chunk_for_o_and_down(device, context, splits, pre_w):
    """``block_k_h`` (``BK_H``: the o and down projections' K chunk, here twice ``block_k``,
    their first chunk preloaded with ``pre_w``): the torch layers' results, bit-equal under the
    interpreter; a chunk that does not divide FF or HQ * D is refused."""
    case = _Case(device, context, splits, seed=context + 9)
    x = case.x0.clone()
    case.run(x, block_k=16, block_t=16, fuse_b=True, pre_kv=True, pre_w=bool(pre_w), block_k_h=32)
    if not case.compiled:
        assert torch.equal(x, case.ref)
    case.check_close(x)
    for bad in (64, 0):
        with pytest.raises(ValueError, match=f"block_k_h {bad} must be a power of two dividing"):
            case.run(case.x0.clone(), block_k=16, fuse_b=True, block_k_h=bad)


@pytest.mark.parametrize(
    "pre_kv,merge_c,late_r", [(1, 1, 1), (0, 0, 0), (1, 0, 0)]
)  # fmt: skip
@pytest.mark.parametrize("context,splits", [(37, 4), (150, 2), (17, 2), (5, 8), (1, 2)])
def test_attention_on_tensor_cores(device, context, splits, pre_kv, merge_c, late_r):
    """``dot_attn`` (``DOT``: the attention's per-head loop as ``tl.dot`` over the group's
    queries padded to 16 rows, the probabilities rounded to bf16 for the second product) close
    to the torch layers -- splits of several tiles (150 over 2), the new token alone in its
    split (17 over 2) or in the context (1), splits left empty (5 over 8), with and without the
    first tile preloaded and the merge in C; its float32 partials differ from the CUDA-core
    loop's (so the option reached the kernel), and nothing is stored past the heads' rows (the
    padding); refused with ``row_sm`` or 8-token tiles."""
    case = _Case(device, context, splits, seed=context + 13)
    # the partials' buffers end in 16 NaN guard rows: a padded query row stored past the last
    # group's heads would overwrite them
    hq = DIMS[1]
    sc = case.scratch
    part = torch.full((hq + 16, *sc.part.shape[1:]), float("nan"), device=device)
    ml = torch.full((hq + 16, *sc.ml.shape[1:]), float("nan"), device=device)
    sc.part, sc.ml = part[:hq], ml[:hq]
    x = case.x0.clone()
    caches = [t.clone() for t in case.kc + case.vc]
    flags = dict(
        fuse_b=True, pre_kv=bool(pre_kv), merge_c=bool(merge_c), pre_w=True,
        late_r=bool(late_r), block_k=32, block_t=16,
    )  # fmt: skip
    case.run(x, dot_attn=True, **flags)
    case.check_close(x, tol=2e-2)  # (p rounded to bf16: 2-10e-3 here, a bug 6e-2 or more)
    assert part[hq:].isnan().all() and ml[hq:].isnan().all()
    if context > 1:  # (one token: only the new one, from registers, not through tl.dot)
        loop = Scratch(DIMS, splits, device)
        kh, vh = caches[: case.layers], caches[case.layers :]
        case.run(case.x0.clone(), kh, vh, loop, dot_attn=False, **flags)
        assert not torch.equal(case.scratch.part, loop.part)
    for bad in (dict(row_sm=True), dict(block_t=8)):
        with pytest.raises(ValueError, match="dot_attn needs row_sm off"):
            case.run(case.x0.clone(), **{**flags, "dot_attn": True, **bad})


def test_merge_in_c_leaves_no_work_to_phase_d(device):
    """With ``merge_c`` the splits are merged in C, so leaving phase D's work out (``skip`` 8)
    changes nothing: the torch layers' result, bit-equal under the interpreter (without
    ``merge_c`` the same skip leaves the attention output unmerged)."""
    case = _Case(device, 150, 2, seed=21)
    flags = dict(block_k=32, block_t=16, fuse_b=True, pre_kv=True, skip=8)
    x = case.x0.clone()
    case.run(x, merge_c=True, **flags)
    if not case.compiled:
        assert torch.equal(x, case.ref)
    case.check_close(x)
    unmerged = case.x0.clone()
    case.run(unmerged, merge_c=False, **flags)
    assert not torch.allclose(unmerged.float(), case.ref.float(), rtol=1e-2, atol=1e-2)


def test_refuses_odd_splits(device):
    wt, kc, vc, bt, cos, sin, x0 = setup(1, DIMS, 8, 16, device)
    with pytest.raises(ValueError, match="splits = 3"):
        persistent_layers(
            x0, wt, kc, vc, bt, 8, cos, sin, 1e-6, Scratch(DIMS, 3, device), block_k=32
        )
    with pytest.raises(ValueError, match="pre_kv needs fuse_b$"):
        persistent_layers(
            x0, wt, kc, vc, bt, 8, cos, sin, 1e-6, Scratch(DIMS, 2, device), block_k=32,
            pre_kv=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="block_k 48"):
        persistent_layers(
            x0, wt, kc, vc, bt, 8, cos, sin, 1e-6, Scratch(DIMS, 2, device), block_k=48
        )


def test_skip_leaves_the_phase_work_out(device):
    """The timing mask: every phase left out leaves the hidden state as it was (no GEMV wrote
    it) and the caches untouched, the barriers still counted and reset."""
    wt, kc, vc, bt, cos, sin, x0 = setup(1, DIMS, 9, 16, device, seed=1)
    before_k = [t.clone() for t in kc]
    before_v = [t.clone() for t in vc]
    x = x0.clone()
    scratch = Scratch(DIMS, 2, device)
    persistent_layers(
        x, wt, kc, vc, bt, 9, cos, sin, 1e-6, scratch, block_k=32, block_t=16, fuse_b=True,
        skip=127,
    )  # fmt: skip
    assert torch.equal(x, x0)
    assert all(torch.equal(a, b) for a, b in zip(kc, before_k))
    assert all(torch.equal(a, b) for a, b in zip(vc, before_v))
    assert scratch.bar.tolist() == [0, 0]


def test_layer_table_refuses_unaligned_tensors(device):
    """The kernel loads through the table's addresses as 16-byte aligned contiguous rows."""
    wt, kc, vc, _bt, _cos, _sin, _x0 = setup(2, DIMS, 8, 16, device)
    table = layer_table(wt, kc, vc)
    assert table.shape == (2, 10) and table.dtype == torch.int64
    assert table[1, 0].item() == wt.wqkv[1].data_ptr()
    assert table[0, 9].item() == vc[0].data_ptr()
    wt.wo[1] = torch.zeros(DIMS[0] * DIMS[1] * DIMS[3] + 1, dtype=torch.bfloat16, device=device)[1:]
    with pytest.raises(ValueError, match="16-byte aligned"):
        layer_table(wt, kc, vc)


@pytest.mark.parametrize("programs", [3, 5])
@pytest.mark.parametrize(
    "fuse_b,merge_e,pre_kv,merge_c,pre_w",
    [(0, 0, 0, 0, 0), (1, 0, 1, 0, 0), (1, 0, 1, 1, 0), (1, 1, 0, 0, 0), (1, 0, 1, 0, 1)],
)  # fmt: skip
def test_layers_with_few_programs_on_gpu(device, programs, fuse_b, merge_e, pre_kv, merge_c, pre_w):
    """On a GPU with a handful of programs, each walks several GEMV tiles and attention items
    (the preloaded item, then the further ones; several splits merged by one program's
    arrivals); the interpreter runs one program only."""
    if device.type != "cuda" or interpreting():
        pytest.skip("several programs need a GPU (the interpreter runs programs one by one)")
    # 2 KV heads x 8 splits: several items per program
    case = _Case(device, 150, 8, seed=programs, programs=programs)
    x = case.x0.clone()
    case.run(
        x, block_k=32, block_t=16, fuse_b=bool(fuse_b), merge_e=bool(merge_e),
        pre_kv=bool(pre_kv), merge_c=bool(merge_c), pre_w=bool(pre_w),
    )  # fmt: skip
    case.check_close(x)


@pytest.mark.parametrize("programs", [0, 3])
@pytest.mark.parametrize("context", [1, 37, 300])
def test_l2_prefetch_changes_no_result_on_gpu(device, programs, context):
    """The bulk L2 prefetches (``prefetch`` 7: weight tiles of later phases, the next layer's
    keys/values) are hints: on a GPU the hidden state and caches are bit-equal to the launch
    without them (the SM count's programs, or 3, each then asking for several cache blocks),
    and within the reference's tolerance. The interpreter has no inline PTX (prefetch 0)."""
    if device.type != "cuda" or interpreting():
        pytest.skip("the bulk prefetch is inline PTX for sm_90 (no interpreter equivalent)")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    programs = programs or torch.cuda.get_device_properties(device).multi_processor_count
    layers, eps = 3, 1e-6
    wt, kc, vc, bt, cos, sin, x0 = setup(layers, DIMS, context, 16, device, seed=context)
    outs = []
    for pf in (0, 7):
        k2, v2 = [t.clone() for t in kc], [t.clone() for t in vc]
        x = x0.clone()
        info: dict = {}
        persistent_layers(
            x, wt, k2, v2, bt, context, cos, sin, eps, Scratch(DIMS, 4, device), programs,
            block_k=32, block_t=16, fuse_b=True, prefetch=pf, info=info,
        )  # fmt: skip
        # the prefetches are in the kernel that ran (a dropped flag would compare equal too)
        assert ("cp.async.bulk.prefetch.L2" in info["ptx"]) is (pf == 7)
        outs.append((x, k2, v2))
    (x0_, k0, v0), (x7, k7, v7) = outs
    assert torch.equal(x0_, x7)
    assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k7 + v7))
    ref, _kr, _vr = _reference(wt, x0, kc, vc, bt, context, cos, sin, eps)
    rel = ((x7.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, rel
