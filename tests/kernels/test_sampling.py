"""sample_tokens (Triton Gumbel-max sampling) against torch.argmax and sample_tokens_ref.

Under the interpreter every program costs milliseconds, so sizes are small. The distribution
test draws from the pure-torch reference (cheap, many draws), which the kernel matches bit for
bit on the same (seed, offset) pairs (checked here on fewer rows), plus a small direct check.
"""

import math
from collections import Counter

import pytest
import torch

from kernels.reference import sample_tokens_ref, sampling_uniforms_ref
from kernels.sampling import choose_sampling_splits, sample_tokens

BLOCK = {"BLOCK_V": 1024}


def run(logits, temp, seeds, offsets, num_splits=None, config=BLOCK):
    dev = logits.device
    n = logits.shape[0]
    out = torch.full((n,), -7, dtype=torch.int64, device=dev)
    res = sample_tokens(
        logits,
        temp.to(dev),
        seeds.to(dev),
        offsets.to(dev),
        out,
        num_splits=num_splits,
        config=config,
    )
    assert res is out
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,num_splits", [(4096, 1), (3000, 3), (77, None)])
def test_greedy_matches_argmax(device, dtype, vocab, num_splits):
    g = torch.Generator().manual_seed(vocab + num_splits if num_splits else 5)
    n = 6
    # a wider buffer: row stride != vocab; coarse values give many ties
    buf = torch.randn(n, vocab + 5, generator=g)
    buf[:3] = torch.randint(-3, 3, (3, vocab + 5), generator=g).float()
    buf[3, 1500 % vocab :] = float("-inf")  # a -inf tail
    buf[4] = float("-inf")  # a whole row of -inf: index 0, as torch.argmax
    buf[5, -40 % vocab] = 1e4  # one large value late in the row
    logits = buf.to(dtype)[:, :vocab]
    assert logits.stride(0) == vocab + 5
    temp = torch.zeros(n)
    temp[1] = 1e-5  # still greedy
    got = run(logits.to(device), temp, torch.arange(n), torch.arange(n), num_splits)
    assert torch.equal(got, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_random_rows_match_reference(device, dtype, num_splits):
    """Bit-identical Philox uniforms: the kernel's draw equals the torch reference's."""
    g = torch.Generator().manual_seed(11 + num_splits)
    n, vocab = 6, 3000
    logits = (torch.randn(n, vocab, generator=g) * 2).to(dtype)
    logits[2, ::3] = float("-inf")
    temp = torch.tensor([1.0, 0.0, 0.7, 1.5, 0.05, 3.0])
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 987654321], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 2**33 + 7, 123, 1, 2**40], dtype=torch.int64)
    got = run(logits.to(device), temp, seeds, offsets, num_splits)
    assert torch.equal(got, sample_tokens_ref(logits, temp, seeds, offsets))
    assert got[2] % 3 != 0, "a -inf token was drawn"


def test_row_draw_independent_of_batch(device):
    """Same (seed, offset) and logits -> same token, whatever the other rows and the row
    position."""
    g = torch.Generator().manual_seed(3)
    vocab = 2048
    row = torch.randn(vocab, generator=g)
    alone = run(row[None].to(device), torch.tensor([0.9]), torch.tensor([42]), torch.tensor([17]))[
        0
    ]
    others = torch.randn(4, vocab, generator=g)
    for pos, splits in [(0, 1), (2, 2), (4, 1)]:
        logits = torch.cat([others[:pos], row[None], others[pos:]])
        temp = torch.tensor([0.5, 0.0, 1.0, 2.0])
        temp = torch.cat([temp[:pos], torch.tensor([0.9]), temp[pos:]])
        seeds = torch.cat(
            [torch.arange(100, 100 + pos), torch.tensor([42]), torch.arange(200, 204 - pos)]
        )
        offsets = torch.cat([torch.full((pos,), 17), torch.tensor([17]), torch.arange(4 - pos)])
        got = run(logits.to(device), temp, seeds, offsets, splits)
        assert got[pos] == alone, (pos, splits)


