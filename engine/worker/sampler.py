"""Vectorised per-request sampling over a batch of logits, launched without host synchronisation.

A step's sampling parameters become a few ``[N]`` tensors built on the host (in pinned
memory on CUDA) and copied with ``non_blocking=True``, so :meth:`Sampler.__call__` only enqueues
device work and returns device tensors (:class:`DeviceSamples`); :meth:`DeviceSamples.to_host`
starts the device->host copies and :meth:`PendingSamples.wait` blocks for them. This lets the
engine prepare step N+1 while the GPU runs step N. What depends only on the rows' requests (the
temperature tensor, which rows need which processor) is kept in a
:class:`~engine.worker.sampling_metadata.SamplingMetadata` while a step's rows are the same
requests in the same order; per step only the seeds and offsets are staged (not even those when
every row is greedy: the kernel reads neither).

Draws use the Gumbel-max trick with counter-based noise: row ``i`` draws
``argmax(logits_i / T_i + g)``, where the Gumbel noise ``g`` is a function of
``(seed_i, offset_i, token)`` only. A request with ``SamplingParams.seed`` uses that seed and
``offset = request.sample_index`` (the index of the output token being sampled), so the same
seed gives the same text whatever else is in the batch; unseeded rows get a fresh 63-bit seed
per call from a host RNG owned by the sampler (seeded from torch's global RNG at construction).

Backends: ``"triton"`` (:func:`kernels.sampling.sample_tokens`, one pass over the logits; the
default on CUDA; on CPU only under ``TRITON_INTERPRET=1``) and ``"torch"`` (the default off
CUDA: the same math with the noise of a per-row ``torch.Generator`` seeded from
``(seed, offset)``; self-consistent, but not the same tokens as the Triton backend).

Top-k / top-p / min-p rows go through a sort-based torch filter first (dropped tokens become
``-inf``) and are then drawn the same way. Logit bias, min_tokens masking and penalties read
the requests' host state. Log-probabilities are taken from the raw model distribution, before
any processing, as OpenAI and vLLM report them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.outputs import SampleOutput
from engine.core.request import Request
from engine.worker.sampling_metadata import SamplingMetadata, SeedStream
from engine.worker.staging import HostStaging, copy_to_host_async

_MASK64 = (1 << 64) - 1
_U_MIN = 2.0**-24  # Gumbel noise from u in [2^-24, 1 - 2^-24]: finite logs
_U_MAX = 1.0 - 2.0**-24


#: a batch whose filtered rows all have a top_k of at most this many ranks only the top k_max
#: logits (``torch.topk``) instead of sorting the whole vocabulary
TOP_K_SELECT_MAX = 1024


class PendingSamples:
    """Device->host copies of one step's samples in flight (pinned buffers + a CUDA event)."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprob_k: list[int | None],
        chosen: torch.Tensor | None,
        top_vals: torch.Tensor | None,
        top_ids: torch.Tensor | None,
        event: torch.cuda.Event | None,
    ):
        self._token_ids = token_ids
        self._logprob_k = logprob_k
        self._chosen = chosen
        self._top_vals = top_vals
        self._top_ids = top_ids
        self._event = event
        self._result: SampleOutput | None = None

    def wait(self) -> SampleOutput:
        """Block until the copies are done (returns at once on CPU); the result is cached."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            token_ids = self._token_ids.tolist()
            lps: list = [None] * len(token_ids)
            if self._chosen is not None:
                chosen = self._chosen.tolist()
                top_v = self._top_vals.tolist() if self._top_vals is not None else None
                top_i = self._top_ids.tolist() if self._top_ids is not None else None
                for row, k in enumerate(self._logprob_k):
                    if k is None:
                        continue
                    alts = list(zip(top_i[row][:k], top_v[row][:k])) if k else []
                    lps[row] = (chosen[row], alts)
            self._result = SampleOutput(token_ids, lps)
        return self._result


@dataclass
class DeviceSamples:
    """One step's samples, still on the logits' device.

    Attributes:
        token_ids: int64 ``[N]``.
        logprob_k: per row None (no logprobs asked) or the number of top alternatives (host ints).
        chosen_logprobs: float32 ``[N]``, raw logprob of each sampled token; None when no row asked.
        top_logprobs, top_ids: float32 / int64 ``[N, K]`` (``K`` the largest k asked), the raw top
            alternatives sorted most likely first; None when no row asked or ``K == 0``.
    """

    token_ids: torch.Tensor
    logprob_k: list[int | None]
    chosen_logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self) -> PendingSamples:
        """Start non-blocking copies into fresh pinned host memory and record a CUDA event after
        them (on the current stream); on CPU nothing is copied."""
        tensors = (self.token_ids, self.chosen_logprobs, self.top_logprobs, self.top_ids)
        if self.token_ids.device.type != "cuda":
            return PendingSamples(*tensors[:1], self.logprob_k, *tensors[1:], None)
        host, event = copy_to_host_async(tensors)
        return PendingSamples(host[0], self.logprob_k, host[1], host[2], host[3], event)


_NP_DTYPES = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bfloat16: np.float32,
    torch.float16: np.float32,
}


def stage_values(staging: HostStaging, name: str, values, dtype: torch.dtype) -> torch.Tensor:
    """A small host list/array/tensor as a ``dtype`` tensor on the staging device, through the
    worker's one host-to-device path (no host sync)."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    t = staging.stage(name, np.asarray(values, dtype=_NP_DTYPES[dtype]))
    return t if t.dtype == dtype else t.to(dtype)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_torch(
    logits: torch.Tensor,
    temperature: list[float],
    seeds: list[int],
    offsets: list[int],
    staging: HostStaging,
) -> torch.Tensor:
    """The torch backend's draw: int64 ``[N]`` on the logits' device.

    Rows with ``temperature <= 1e-5`` take ``argmax``; the others
    ``argmax(logits / T - log(-log(u)))`` with ``u`` from a ``torch.Generator`` seeded by a hash of
    ``(seed, offset)`` (so a row's draw depends only on its own inputs), clamped to
    ``[2^-24, 1 - 2^-24]``. Host lists of length N; no host sync.
    """
    out = logits.argmax(dim=-1)
    rand = [i for i, t in enumerate(temperature) if t > 1e-5]
    if not rand:
        return out
    vocab = logits.shape[1]
    noise = torch.empty(len(rand), vocab, dtype=torch.float32, device=logits.device)
    for k, row in enumerate(rand):
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(_splitmix64(_splitmix64(seeds[row] & _MASK64) ^ (offsets[row] & _MASK64)))
        noise[k].uniform_(generator=gen)
    noise.clamp_(_U_MIN, _U_MAX).log_().neg_().log_().neg_()  # Gumbel: -log(-log(u))
    rows = stage_values(staging, "draw.rows", rand, torch.int64)
    inv_t = stage_values(
        staging, "draw.inv_t", [1.0 / temperature[i] for i in rand], torch.float32
    )[:, None]
    scores = logits.index_select(0, rows).float() * inv_t + noise
    return out.index_copy_(0, rows, scores.argmax(dim=-1))


