"""store_kv_cache (Triton) against store_kv_cache_ref on fresh random inputs."""

import os

import pytest
import torch

from kernels.kv_cache import store_kv_cache
from kernels.reference import store_kv_cache_ref

CASES = [
    # T, H_kv, D, block_size, dtype
    (1, 1, 64, 16, torch.float32),
    (17, 2, 128, 16, torch.bfloat16),
    (40, 8, 64, 32, torch.float16),
    (15, 4, 128, 32, torch.float32),
    (33, 2, 64, 5, torch.bfloat16),  # block size that is not a power of two
]


@pytest.mark.parametrize("t,h_kv,d,block_size,dtype", CASES)
def test_store_matches_reference(device, t, h_kv, d, block_size, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    num_blocks = (t + block_size - 1) // block_size + 3
    # key/value as non-contiguous views of a fused projection output, like the model's
    kv = torch.randn(t, 2 * h_kv + 1, d, generator=g).to(dtype)
    key, value = kv[:, :h_kv], kv[:, h_kv + 1 :]
    k_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    if t > 2:
        slots[torch.randperm(t, generator=g)[: t // 4 + 1]] = -1  # padding tokens: not stored
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    store_kv_cache(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    assert torch.equal(k_dev.cpu(), k_ref), f"seed={seed}"
    assert torch.equal(v_dev.cpu(), v_ref), f"seed={seed}"


def test_store_rejects_bad_inputs(device):
    k_cache = torch.zeros(4, 16, 2, 64, device=device)
    key = torch.zeros(3, 2, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError):
        store_kv_cache(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError):
        store_kv_cache(key.half(), key.half(), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError):
        store_kv_cache(
            torch.zeros(3, 4, 64, device=device),
            torch.zeros(3, 4, 64, device=device),
            k_cache,
            k_cache.clone(),
            slots,
        )