def test_offsets_and_seeds_change_the_draw(device):
    vocab = 64
    u0 = sampling_uniforms_ref(torch.tensor([5]), torch.tensor([0]), vocab)
    u1 = sampling_uniforms_ref(torch.tensor([5]), torch.tensor([1]), vocab)
    u2 = sampling_uniforms_ref(torch.tensor([6]), torch.tensor([0]), vocab)
    assert not torch.equal(u0, u1) and not torch.equal(u0, u2)
    assert float(u0.min()) >= 2.0**-24 and float(u0.max()) <= 1 - 2.0**-24
    # flat logits: draws over offsets 0..15 of one seed are spread over many tokens
    flat = torch.zeros(16, vocab)
    toks = run(
        flat.to(device),
        torch.ones(16),
        torch.full((16,), 5),
        torch.arange(16),
        config={"BLOCK_V": 64},
    )
    assert len(set(toks.tolist())) >= 8
    assert torch.equal(
        toks, sample_tokens_ref(flat, torch.ones(16), torch.full((16,), 5), torch.arange(16))
    )


def _chi_square_bound(df: int) -> float:
    return (
        df + 8 * math.sqrt(2 * df) + 25
    )  # far beyond the 1e-6 quantile; a wrong law gives hundreds


@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_reference_draws_follow_softmax(temp):
    """20000 draws of one row over offsets 0..19999 (the reference; the kernel matches it
    bitwise)."""
    vocab, n = 32, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    toks = sample_tokens_ref(
        logits.repeat(n, 1), torch.full((n,), temp), torch.full((n,), 1234), torch.arange(n)
    )
    probs = torch.softmax(logits.double() / temp, dim=0)
    counts = Counter(toks.tolist())
    stat = sum(
        (counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in range(vocab)
    )
    assert stat < _chi_square_bound(vocab - 1), stat
    wrong = torch.softmax(logits.double() / (temp * 1.25), dim=0)
    stat_w = sum(
        (counts.get(t, 0) - n * float(wrong[t])) ** 2 / (n * float(wrong[t])) for t in range(vocab)
    )
    assert stat_w > _chi_square_bound(vocab - 1), (
        "the bound is too loose to detect a wrong temperature"
    )


def test_kernel_draws_follow_softmax(device):
    """A direct (smaller) check of the kernel: 300 draws over 4 tokens of different probability."""
    n = 300
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).repeat(n, 1)
    toks = run(
        logits.to(device),
        torch.ones(n),
        torch.full((n,), 99),
        torch.arange(n),
        config={"BLOCK_V": 16},
    )
    probs = [0.1, 0.2, 0.3, 0.4]
    counts = Counter(toks.tolist())
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs))
    assert stat < _chi_square_bound(3), (stat, counts)


def test_choose_sampling_splits():
    assert choose_sampling_splits(256, 151936, 132) == 2
    assert choose_sampling_splits(1, 151936, 132) == 18  # capped: >= 4 tiles of 2048 per split
    assert choose_sampling_splits(1, 151936, 132, min_tiles_per_split=1) == 74
    assert choose_sampling_splits(1024, 151936, 132) == 1
    assert choose_sampling_splits(1, 100, 132) == 1
    assert choose_sampling_splits(0, 0, 132) == 1
    with pytest.raises(ValueError):
        choose_sampling_splits(1, 10, 0)


def test_rejects_bad_inputs(device):
    n, v = 2, 64
    ok = dict(
        logits=torch.zeros(n, v, device=device),
        temperature=torch.ones(n, device=device),
        seeds=torch.zeros(n, dtype=torch.int64, device=device),
        offsets=torch.zeros(n, dtype=torch.int64, device=device),
        out=torch.empty(n, dtype=torch.int64, device=device),
    )
    bad = [
        dict(logits=torch.zeros(n, v, dtype=torch.float16, device=device)),
        dict(logits=torch.zeros(n, v, 1, device=device)),
        dict(logits=torch.zeros(n, 0, device=device)),
        dict(logits=torch.zeros(v, n, device=device).t()),  # last dim not contiguous
        dict(temperature=torch.ones(n + 1, device=device)),
        dict(temperature=torch.ones(n, dtype=torch.float64, device=device)),
        dict(seeds=torch.zeros(n, dtype=torch.int32, device=device)),
        dict(offsets=torch.zeros(n, device=device)),
        dict(out=torch.empty(n, dtype=torch.int32, device=device)),
        dict(out=torch.empty(n + 1, dtype=torch.int64, device=device)),
        dict(temperature=torch.ones(n, device="meta")),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            sample_tokens(**{**ok, **change})
    with pytest.raises(ValueError):
        sample_tokens(**ok, num_splits=0)
    with pytest.raises(ValueError):
        sample_tokens(**ok, config={"BLOCK_V": 8})
    with pytest.raises(ValueError):
        sample_tokens(**ok, config={"BLOCK_V": 1000})
    assert sample_tokens(**ok).shape == (n,)
