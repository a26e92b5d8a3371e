"""The worker's host-to-device staging: packing several arrays into one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.worker.staging import PACK_ALIGN_BYTES, HostStaging, pack_offsets


@pytest.mark.parametrize("itemsize", [4, 8])
def test_pack_offsets_align_every_array_and_cover_it(itemsize):
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(0, 40, size=rng.integers(1, 7)).tolist()
        offsets, total = pack_offsets(sizes, itemsize)
        assert total >= max(1, sum(sizes))
        for i, (off, n) in enumerate(zip(offsets, sizes)):
            assert (off * itemsize) % PACK_ALIGN_BYTES == 0
            end = offsets[i + 1] if i + 1 < len(offsets) else total
            assert off + n <= end  # no overlap with the next array


def test_stage_many_round_trips_shapes_and_values():
    staging = HostStaging(torch.device("cpu"))
    rng = np.random.default_rng(1)
    for _ in range(20):
        arrays = [
            rng.integers(-(2**40), 2**40, size=s).astype(np.int64)
            for s in ([3], [0], [2, 5], [1], [7])
        ]
        out = staging.stage_many("x", arrays)
        for a, t in zip(arrays, out):
            assert t.dtype == torch.int64 and tuple(t.shape) == a.shape
            assert np.array_equal(t.numpy(), a)
            assert (t.storage_offset() * t.element_size()) % PACK_ALIGN_BYTES == 0
        assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one buffer, one copy
        tables = rng.integers(0, 1000, size=(4, 3)).astype(np.int32)
        bt, lens = staging.stage_many("y", [tables, np.arange(4, dtype=np.int32)])
        assert bt.stride(1) == 1 and np.array_equal(bt.numpy(), tables)
        assert lens.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="one dtype"):
        staging.stage_many("z", [np.zeros(2, np.int64), np.zeros(2, np.int32)])
