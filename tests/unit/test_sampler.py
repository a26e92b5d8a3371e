"""Sampler against a plain per-row reference (a loop over rows, straightforward torch ops).

The reference processes one row at a time: logit bias, min_tokens masking, repetition then
presence/frequency penalties, then temperature, top-k, top-p (smallest set of most likely
tokens reaching the mass, computed in float64) and min-p, each renormalising. Batches mix
rows of different parameters, so the vectorised per-row parameters are checked too.

Most tests run the default CPU backend (torch); the cheap ones also run the Triton kernel under
the interpreter (``backend`` fixture), where each sampled row costs milliseconds.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine.core.outputs import SampleOutput
from engine.core.request import Request, SamplingParams
from engine.worker.sampler import DeviceSamples, PendingSamples, Sampler

CPU = torch.device("cpu")
EOS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    return request.param


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is drawn from: ``softmax(filtered logits / T)``."""
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params])[:, None]
    return (Sampler(CPU)._filtered_logits(logits, params) / temp).softmax(dim=-1)


def sample(sampler: Sampler, logits, reqs, eos_ids) -> SampleOutput:
    """Launch, copy to the host and wait, as the model runner does."""
    dev = sampler(logits, reqs, eos_ids)
    assert isinstance(dev, DeviceSamples) and dev.token_ids.dtype == torch.int64
    pending = dev.to_host()
    assert isinstance(pending, PendingSamples)
    return pending.wait()


