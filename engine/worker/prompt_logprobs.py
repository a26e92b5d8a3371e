"""Log-probabilities of prompt tokens, computed from the hidden states of the prefill that runs.

A request with ``SamplingParams.prompt_logprobs`` (vLLM's extension; also what a legacy
``/v1/completions`` request with ``echo`` and ``logprobs`` asks for) needs, for every prompt
position ``j`` except the last, ``log p(prompt[j + 1] | prompt[: j + 1])``: a row of logits per
position instead of one per request. The model runner gathers those rows of the step's final
hidden states (``StepTensors.prompt_rows``) and :func:`score_prompt_rows` turns them into the
scored token's log-probability, its rank and the top-k alternatives, a bounded number of rows at
a time: a 4k-token prompt at Qwen3's vocabulary (151,936) would be 2.4 GB of float32 logits at
once; in slices of :data:`SLICE_ELEMENTS` logits the extra memory stays a few hundred MB
whatever the step size, and only ``[R]`` / ``[R, k]`` results are kept. As for sampled tokens
(``engine.worker.sampler``), the log-probabilities are ``log_softmax`` in float32 of the model's
raw logits (no temperature, penalties or bias), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.outputs import PromptLogprob
from engine.worker.staging import copy_to_host_async

#: logits computed at once (rows x vocab): 32 Mi floats, 128 MiB in float32
SLICE_ELEMENTS = 1 << 25


class PendingPromptLogprobs:
    """Device->host copies of one step's prompt log-probabilities in flight (pinned buffers and
    a CUDA event; plain tensors on the CPU)."""

    def __init__(self, tensors: tuple, event: torch.cuda.Event | None):
        self._tensors = tensors
        self._event = event

    def wait(
        self, segments: list[tuple[str, int, int, int]]
    ) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """Block for the copies; returns request id -> (first position, entries).

        Args:
            segments: per scoring request in row order ``(request id, first position, rows,
                k)`` (``StepInputs.prompt_segments``).
        """
        if self._event is not None:
            self._event.synchronize()
        chosen, ranks, top_vals, top_ids = self._tensors
        chosen, ranks = chosen.tolist(), ranks.tolist()
        top_v = top_vals.tolist() if top_vals is not None else None
        top_i = top_ids.tolist() if top_ids is not None else None
        out: dict[str, tuple[int, list[PromptLogprob]]] = {}
        row = 0
        for rid, start, count, k in segments:
            entries = []
            for r in range(row, row + count):
                alts = list(zip(top_i[r][:k], top_v[r][:k])) if k and top_i is not None else []
                entries.append((chosen[r], ranks[r], alts))
            out[rid] = (start, entries)
            row += count
        return out


@dataclass
class DevicePromptLogprobs:
    """One step's prompt log-probabilities on the device.

    Attributes:
        chosen: float32 ``[R]``, logprob of each scored prompt token.
        ranks: int64 ``[R]``, its rank: 1 + the number of tokens with a larger logprob.
        top_logprobs, top_ids: float32 / int64 ``[R, K]`` the K most likely tokens, most likely
            first (None when ``K == 0``).
    """

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None

    def to_host(self) -> PendingPromptLogprobs:
        """Queue non-blocking copies into pinned host memory (CUDA) and an event after them."""
        tensors = (self.chosen, self.ranks, self.top_logprobs, self.top_ids)
        if self.chosen.device.type != "cuda":
            return PendingPromptLogprobs(tensors, None)
        host, event = copy_to_host_async(tensors)
        return PendingPromptLogprobs(host, event)


def score_prompt_rows(
    compute_logits, hidden: torch.Tensor, targets: torch.Tensor, k: int, vocab_size: int
) -> DevicePromptLogprobs | None:
    """Score prompt tokens from the hidden states of the positions before them.

    Args:
        compute_logits: the model's LM head, ``[n, hidden] -> [n, vocab]`` logits; on the
            ranks of a tensor-parallel engine other than 0 it returns None (it gathers the
            vocab shards on rank 0), and so does this function, after the same calls.
        hidden: ``[R, hidden]`` final hidden states of the scored positions (model dtype).
        targets: int64 ``[R]`` the prompt token each position predicts.
        k: number of top alternatives to return (0: none).
        vocab_size: the logits' width (sizes the slices).

    Returns:
        :class:`DevicePromptLogprobs`, computed :data:`SLICE_ELEMENTS` logits at a time
        (``log_softmax`` of the float32 logits; no host synchronisation).
    """
    rows = hidden.shape[0]
    step = max(1, SLICE_ELEMENTS // max(1, vocab_size))
    k = min(k, vocab_size)
    dev = hidden.device
    chosen = torch.empty(rows, dtype=torch.float32, device=dev)
    ranks = torch.empty(rows, dtype=torch.int64, device=dev)
    top_v = torch.empty(rows, k, dtype=torch.float32, device=dev) if k else None
    top_i = torch.empty(rows, k, dtype=torch.int64, device=dev) if k else None
    gathered = True
    for a in range(0, rows, step):
        b = min(rows, a + step)
        logits = compute_logits(hidden[a:b])
        if logits is None:  # a tensor-parallel rank other than 0: the gather is all it runs
            gathered = False
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(1, targets[a:b, None])
        chosen[a:b] = picked.squeeze(1)
        ranks[a:b] = (logprobs > picked).sum(dim=-1) + 1
        if k:
            top_v[a:b], top_i[a:b] = logprobs.topk(k, dim=-1)
        del logprobs, logits
    if not gathered:
        return None
    return DevicePromptLogprobs(chosen, ranks, top_v, top_i)
