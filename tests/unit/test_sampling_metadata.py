"""The sampler's per-composition cache (``SamplingMetadata``) and its fresh-seed stream.

The cached path must give exactly what rebuilding every step gives: a sampler that reuses its
metadata is run against one whose metadata is dropped before every call, from the same seed,
on the same logits, while requests join, leave, are reordered, swapped for another request of
the same batch size, and preempted (the same request object back, with its outputs); their
host state (outputs, so ``min_tokens``, penalties and ``sample_index``) advances between steps.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.request import Request, SamplingParams
from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SeedStream

CPU = torch.device("cpu")
VOCAB = 64
EOS = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _draw(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63 - 1, size=n, dtype=np.int64, endpoint=True)


@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_seed_stream_is_the_per_call_stream(chunk):
    sizes = [1, 0, 3, 7, 256, 1, 600, 2, 1, 1, 40]
    direct = np.random.Generator(np.random.PCG64(11))
    stream = SeedStream(np.random.Generator(np.random.PCG64(11)), chunk=chunk)
    for n in sizes:
        got = stream.take(n)
        assert got.dtype == np.int64 and got.shape == (n,)
        np.testing.assert_array_equal(got, _draw(direct, n))
        got[:] = -1  # the caller owns what it took: later seeds are unaffected


def _requests(rng: random.Random) -> list[Request]:
    """Requests of different sampling parameters (seeded and not, logprobs, filters,
    min_tokens, penalties, greedy)."""
    params = [
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=1.4),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, min_tokens=3),
        SamplingParams(temperature=1.1, top_p=0.8, seed=2**70 + 3, logprobs=0),
        SamplingParams(temperature=0.5, presence_penalty=0.6, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, min_p=0.1, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, seed=9),
    ]
    reqs = []
    for i, p in enumerate(params):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        reqs.append(Request(f"r{i}", prompt, p, max_len=1 << 20))
    return reqs


def _compositions(reqs: list[Request]) -> list[list[Request]]:
    a, b, c, d, e, f, g, h = reqs
    return [
        [c, h],  # all greedy
        [c, h],
        [h],
        [a, b, c],
        [a, b, c],  # unchanged: the cache is reused
        [a, b, c, d],  # d joins
        [a, b, c, d],
        [b, c, d],  # a leaves
        [d, c, b],  # same requests, another order
        [b, c, e],  # same size, another member
        [b, c, e],
        [f, g, e, a],
        [f, g, e, a],
        [f, g, a],  # e preempted ...
        [f, g, a, e],  # ... and back (the same object, its outputs kept)
        [f, g, a, e],
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cached_metadata_samples_as_rebuilt(backend):
    import os

    device = CPU  # the triton sampler on CPU tensors under the interpreter, else on the GPU
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        if not torch.cuda.is_available():
            pytest.skip("the triton sampler needs CUDA or TRITON_INTERPRET=1")
        device = torch.device("cuda")
    torch.manual_seed(7)
    cached = Sampler(device, backend)
    torch.manual_seed(7)
    rebuilt = Sampler(device, backend)
    rng = random.Random(0)
    reqs = _requests(rng)
    gen = torch.Generator().manual_seed(1)
    previous = None
    for step, rows in enumerate(_compositions(reqs)):
        logits = (torch.randn(len(rows), VOCAB, generator=gen) * 3).to(device)
        rebuilt._metadata = None  # the uncached path: built from the requests every step
        want = rebuilt(logits.clone(), rows, frozenset({EOS})).to_host().wait()
        got = cached(logits.clone(), rows, frozenset({EOS})).to_host().wait()
        assert got.token_ids == want.token_ids, step
        assert got.logprobs == want.logprobs, step
        if all(r.sampling_params.greedy for r in rows):  # and no processors: plain argmax
            assert got.token_ids == logits.argmax(dim=-1).cpu().tolist(), step
        meta = cached._metadata
        assert [r.request_id for r in meta.requests] == [r.request_id for r in rows]
        if previous is not None:  # reused exactly while the rows are the same objects
            old = previous.requests
            same = len(old) == len(rows) and all(x is y for x, y in zip(old, rows))
            assert (meta is previous) == same, step
        previous = meta
        for req, tok in zip(rows, got.token_ids):  # as update_from_output appends them
            req.output_token_ids.append(tok)


def test_matches_compares_identity_and_vocab():
    reqs = _requests(random.Random(1))
    meta = SamplingMetadata(reqs[:3], VOCAB)
    assert meta.matches(list(reqs[:3]), VOCAB)
    assert not meta.matches(reqs[:3], VOCAB + 1)
    assert not meta.matches(reqs[:2], VOCAB)
    assert not meta.matches([reqs[1], reqs[0], reqs[2]], VOCAB)
    twin = Request("r0", list(reqs[0].prompt_token_ids), reqs[0].sampling_params, max_len=1 << 20)
    assert not meta.matches([twin, reqs[1], reqs[2]], VOCAB)  # an equal but other object


def test_metadata_facts():
    reqs = _requests(random.Random(2))
    meta = SamplingMetadata(reqs, VOCAB)
    assert meta.temperatures == [0.9, 1.4, 0.0, 0.7, 1.1, 0.5, 1.0, 0.0]
    assert meta.logprob_k == [None, None, 2, None, 0, None, None, None] and meta.any_logprobs
    assert not meta.all_greedy and SamplingMetadata([reqs[2], reqs[7]], VOCAB).all_greedy
    assert meta.filter_rows == [3, 4, 6]
    assert meta.min_tokens_rows == [3]
    assert meta.any_penalties and meta.any_logit_bias
    assert meta.seeded_rows.tolist() == [0, 4, 7]
    assert meta.seed_values.tolist() == [5, 3, 9]  # 2**70 + 3: its low 64 bits
    fresh = np.arange(8, dtype=np.int64) + 100
    assert meta.seeds(fresh).tolist() == [5, 101, 102, 103, 3, 105, 106, 9]
    assert meta.eos_masked()  # r3 has no output yet, min_tokens 3
    reqs[3].output_token_ids += [1, 2, 4]
    assert not meta.eos_masked()
    reqs[1].num_output_placeholders = 1
    assert meta.offsets().tolist() == [0, 1, 0, 3, 0, 0, 0, 0]
