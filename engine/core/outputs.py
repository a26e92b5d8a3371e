"""What the engine core hands back: sampled tokens from the worker, outputs per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import FinishReason

#: one token's log-probabilities: (sampled token's logprob, [(token id, logprob)] top alternatives)
TokenLogprobs = tuple[float, list[tuple[int, float]]]
#: one prompt token's log-probabilities: (its logprob, its rank in the distribution (1 = most
#: likely), [(token id, logprob)] the top alternatives, most likely first)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SampleOutput:
    """One step's samples, on the host, one row per sampling request (the step's order).

    Attributes:
        token_ids: sampled ids ``[N]``.
        logprobs: per row None (no logprobs asked) or :data:`TokenLogprobs`.
        prompt_logprobs: request id -> (``start``, entries) for the prompt positions the step
            scored: entry ``i`` is the :data:`PromptLogprob` of prompt token ``start + i + 1``
            (empty when no request of the step asked for prompt log-probabilities).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        new_token_ids: tokens sampled this step (0 or 1; more once a front end merged outputs).
        logprobs: per new token, None or :data:`TokenLogprobs`; empty when none were asked.
        prompt_logprobs: on the request's first output when it asked for them: one
            :data:`PromptLogprob` per prompt token after the first (``num_prompt_tokens - 1``).
        finished, finish_reason: set on the request's last output.
        num_prompt_tokens, num_cached_tokens: the request's prompt and its prefix-cache hits.
        error: message when the request failed inside the engine (``finish_reason`` error), or
            why the server ended it (``finish_reason`` abort: the front end's ``abort_all``).
        scheduled_time: monotonic time the engine first scheduled the request.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    scheduled_time: float | None = None

    @staticmethod
    def failed(request_id: str, message: str) -> RequestOutput:
        """The last output of a request the engine failed."""
        return RequestOutput(
            request_id, [], finished=True, finish_reason=FinishReason.ERROR, error=message
        )
