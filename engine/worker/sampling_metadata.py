"""What the sampler knows about a step's rows before it looks at their logits, built once per
batch composition; and the stream of fresh seeds for unseeded rows.

Most of the sampler's host work at small batches was re-deriving the same facts from the same
``SamplingParams`` every step (which rows are greedy, ask for logprobs, need a filter, carry a
seed; the temperature tensor staged to the device) and one numpy ``Generator`` call per step
for the fresh seeds. A decode batch keeps the same requests in the same rows for many steps, so
:class:`SamplingMetadata` is built when the rows' requests change (any join, leave, preemption
or reorder) and reused while they stay the same objects in the same order (vLLM's
``SamplingMetadata`` of its persistent input batch, rebuilt on batch changes, does the same).
Only what changes every step is recomputed: ``min_tokens`` against the current output length,
the rows' ``sample_index`` offsets and the fresh seeds.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from engine.core.request import Request, SamplingParams

#: fresh seeds drawn from the generator at a time (a few kB of int64)
SEED_CHUNK = 512


def _as_int64(seed: int) -> int:
    """Any python int as a signed 64-bit value (its low 64 bits)."""
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


def wants_filter(p: SamplingParams, vocab: int) -> bool:
    """Whether a (random) row asks for top-k, top-p or min-p filtering."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0


class SeedStream:
    """Fresh 63-bit seeds (uniform in ``[0, 2**63 - 1]``) from a numpy ``Generator``.

    :meth:`take` hands out the same values, in the same order, as calling
    ``rng.integers(0, 2**63 - 1, size=n, dtype=np.int64, endpoint=True)`` once per call would:
    numpy draws each bounded 64-bit value from the bit generator independently and in order, so
    a chunk drawn ahead and handed out in pieces is the same sequence (``tests/unit/
    test_sampling_metadata.py`` checks it). One generator call per :data:`SEED_CHUNK` values
    instead of one per step (about 10 us each on the CPU).

    Args:
        rng: the generator (owned by the stream afterwards).
        chunk: values drawn per refill (>= 1).
    """

    def __init__(self, rng: np.random.Generator, chunk: int = SEED_CHUNK):
        self._rng = rng
        self._chunk = max(1, chunk)
        self._pool = np.zeros(0, dtype=np.int64)
        self._pos = 0

    def _draw(self, n: int) -> np.ndarray:
        return self._rng.integers(0, 2**63 - 1, size=n, dtype=np.int64, endpoint=True)

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` seeds: a new int64 ``[n]`` array (the caller may write it)."""
        if self._pos + n > len(self._pool):
            rest = self._pool[self._pos :]
            self._pool = np.concatenate([rest, self._draw(max(self._chunk, n - len(rest)))])
            self._pos = 0
        out = self._pool[self._pos : self._pos + n].copy()
        self._pos += n
        return out


class SamplingMetadata:
    """The per-row facts of one batch composition (rows ``0 .. N-1`` are ``requests``).

    Everything here depends only on the requests' ``SamplingParams`` and on whether they have a
    grammar, both fixed for a request's life, and on the vocabulary size. It holds the request
    objects themselves, so :meth:`matches` compares identities that cannot be reused by other
    objects while it lives.

    Args:
        requests: the step's sampling requests, in row order.
        vocab: the logits' vocabulary size.

    Attributes:
        params: the rows' ``SamplingParams``.
        logprob_k: per row None or the number of top alternatives asked.
        any_logprobs, any_logit_bias, any_penalties: whether any row asks for them.
        min_tokens_rows: rows with ``min_tokens > 0`` and no grammar (EOS masked while short).
        filter_rows: random rows with top-k, top-p or min-p.
        temperatures: per row ``0.0`` (greedy) or the temperature, host floats.
        seeded_rows, seed_values: int64 rows with their own seed, and those seeds as signed
            64-bit values.
        all_greedy: every row is greedy (the Triton kernel then reads no seed or offset).
        device_temperature: float32 ``[N]`` copy of ``temperatures`` on the sampler's device,
            staged at the first step that needs it and reused after (None until then).
        device_unread: int64 ``[N]`` zeros on the device, passed as the seeds and offsets of an
            all-greedy batch (never read; None until first needed).
    """

    def __init__(self, requests: list[Request], vocab: int):
        self.requests = list(requests)
        self.vocab = vocab
        params = [r.sampling_params for r in requests]
        self.params = params
        self.logprob_k = [p.logprobs for p in params]
        self.any_logprobs = any(k is not None for k in self.logprob_k)
        self.any_logit_bias = any(p.logit_bias for p in params)
        self.any_penalties = any(p.needs_penalties for p in params)
        self.min_tokens_rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.min_tokens > 0 and r.grammar is None
        ]
        self.filter_rows = [
            i for i, p in enumerate(params) if not p.greedy and wants_filter(p, vocab)
        ]
        self.temperatures = [0.0 if p.greedy else float(p.temperature) for p in params]
        self.all_greedy = all(p.greedy for p in params)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        self.seeded_rows = np.asarray(seeded, dtype=np.int64)
        self.seed_values = np.asarray([_as_int64(params[i].seed) for i in seeded], dtype=np.int64)
        self.device_temperature: torch.Tensor | None = None
        self.device_unread: torch.Tensor | None = None

    def matches(self, requests: list[Request], vocab: int) -> bool:
        """Whether ``requests`` are this composition's request objects, in the same order."""
        return (
            vocab == self.vocab
            and len(requests) == len(self.requests)
            and all(map(operator.is_, requests, self.requests))
        )

    def eos_masked(self) -> bool:
        """Whether a row's EOS and stop tokens are masked this step (output below
        ``min_tokens``; read from the requests' current output)."""
        reqs, params = self.requests, self.params
        return any(
            len(reqs[i].output_token_ids) < params[i].min_tokens for i in self.min_tokens_rows
        )

    def seeds(self, fresh: np.ndarray) -> np.ndarray:
        """int64 ``[N]``: each row's seed this step, ``fresh`` (``[N]``, from
        :class:`SeedStream`, written in place) where the row has no seed of its own."""
        if len(self.seeded_rows):
            fresh[self.seeded_rows] = self.seed_values
        return fresh

    def offsets(self) -> np.ndarray:
        """int64 ``[N]``: each row's Philox offset this step (the request's ``sample_index``)."""
        return np.fromiter(
            (r.sample_index for r in self.requests), dtype=np.int64, count=len(self.requests)
        )