class Sampler:
    """Samples the next token of each request; keeps no per-request state.

    Args:
        device: where the logits live.
        backend: ``"triton"``, ``"torch"``, or None for Triton on CUDA and torch elsewhere.
        staging: the worker's host-to-device path (its step parity is advanced by the model
            runner); None: a staging of its own.

    Raises:
        ValueError: unknown backend, or ``"triton"`` on a CPU device without ``TRITON_INTERPRET=1``.
    """

    def __init__(
        self, device: torch.device, backend: str | None = None, staging: HostStaging | None = None
    ):
        self.device = torch.device(device)
        self._own_staging = staging is None  # then each call is a step of its own
        self.staging = staging if staging is not None else HostStaging(self.device)
        if backend is None:
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend not in ("triton", "torch"):
            raise ValueError(f"unknown sampler backend {backend!r}; expected 'triton' or 'torch'")
        if (
            backend == "triton"
            and self.device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError("the triton sampler needs a CUDA device or TRITON_INTERPRET=1")
        self.backend = backend
        # host RNG for unseeded rows; from torch's global RNG so torch.manual_seed reproduces runs
        self._seeds = SeedStream(
            np.random.Generator(np.random.PCG64(int(torch.randint(0, 2**62, ()).item())))
        )
        # the rows' parameter facts, reused while a step's rows are the same requests
        self._metadata: SamplingMetadata | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        eos_ids: frozenset[int],
        grammar_rows: list[str] | None = None,
        grammar_bitmask: bytearray | None = None,
    ) -> DeviceSamples:
        """Launch the sampling of one token per row; no host synchronisation.

        Args:
            logits: float32 or bfloat16 ``[N, vocab]``; grammar rows are masked in place, and a
                float32 input may be modified in place by the other processors.
            requests: the N requests, in row order (their host state: outputs so far,
                ``sample_index``; penalties and min_tokens need ``output_token_ids`` current).
            eos_ids: end-of-sequence ids, masked while a request is below ``min_tokens``.
            grammar_rows, grammar_bitmask: request ids with a grammar and their packed bitmasks
                (``ScheduledBatch.grammar_rows`` / ``grammar_bitmask``); the disallowed tokens of
                those rows get ``-inf`` first, so every later step (logprobs included: they
                report the constrained distribution) sees the mask.

        Returns:
            :class:`DeviceSamples` on the logits' device.
        """
        if torch.is_grad_enabled():  # the model runner calls it under inference mode already
            with torch.no_grad():
                return self._sample(logits, requests, eos_ids, grammar_rows, grammar_bitmask)
        return self._sample(logits, requests, eos_ids, grammar_rows, grammar_bitmask)

    def _sample(self, logits, requests, eos_ids, grammar_rows, grammar_bitmask) -> DeviceSamples:
        if self._own_staging:
            self.staging.next_step()
        n, vocab = logits.shape
        meta = self._metadata
        if meta is None or not meta.matches(requests, vocab):
            meta = self._metadata = SamplingMetadata(requests, vocab)
        params = meta.params
        dev = logits.device
        if grammar_rows:  # in place, in the logits' dtype (a graph's output is rewritten anyway)
            self._apply_bitmasks(logits, requests, grammar_rows, grammar_bitmask)

        lp_k = meta.logprob_k
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if meta.any_logprobs else None

        # EOS held back below min_tokens (not on grammar rows: the grammar decides the end)
        filter_rows = meta.filter_rows
        if meta.any_logit_bias or meta.eos_masked() or meta.any_penalties or filter_rows:
            logits = logits.float()  # processed in place: float32 (a copy of bf16 logits)
            self._apply_logit_bias(logits, params, vocab)
            self._apply_min_tokens(logits, requests, eos_ids, vocab)
            if meta.any_penalties:
                self._apply_penalties(logits, requests, vocab)
            if filter_rows:
                rows = self._stage("filter.rows", filter_rows, torch.int64)
                sub = self._filtered_logits(
                    logits.index_select(0, rows), [params[i] for i in filter_rows]
                )
                logits.index_copy_(0, rows, sub)

        fresh = self._seeds.take(n)  # drawn in every step: the stream stays the same
        if self.backend == "triton":
            from kernels.sampling import sample_tokens

            if logits.stride(1) != 1:
                logits = logits.contiguous()
            if meta.device_temperature is None:
                meta.device_temperature = self._stage(
                    "temperature", meta.temperatures, torch.float32
                )
            if meta.all_greedy:  # greedy rows read no seed or offset: nothing to stage
                if meta.device_unread is None:
                    meta.device_unread = torch.zeros(n, dtype=torch.int64, device=dev)
                seeds_offsets = (meta.device_unread, meta.device_unread)
            else:
                seeds_offsets = self.staging.stage_many(
                    "seeds_offsets", [meta.seeds(fresh), meta.offsets()]
                )
            token_ids = sample_tokens(
                logits,
                meta.device_temperature,
                *seeds_offsets,
                torch.empty(n, dtype=torch.int64, device=dev),
            )
        else:
            token_ids = draw_torch(
                logits,
                meta.temperatures,
                meta.seeds(fresh).tolist(),
                meta.offsets().tolist(),
                self.staging,
            )

        out = DeviceSamples(token_ids, lp_k)
        if raw_logprobs is not None:
            out.chosen_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            k_max = max(k or 0 for k in lp_k)
            if k_max > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(min(k_max, vocab), dim=-1)
        return out

    def _stage(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        return stage_values(self.staging, name, values, dtype)

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
            idx = (
                self._stage("bias.rows", rows, torch.int64),
                self._stage("bias.cols", cols, torch.int64),
            )
            logits.index_put_(idx, self._stage("bias.vals", vals, logits.dtype), accumulate=True)

    def _apply_bitmasks(
        self, logits: torch.Tensor, requests: list[Request], grammar_rows: list[str], bitmask
    ) -> None:
        """Grammar masks on the device: the row of request ``grammar_rows[i]`` keeps the tokens
        set in row ``i`` of the packed ``bitmask``."""
        index = {r.request_id: i for i, r in enumerate(requests)}
        words = -(-logits.shape[1] // 32)
        packed = np.frombuffer(bitmask, dtype="<i4").reshape(len(grammar_rows), -1)[:, :words]
        dev_rows = self._stage("bitmask.rows", [index[rid] for rid in grammar_rows], torch.int64)
        dev_masks = self.staging.stage("bitmask.words", packed.astype(np.int32, copy=False))
        if self.backend == "triton":
            from kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, dev_rows, dev_masks)
        else:
            from kernels.reference import apply_token_bitmask_ref

            apply_token_bitmask_ref(logits, dev_rows, dev_masks)

    def _apply_min_tokens(self, logits, requests, eos_ids, vocab) -> None:
        rows, cols = [], []
        for row, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) < p.min_tokens and r.grammar is None:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                for tok in banned:
                    if 0 <= tok < vocab:
                        rows.append(row)
                        cols.append(tok)
        if rows:
            logits[
                self._stage("min_tokens.rows", rows, torch.int64),
                self._stage("min_tokens.cols", cols, torch.int64),
            ] = float("-inf")

    def _apply_penalties(self, logits, requests, vocab) -> None:
        """Presence/frequency penalties (OpenAI) over outputs; repetition penalty over
        prompt+output."""
        dev = logits.device
        n = len(requests)
        out_len = max(1, max(len(r.output_token_ids) for r in requests))
        out_ids = torch.full((n, out_len), vocab, dtype=torch.int64)
        for row, r in enumerate(requests):
            if r.output_token_ids:
                out_ids[row, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids)
        out_ids = self._stage("penalty.out_ids", out_ids, torch.int64)
        counts = torch.zeros(n, vocab + 1, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        sp = [r.sampling_params for r in requests]
        presence = self._stage("penalty.presence", [p.presence_penalty for p in sp], torch.float32)[
            :, None
        ]
        frequency = self._stage(
            "penalty.frequency", [p.frequency_penalty for p in sp], torch.float32
        )[:, None]
        if any(p.repetition_penalty != 1.0 for p in sp):
            repetition = self._stage(
                "penalty.repetition", [p.repetition_penalty for p in sp], torch.float32
            )[:, None]
            seen = counts > 0
            prompt_len = max(1, max(r.num_prompt_tokens for r in requests))
            p_ids = torch.full((n, prompt_len), vocab, dtype=torch.int64)
            for row, r in enumerate(requests):
                if r.sampling_params.repetition_penalty != 1.0:
                    p_ids[row, : r.num_prompt_tokens] = torch.tensor(r.prompt_token_ids)
            p_seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
            p_seen.scatter_(1, self._stage("penalty.prompt_ids", p_ids, torch.int64), True)
            seen = seen | p_seen[:, :vocab]
            penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits.copy_(torch.where(seen, penalised, logits))
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)

    # ------------------------------------------------------------ filters
    def _filtered_logits(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Top-k, top-p and min-p: a float32 copy of ``logits`` ``[R, vocab]`` with the dropped
        tokens set to ``-inf`` (the kept ones unchanged, not divided by the temperature).

        top-k and top-p are decided on ``softmax(logits / T)``, top-p over the top-k renormalised;
        min-p over the distribution that remains. No host sync.
        """
        dev = logits.device
        n, vocab = logits.shape
        temp = self._stage(
            "filter.temperature", [max(p.temperature, 1e-5) for p in params], torch.float32
        )[:, None]
        out = logits.float().clone()
        scaled = out / temp
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            # every row bounded by a small top_k (Qwen3's generation_config asks for 20): only
            # the k_max largest logits are ranked (torch.topk), not the whole vocabulary (a
            # full sort of 151,936 logits per row is ~20 ms on a CPU core); rows beyond their
            # own k are masked as before, so the result is the same
            width = max(top_k)
            if width > TOP_K_SELECT_MAX:
                width = vocab
            if width < vocab:
                sorted_logits, sorted_idx = scaled.topk(width, dim=-1)
            else:
                sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
            k_t = self._stage("filter.top_k", top_k, torch.int64)[:, None]
            ranks = torch.arange(width, device=dev)[None, :]
            drop = ranks >= k_t
            probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            cum = probs_sorted.cumsum(dim=-1)
            p_t = self._stage("filter.top_p", top_p, torch.float32)[:, None]
            # drop a token when the mass before it already reaches top_p (always keep rank 0);
            # rows with top_p = 1 keep everything (float32 sums reach 1.0 before the tail)
            drop |= ((cum - probs_sorted) >= p_t) & (p_t < 1.0)
            drop[:, 0] = False
            # what is outside the top k_max (width < vocab) is dropped too; a full sort's
            # indices cover every position, so the scatter overwrites all of them
            dropped = torch.ones_like(out, dtype=torch.bool).scatter_(1, sorted_idx, drop)
            out.masked_fill_(dropped, float("-inf"))
            scaled.masked_fill_(dropped, float("-inf"))
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            probs = scaled.softmax(dim=-1)
            m_t = self._stage("filter.min_p", min_p, torch.float32)[:, None]
            out.masked_fill_(probs < m_t * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return out