# --------------------------------------------------------------------------- reference
def ref_process(row: torch.Tensor, req: Request, eos_ids) -> torch.Tensor:
    """Bias, min_tokens, penalties on one row of logits (a loop over tokens)."""
    p = req.sampling_params
    x = row.clone().double()
    vocab = x.numel()
    for tok, bias in (p.logit_bias or {}).items():
        if 0 <= tok < vocab:
            x[tok] += bias
    if len(req.output_token_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        for tok in banned:
            if 0 <= tok < vocab:
                x[tok] = -math.inf
    if p.repetition_penalty != 1.0:
        for tok in set(req.prompt_token_ids) | set(req.output_token_ids):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(req.output_token_ids).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


def ref_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one (processed) row is sampled from, float64."""
    x = x.double()
    vocab = x.numel()
    if p.greedy:
        out = torch.zeros(vocab, dtype=torch.float64)
        out[int(x.argmax())] = 1.0
        return out
    probs = torch.softmax(x / p.temperature, dim=0)
    if 0 < p.top_k < vocab:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.argsort(probs, descending=True)[: p.top_k]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        keep = torch.zeros(vocab, dtype=torch.bool)
        mass = 0.0
        for tok in torch.argsort(probs, descending=True).tolist():
            if mass >= p.top_p:
                break
            keep[tok] = True
            mass += float(probs[tok])
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def make_req(rid, params, prompt=None, output=None, rng=None, vocab=64):
    rng = rng or random.Random(0)
    prompt = (
        prompt if prompt is not None else [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    )
    req = Request(rid, list(prompt), params, max_len=1 << 20)
    if output is None:
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
    req.output_token_ids = list(output)
    return req


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Any mix of the filters and processors (sometimes greedy)."""
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([-1, -1, 0, 1, 3, 10, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.2, 0.6, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.8, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        logit_bias=rng.choice(
            [None, {rng.randrange(vocab): rng.uniform(-5, 5), vocab + 3: 9.0, -1: 9.0}]
        ),
        min_tokens=rng.choice([0, 0, 5]),
        stop_token_ids=rng.choice([[], [rng.randrange(vocab)]]),
        ignore_eos=rng.random() < 0.2,
    )


def normalised(p: torch.Tensor) -> torch.Tensor:
    p = p.double()
    return p / p.sum(dim=-1, keepdim=True)


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    support = [t for t in range(probs.numel()) if probs[t] > 0]
    stat = sum(
        (counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support
    )
    return stat, max(len(support) - 1, 1)


def assert_chi_square_ok(counts: Counter, probs: torch.Tensor, n: int) -> None:
    allowed = {t for t in range(probs.numel()) if probs[t] > 0}
    assert set(counts) <= allowed, (
        f"sampled tokens outside the allowed set: {set(counts) - allowed}"
    )
    stat, df = chi_square(counts, probs, n)
    # far beyond the 1e-6 quantile for these df; a wrong distribution gives hundreds or more
    assert stat < df + 8 * math.sqrt(2 * df) + 25, f"chi-square {stat:.1f} with {df} dof"


# --------------------------------------------------------------------------- filtering
@pytest.mark.parametrize("seed", range(6))
def test_filtered_distribution_matches_reference(seed):
    """temperature, top_k, top_p, min_p and their combinations, rows of different params in one
    batch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 64
    n = 24
    logits = torch.randn(n, vocab, generator=gen) * rng.choice([1.0, 3.0])
    params = []
    for _ in range(n):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.25, 0.7, 1.0, 1.5]),
                top_k=rng.choice([-1, 0, 1, 2, 5, 20, vocab, vocab + 1]),
                top_p=rng.choice([1.0, 0.05, 0.3, 0.5, 0.8, 0.95]),
                min_p=rng.choice([0.0, 0.01, 0.1, 0.5]),
            )
        )
    got = normalised(filtered_probs(logits.clone(), params))
    for row, p in enumerate(params):
        ref = ref_probs(logits[row], p)
        torch.testing.assert_close(got[row], ref, atol=2e-6, rtol=1e-4, msg=f"row {row}: {p}")


@pytest.mark.parametrize("seed", range(4))
def test_small_top_k_batches_rank_only_the_top_k(seed, monkeypatch):
    """When every filtered row has a small top_k (Qwen3's default 20), the filter ranks the top
    k_max logits with torch.topk and never sorts the vocabulary, with the same result as the
    full sort (forced by TOP_K_SELECT_MAX = 0)."""
    import engine.worker.sampler as sampler_module

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, n = 5000, 12
    logits = torch.randn(n, vocab, generator=gen) * rng.choice([1.0, 4.0])
    params = [
        SamplingParams(
            temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=rng.choice([1, 2, 20, 50]),
            top_p=rng.choice([1.0, 0.3, 0.8, 0.95]),
            min_p=rng.choice([0.0, 0.05]),
        )
        for _ in range(n)
    ]
    sorted_full = torch.Tensor.sort

    def no_sort(*args, **kwargs):
        raise AssertionError("the vocabulary was sorted")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    fast = Sampler(CPU)._filtered_logits(logits.clone(), params)
    monkeypatch.setattr(torch.Tensor, "sort", sorted_full)
    monkeypatch.setattr(sampler_module, "TOP_K_SELECT_MAX", 0)
    full = Sampler(CPU)._filtered_logits(logits.clone(), params)
    assert torch.equal(fast.isinf(), full.isinf())
    torch.testing.assert_close(fast, full, atol=0, rtol=0)
    got = normalised(filtered_probs(logits.clone(), params))
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], ref_probs(logits[row], p), atol=2e-6, rtol=1e-4)


def test_unfiltered_row_keeps_its_whole_distribution_next_to_filtered_rows():
    """top_p=1 / top_k=-1 means no filtering, also when other rows of the batch filter.

    (float32 cumulative sums reach 1.0 before the tail of a large vocabulary; a row that asked
    for no top-p must not lose its tail because a neighbour asked for top-k.)
    """
    vocab = 20000
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(3, vocab, generator=gen) * 4
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.9)]
    batch = normalised(filtered_probs(logits.clone(), params))
    alone = normalised(filtered_probs(logits[:1].clone(), params[:1]))[0]
    full = torch.softmax(logits[0].double(), dim=0)
    assert int((batch[0] == 0).sum()) == 0, "tokens dropped from a row without top-k/top-p"
    torch.testing.assert_close(batch[0], alone, atol=1e-9, rtol=1e-5)
    torch.testing.assert_close(batch[0], full, atol=1e-9, rtol=1e-4)
    assert int((batch[1] > 0).sum()) == 5
    torch.testing.assert_close(batch[2], ref_probs(logits[2], params[2]), atol=2e-6, rtol=1e-4)


def test_each_filter_alone_keeps_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))  # order: 1, 3, 4, 2, 0

    def kept(**kw):
        probs = filtered_probs(logits.clone(), [SamplingParams(**kw)])[0]
        return {t for t in range(5) if probs[t] > 0}

    assert kept() == {0, 1, 2, 3, 4}
    assert kept(top_k=1) == {1}
    assert kept(top_k=3) == {1, 3, 4}
    assert kept(top_k=0) == kept(top_k=-1) == kept(top_k=5) == kept(top_k=50) == {0, 1, 2, 3, 4}
    assert kept(top_p=0.3) == {1}
    assert kept(top_p=0.6) == {1, 3}  # 0.4 < 0.6 <= 0.7
    assert kept(top_p=0.8) == {1, 3, 4}  # 0.7 < 0.8 <= 0.85
    assert kept(top_p=0.0001) == {1}  # always at least the most likely
    assert kept(min_p=0.3) == {1, 3, 4}  # >= 0.12
    assert kept(min_p=0.5) == {1, 3}  # >= 0.2
    assert kept(min_p=1.0) == {1}
    assert kept(top_k=3, top_p=0.5) == {1, 3}  # top_p over the renormalised top-k: 0.4/0.85 < 0.5
    # temperature sharpens or flattens before top_p
    assert kept(temperature=0.1, top_p=0.9) == {1}  # 0.4 ** 10 is 95 % of the mass
    assert kept(temperature=5.0, top_p=0.5) == {1, 3, 4}


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=1.8),
        dict(top_k=4),
        dict(top_p=0.7),
        dict(min_p=0.15),
        dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
        dict(
            temperature=1.3,
            top_k=8,
            presence_penalty=0.7,
            frequency_penalty=0.3,
            repetition_penalty=1.4,
            logit_bias={0: 1.5, 5: -2.0},
        ),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items() if k != "logit_bias"),
)
def test_sample_frequencies_match_reference(case):
    """End to end through ``Sampler.__call__``: many draws of one row, frequencies vs the
    reference."""
    torch.manual_seed(1234)
    vocab, n = 12, 20000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(99)) * 1.5
    params = SamplingParams(**case)
    req = make_req("r", params, prompt=[0, 1, 2, 1], output=[2, 5, 5, 7])
    expected = ref_probs(ref_process(base, req, frozenset()), params)
    logits = base.repeat(n, 1)
    reqs = [make_req(f"r{i}", params, prompt=[0, 1, 2, 1], output=[2, 5, 5, 7]) for i in range(n)]
    out = sample(Sampler(CPU), logits, reqs, frozenset())
    assert len(out.token_ids) == n
    assert_chi_square_ok(Counter(out.token_ids), expected, n)


def test_chi_square_check_detects_a_wrong_distribution():
    """The tolerance used above is not so loose that a clearly different distribution passes."""
    torch.manual_seed(5)
    vocab, n = 12, 20000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(99)) * 1.5
    reqs = [make_req(f"r{i}", SamplingParams(temperature=1.0), output=[]) for i in range(n)]
    out = sample(Sampler(CPU), base.repeat(n, 1), reqs, frozenset())
    wrong = ref_probs(base, SamplingParams(temperature=1.2))
    stat, df = chi_square(Counter(out.token_ids), wrong, n)
    assert stat > df + 8 * math.sqrt(2 * df) + 25


# --------------------------------------------------------------------------- processors
@pytest.mark.parametrize("seed", range(4))
def test_greedy_and_processed_logits_match_reference(seed, backend):
    """Bias, min_tokens, penalties: processed logits equal the reference; greedy takes their
    argmax."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    vocab, n = 40, 32
    eos = frozenset({EOS, 7})
    logits = torch.randn(n, vocab, generator=gen) * 2
    reqs = [make_req(f"r{i}", random_params(rng, vocab), rng=rng, vocab=vocab) for i in range(n)]
    for r in reqs[: n // 2]:
        r.sampling_params.temperature = 0.0
    ref = torch.stack([ref_process(logits[i], r, eos) for i, r in enumerate(reqs)])

    s = Sampler(CPU, backend)
    got = logits.clone()
    params = [r.sampling_params for r in reqs]
    s._apply_logit_bias(got, params, vocab)
    s._apply_min_tokens(got, reqs, eos, vocab)
    s._apply_penalties(got, reqs, vocab)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)

    out = sample(s, logits.clone(), reqs, eos)
    for i in range(n // 2):
        assert out.token_ids[i] == int(ref[i].argmax()), f"greedy row {i}"
    for i, r in enumerate(reqs):  # sampled tokens are always allowed by the reference
        assert ref_probs(ref[i], r.sampling_params)[out.token_ids[i]] > 0, f"row {i}"


def test_penalties_change_the_greedy_choice(backend):
    base = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0, 2.0, 0.5, -2.0]])

    def greedy(**kw):
        prompt = kw.pop("prompt", [0])
        output = kw.pop("output", [])
        req = make_req("r", SamplingParams(temperature=0.0, **kw), prompt=prompt, output=output)
        return sample(Sampler(CPU, backend), base.clone(), [req], frozenset()).token_ids[0]

    assert greedy() == 1
    assert greedy(output=[1]) == 1  # no penalty configured
    assert greedy(output=[1], presence_penalty=0.2) == 2  # 3.0 - 0.2 < 2.9
    assert greedy(output=[1], presence_penalty=0.05) == 1
    assert greedy(output=[1, 1], frequency_penalty=0.06) == 2  # 3.0 - 2 * 0.06 < 2.9
    assert greedy(output=[1], frequency_penalty=0.06) == 1  # counts matter: one use only
    assert greedy(output=[1, 2], presence_penalty=1.5) == 5  # both penalised below 2.0
    assert greedy(prompt=[1], repetition_penalty=1.2) == 2  # over the prompt too: 3.0 / 1.2
    assert (
        greedy(prompt=[1], presence_penalty=5.0, frequency_penalty=5.0) == 1
    )  # not over the prompt
    # repetition on a negative logit multiplies (pushes it further down); bias can lift it
    assert greedy(prompt=[4], logit_bias={4: 4.5}) == 4
    assert (
        greedy(prompt=[4], logit_bias={4: 4.5}, repetition_penalty=2.0) == 1
    )  # (-1 + 4.5) / 2 = 1.75
    assert greedy(logit_bias={7: 10.0}) == 7
    assert greedy(logit_bias={99: 100.0, -5: 100.0}) == 1  # out of the vocabulary: ignored


def test_logit_bias_matches_reference_per_row():
    vocab = 16
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen)
    params = [
        SamplingParams(logit_bias={1: 2.0, 5: -100.0}),
        SamplingParams(),
        SamplingParams(logit_bias={1: -0.5}),
    ]
    got = logits.clone()
    Sampler(CPU)._apply_logit_bias(got, params, vocab)
    expect = logits.clone()
    expect[0, 1] += 2.0
    expect[0, 5] -= 100.0
    expect[2, 1] -= 0.5
    assert torch.equal(got, expect)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 10
    eos = frozenset({EOS})
    base = torch.zeros(1, vocab)
    base[0, EOS] = 5.0  # EOS by far the most likely
    base[0, 8] = 4.0  # then a stop token
    base[0, 2] = 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    for n_out, expect in [(0, 2), (1, 2), (2, 2), (3, EOS), (7, EOS)]:
        req = make_req("r", params, prompt=[1], output=[0] * n_out)
        assert sample(Sampler(CPU), base.clone(), [req], eos).token_ids[0] == expect, n_out
    # ignore_eos: EOS is not masked (it does not end the request anyway), stop ids still are
    p2 = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8], ignore_eos=True)
    assert (
        sample(
            Sampler(CPU), base.clone(), [make_req("r", p2, prompt=[1], output=[])], eos
        ).token_ids[0]
        == EOS
    )
    base2 = base.clone()
    base2[0, EOS] = -1.0
    assert (
        sample(Sampler(CPU), base2, [make_req("r", p2, prompt=[1], output=[])], eos).token_ids[0]
        == 2
    )
    # random sampling below min_tokens never draws them, mixed with rows that may
    torch.manual_seed(0)
    flat = torch.zeros(400, vocab)
    reqs = [
        make_req(
            f"r{i}",
            SamplingParams(temperature=1.0, min_tokens=2 if i % 2 else 0, stop_token_ids=[8]),
            prompt=[1],
            output=[0],
        )
        for i in range(400)
    ]
    toks = sample(Sampler(CPU), flat, reqs, eos).token_ids
    masked = Counter(t for i, t in enumerate(toks) if i % 2)
    free = Counter(t for i, t in enumerate(toks) if not i % 2)
    assert EOS not in masked and 8 not in masked
    assert free[EOS] > 0 and free[8] > 0


