"""Vectorised per-request sampling over a batch of logits.

Every step's sampling parameters become a few ``[N]`` tensors, so the work is batched over
requests and the vocabulary (no Python loop over tokens). Random rows are drawn with the
exponential-race form of Gumbel-max (``argmax(p / E)``, ``E ~ Exp(1)``), which lets a seeded
request draw its noise from its own generator: the same seed gives the same samples whatever
else is in the batch. Log-probabilities are taken from the raw model distribution, before any
processing, as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class SampleOutput:
    """Result for N rows.

    Attributes:
        token_ids: sampled ids, python ints ``[N]``.
        logprobs: per row None or (sampled token's logprob, [(token id, logprob)] top alternatives).
    """

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class PendingSamples:
    """Samples on their way to the host (temporary: already on the host)."""

    def __init__(self, out: SampleOutput):
        self._out = out

    def wait(self) -> SampleOutput:
        return self._out


@dataclass
class DeviceSamples:
    """One step's samples: ``token_ids`` int64 ``[N]`` on the device."""

    token_ids: torch.Tensor
    host: SampleOutput

    def to_host(self) -> PendingSamples:
        return PendingSamples(self.host)


class Sampler:
    """Samples the next token of each request; owns the per-request seeded generators."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.sampling_params.seed)
            self._generators[req.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request], eos_ids: frozenset[int]) -> DeviceSamples:
        out = self._sample(logits, requests, eos_ids)
        return DeviceSamples(torch.tensor(out.token_ids, dtype=torch.int64, device=logits.device), out)

    @torch.no_grad()
    def _sample(self, logits: torch.Tensor, requests: list[Request], eos_ids: frozenset[int]) -> SampleOutput:
        """Sample one token per row.

        Args:
            logits: float32 ``[N, vocab]``, modified in place.
            requests: the N requests, in row order.
            eos_ids: end-of-sequence ids, masked while a request is below ``min_tokens``.
        """
        n, vocab = logits.shape
        params = [r.sampling_params for r in requests]
        dev = logits.device

        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        self._apply_logit_bias(logits, params, vocab)
        self._apply_min_tokens(logits, requests, eos_ids, vocab)
        if any(p.needs_penalties for p in params):
            self._apply_penalties(logits, requests, vocab)

        sampled = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            greedy = torch.tensor([p.greedy for p in params], device=dev)
            sampled = torch.where(greedy, sampled, self._sample_random(logits, requests))

        token_ids = sampled.tolist()
        lps: list = [None] * n
        if raw_logprobs is not None:
            k_max = max(p.logprobs or 0 for p in params)
            chosen = raw_logprobs.gather(1, sampled[:, None]).squeeze(1).tolist()
            top_v, top_i = raw_logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            for row, p in enumerate(params):
                if p.logprobs is None:
                    continue
                k = p.logprobs
                alts = list(zip(top_i[row][:k], top_v[row][:k])) if k else []
                lps[row] = (chosen[row], alts)
        return SampleOutput(token_ids, lps)

    # ------------------------------------------------------------ processors
    def _apply_logit_bias(self, logits, params, vocab) -> None:
        rows, cols, vals = [], [], []
        for row, p in enumerate(params):
            if p.logit_bias:
                for tok, bias in p.logit_bias.items():
                    if 0 <= tok < vocab:
                        rows.append(row)
                        cols.append(tok)
                        vals.append(bias)
        if rows:
            idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(idx, torch.tensor(vals, device=logits.device, dtype=logits.dtype), accumulate=True)

    def _apply_min_tokens(self, logits, requests, eos_ids, vocab) -> None:
        rows, cols = [], []
        for row, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                for tok in banned:
                    if 0 <= tok < vocab:
                        rows.append(row)
                        cols.append(tok)
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")

    def _apply_penalties(self, logits, requests, vocab) -> None:
        """Presence/frequency penalties (OpenAI) over outputs; repetition penalty over prompt+output."""
        dev = logits.device
        n = len(requests)
        out_len = max(1, max(len(r.output_token_ids) for r in requests))
        out_ids = torch.full((n, out_len), vocab, dtype=torch.int64)
        for row, r in enumerate(requests):
            if r.output_token_ids:
                out_ids[row, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids)
        out_ids = out_ids.to(dev)
        counts = torch.zeros(n, vocab + 1, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        presence = torch.tensor([r.sampling_params.presence_penalty for r in requests], device=dev)[:, None]
        frequency = torch.tensor([r.sampling_params.frequency_penalty for r in requests], device=dev)[:, None]
        repetition = torch.tensor([r.sampling_params.repetition_penalty for r in requests], device=dev)[:, None]
        if bool((repetition != 1.0).any()):
            seen = counts > 0
            prompt_len = max(1, max(r.num_prompt_tokens for r in requests))
            p_ids = torch.full((n, prompt_len), vocab, dtype=torch.int64)
            for row, r in enumerate(requests):
                if r.sampling_params.repetition_penalty != 1.0:
                    p_ids[row, : r.num_prompt_tokens] = torch.tensor(r.prompt_token_ids)
            p_seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
            p_seen.scatter_(1, p_ids.to(dev), True)
            seen = seen | p_seen[:, :vocab]
            penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits.copy_(torch.where(seen, penalised, logits))
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p filtering, then one draw per row."""
        params = [r.sampling_params for r in requests]
        probs = self._filtered_probs(logits, params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise.exponential_()
        for row, r in enumerate(requests):
            if r.sampling_params.seed is not None and not r.sampling_params.greedy:
                noise[row].exponential_(generator=self._generator(r))
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p: the probabilities each row is drawn from.

        Rows are not renormalised after min-p (the draw does not need it).
        """
        dev = logits.device
        n, vocab = logits.shape
        temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)[:, None]
        logits = logits / temp
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            k_t = torch.tensor(top_k, device=dev)[:, None]
            ranks = torch.arange(vocab, device=dev)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= k_t, float("-inf"))
            probs_sorted = sorted_logits.softmax(dim=-1)
            cum = probs_sorted.cumsum(dim=-1)
            p_t = torch.tensor(top_p, device=dev)[:, None]
            # drop a token when the mass before it already reaches top_p (always keep rank 0);
            # rows with top_p = 1 keep everything (float32 sums reach 1.0 before the tail)
            drop = ((cum - probs_sorted) >= p_t) & (p_t < 1.0)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            m_t = torch.tensor(min_p, device=dev)[:, None]
            probs = probs.masked_fill(probs < m_t * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs
