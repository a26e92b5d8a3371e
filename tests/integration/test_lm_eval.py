"""lm-evaluation-harness's own ``local-completions`` client (``LocalCompletionsAPI``) scoring
(context, continuation) pairs against the server: its log-likelihoods and is-greedy flags equal
a transformers float32 forward on the same tiny random checkpoint.

lm-eval's ``loglikelihood`` sends ``/v1/completions`` with the token ids of context +
continuation, ``echo: true``, ``logprobs: 1`` and ``max_tokens: 1``, then sums
``token_logprobs[ctxlen:-1]`` and calls a continuation greedy when each of its tokens' logprob is
the largest of its ``top_logprobs``. Before prompt log-probabilities existed those entries were
missing and every continuation scored 0 and "greedy".

lm-eval is installed by ``make install`` without its dependencies (``pip install --no-deps``:
its task machinery pulls datasets, pyarrow, scipy, scikit-learn...; the API client needs only
``aiohttp``, ``tenacity``, ``requests`` and ``tqdm``, which the test extras pin).
"""

from __future__ import annotations

import pytest
import torch

from tests.serverproc import ServerProcess

try:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
except ImportError as exc:  # pragma: no cover - visible reason in the test report
    pytest.skip(
        f"lm-eval's API client is not importable ({exc}); `make install` installs it",
        allow_module_level=True,
    )

CONTEXTS = [
    "The capital of France is",
    "Question: what is two plus two? Answer:",
    "A cat sat on the mat and the dog",
    "Once upon a time there was a small model that could only count to",
]
CONTINUATIONS = [" Paris", " four.", " ran away", " ten", " the lazy dog"]


@pytest.fixture(scope="module")
def served(tiny_served_checkpoint):
    path, hf = tiny_served_checkpoint
    # a 16-token step budget: every prompt here is computed over several steps (chunked prefill),
    # and pairs sharing a context would share prefix-cache blocks if scoring took hits
    srv = ServerProcess(
        "--model", path, "--served-model-name", "tiny", "--max-num-batched-tokens", "16"
    ).wait_ready()
    yield srv, path, hf
    srv.stop()


def _reference(hf, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Log-likelihood of ``cont`` after ``ctx`` and whether greedy decoding produces it
    (transformers, float32)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ctx + cont])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = logprobs[len(ctx) - 1 : len(ctx) + len(cont) - 1]
    ll = rows[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
    return ll, bool((rows.argmax(dim=-1) == torch.tensor(cont)).all())


def _greedy_pairs(lm, hf) -> list[tuple[str, str]]:
    """(context, continuation) pairs whose continuation is the model's greedy token, where the
    continuation's text re-encodes to that one token (lm-eval encodes context + continuation)."""
    pairs = []
    for context in CONTEXTS:
        ctx = lm.tok_encode(context)
        with torch.no_grad():
            greedy = int(hf(torch.tensor([ctx])).logits[0, -1].argmax())
        text = lm.tokenizer.decode([greedy])
        if text and lm._encode_pair(context, text)[1] == [greedy]:
            pairs.append((context, text))
    return pairs


def test_lm_eval_loglikelihood_equals_transformers(served):
    srv, path, hf = served
    lm = LocalCompletionsAPI(
        base_url=srv.base_url + "/v1/completions",
        model="tiny",
        tokenizer=path,
        tokenizer_backend="huggingface",
        max_retries=1,
        timeout=120,
    )
    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS[:3]] + _greedy_pairs(lm, hf)
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(pairs)
    greedy_seen = 0
    for (context, continuation), (ll, is_greedy) in zip(pairs, got):
        ctx, cont = lm._encode_pair(context, continuation)
        ref_ll, ref_greedy = _reference(hf, ctx, cont)
        assert abs(ll - ref_ll) < 1e-4, f"{context!r} + {continuation!r}: {ll} vs {ref_ll}"
        assert is_greedy == ref_greedy, f"{context!r} + {continuation!r}"
        assert ll < 0
        greedy_seen += ref_greedy
    assert greedy_seen >= 1, "some pairs must be greedy for the flag check to mean anything"
    assert greedy_seen < len(pairs)