# --------------------------------------------------------------------------- seeds
def test_seed_gives_same_tokens_alone_and_in_a_batch(backend):
    """The draw of a seeded request depends on its seed and the index of the token in its output
    (``Request.sample_index``), not on the batch, the row position or the sampler instance."""
    vocab, steps = 50, 25
    gen = torch.Generator().manual_seed(8)
    params = SamplingParams(temperature=1.0, top_k=30, top_p=0.95, seed=1234)
    alone_s, batch_s = Sampler(CPU, backend), Sampler(CPU, backend)
    rng = random.Random(1)
    others = [random_params(rng, vocab) for _ in range(5)]
    others[0].seed = 99
    others[1].seed = None
    others[2].temperature = 0.0
    others[2].seed = 7
    alone, batched, other_seeded = [], [], []
    torch.manual_seed(0)
    for step in range(steps):
        logits = torch.randn(6, vocab, generator=gen)
        row = logits[3:4].clone()  # the seeded request's row
        req_a = make_req("x", params, prompt=[1, 2], output=alone)
        alone.append(sample(alone_s, row.clone(), [req_a], frozenset()).token_ids[0])
        reqs = [make_req(f"o{i}", p, prompt=[1], output=[]) for i, p in enumerate(others)]
        reqs.insert(3, make_req("x", params, prompt=[1, 2], output=batched))
        # a different position in the batch every step, other rows and params around it
        order = list(range(6))
        random.Random(step).shuffle(order)
        out = sample(batch_s, logits[order].clone(), [reqs[i] for i in order], frozenset())
        batched.append(out.token_ids[order.index(3)])
        other_seeded.append(out.token_ids[order.index(0)])
    assert alone == batched
    assert len(set(alone)) > 5  # really sampling
    # a second sampler with the same seed reproduces the sequence; another seed does not
    again, other = Sampler(CPU, backend), Sampler(CPU, backend)
    gen = torch.Generator().manual_seed(8)
    seq_again, seq_other = [], []
    for _ in range(steps):
        row = torch.randn(6, vocab, generator=gen)[3:4]
        seq_again.append(
            sample(
                again, row.clone(), [make_req("y", params, output=seq_again)], frozenset()
            ).token_ids[0]
        )
        p2 = SamplingParams(temperature=1.0, top_k=30, top_p=0.95, seed=4321)
        seq_other.append(
            sample(
                other, row.clone(), [make_req("z", p2, output=seq_other)], frozenset()
            ).token_ids[0]
        )
    assert seq_again == alone
    assert seq_other != alone


