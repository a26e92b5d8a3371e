"""apply_token_bitmask (Triton, under the interpreter on the CPU) against the torch reference, and
against a per-token loop over the bits."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.reference import apply_token_bitmask_ref
from kernels.token_bitmask import apply_token_bitmask


def _bits_ok(row: torch.Tensor, words: torch.Tensor) -> None:
    for j in range(row.numel()):
        allowed = (int(words[j // 32]) >> (j % 32)) & 1
        assert (row[j] == float("-inf")) == (not allowed), j


@pytest.mark.parametrize("vocab,block", [(1, 32), (37, 32), (300, 64), (1000, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_matches_reference(device, vocab, block, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    n = 6
    logits = torch.randn(n, vocab, generator=g).to(dtype)
    rows = torch.tensor([4, 0, 3], dtype=torch.int64)
    words = -(-vocab // 32) + 1  # one spare word, as llguidance returns
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    bitmask[1] = 0  # a row with nothing allowed
    ref = apply_token_bitmask_ref(logits.clone(), rows, bitmask)
    got = apply_token_bitmask(
        logits.clone().to(device), rows.to(device), bitmask.to(device), block_v=block
    )
    assert torch.equal(got.cpu(), ref), f"seed={seed}"
    for i, r in enumerate(rows.tolist()):
        _bits_ok(ref[r], bitmask[i])
    untouched = [i for i in range(n) if i not in rows.tolist()]
    assert torch.equal(ref[untouched], logits[untouched])


def test_bitmask_rejects_bad_shapes():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="cover"):
        apply_token_bitmask(logits, torch.tensor([0]), torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(
            logits, torch.tensor([0], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32)
        )