def test_seeded_rows_follow_the_distribution():
    _vocab, n = 6, 6000
    base = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0, -1.0])
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(n)]
    reqs = [make_req(f"s{i}", p, output=[]) for i, p in enumerate(params)]
    out = sample(Sampler(CPU), base.repeat(n, 1), reqs, frozenset())
    assert_chi_square_ok(Counter(out.token_ids), ref_probs(base, params[0]), n)


# --------------------------------------------------------------------------- logprobs
def test_logprobs_from_raw_distribution_and_sorted(backend):
    vocab, n = 30, 8
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(n, vocab, generator=gen) * 2
    raw = torch.log_softmax(logits.double(), dim=-1)
    rng = random.Random(2)
    reqs = []
    for i in range(n):
        p = random_params(rng, vocab)
        p.logprobs = [None, 0, 1, 5, 20][i % 5]
        p.temperature = [0.0, 0.6, 1.4][i % 3]
        reqs.append(make_req(f"r{i}", p, rng=rng, vocab=vocab))
    torch.manual_seed(3)
    out = sample(Sampler(CPU, backend), logits.clone(), reqs, frozenset({EOS}))
    for i, r in enumerate(reqs):
        k = r.sampling_params.logprobs
        if k is None:
            assert out.logprobs[i] is None
            continue
        chosen, alts = out.logprobs[i]
        tok = out.token_ids[i]
        assert chosen == pytest.approx(float(raw[i, tok]), abs=1e-5), (
            "logprob of the raw distribution"
        )
        assert len(alts) == k
        ids_ = [t for t, _ in alts]
        vals = [v for _, v in alts]
        assert len(set(ids_)) == k
        assert vals == sorted(vals, reverse=True), "alternatives sorted, most likely first"
        ref_v, ref_i = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert ids_ == ref_i.tolist()
        assert vals == pytest.approx(ref_v.tolist(), abs=1e-5)


def test_no_logprobs_requested_gives_none_and_processing_does_not_leak(backend):
    """Raw logprobs are unaffected by a huge bias that decides the sampled token."""
    vocab = 10
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    reqs = [
        make_req("a", SamplingParams(temperature=0.0, logit_bias={9: 50.0}, logprobs=2), output=[]),
        make_req("b", SamplingParams(temperature=0.0), output=[]),
    ]
    out = sample(Sampler(CPU, backend), logits.clone(), reqs, frozenset())
    assert out.token_ids[0] == 9
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[0][0] == pytest.approx(float(raw[0, 9]), abs=1e-6)
    assert out.logprobs[0][0] < -0.5
    assert out.logprobs[1] is None
    out2 = sample(Sampler(CPU, backend), logits[1:].clone(), [reqs[1]], frozenset())
    assert out2.logprobs == [None]


# --------------------------------------------------------------------------- API, backends
def test_bf16_logits_and_unprocessed_fast_path(backend):
    """bf16 logits are accepted (with and without processing) and are not modified."""
    vocab, n = 300, 4
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    before = logits.clone()
    plain = [
        make_req(f"p{i}", SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i), output=[])
        for i in range(n)
    ]
    out = sample(Sampler(CPU, backend), logits, plain, frozenset())
    assert torch.equal(logits, before)
    assert out.token_ids[1] == int(logits[1].float().argmax()) and out.token_ids[3] == int(
        logits[3].float().argmax()
    )
    processed = [
        make_req("q0", SamplingParams(temperature=0.0, logit_bias={7: 100.0}), output=[]),
        make_req("q1", SamplingParams(temperature=0.7, top_k=1, logprobs=2), output=[]),
    ]
    out = sample(Sampler(CPU, backend), logits[:2], processed, frozenset())
    assert out.token_ids == [7, int(logits[1].float().argmax())]
    raw = torch.log_softmax(logits[1].double(), dim=-1)
    assert out.logprobs[1][0] == pytest.approx(float(raw[out.token_ids[1]]), abs=1e-4)


def test_unseeded_rows_reproducible_under_torch_manual_seed(backend):
    vocab, n = 40, 6
    logits = torch.zeros(n, vocab)
    reqs = [make_req(f"u{i}", SamplingParams(temperature=1.0), output=[]) for i in range(n)]
    runs = []
    for _ in range(2):
        torch.manual_seed(77)
        s = Sampler(CPU, backend)
        runs.append([sample(s, logits.clone(), reqs, frozenset()).token_ids for _ in range(3)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1], "unseeded rows get fresh noise every call"
    assert len(set(runs[0][0])) > 1, "unseeded rows of one call do not share their noise"


def test_pending_samples_on_cpu():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    reqs = [make_req(f"r{i}", SamplingParams(temperature=0.0), output=[]) for i in range(2)]
    dev = Sampler(CPU)(logits, reqs, frozenset())
    assert dev.chosen_logprobs is None and dev.top_ids is None
    pending = dev.to_host()
    out = pending.wait()
    assert out is pending.wait()
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.logprobs == [None, None]


def test_backend_selection(monkeypatch):
    assert Sampler(CPU).backend == "torch"
    with pytest.raises(ValueError):
        Sampler(CPU, "cuda-magic")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError):
        Sampler(CPU, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Sampler(CPU, "triton").backend == "triton"
