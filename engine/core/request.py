"""Sampling parameters and the engine-side state of one request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.structured_output import GrammarState, StructuredOutputSpec


@dataclass
class SamplingParams:
    """How to sample one completion (OpenAI / vLLM semantics).

    Attributes:
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; top_k: keep the k most likely tokens (-1 or 0 = all);
        min_p: drop tokens whose probability is below ``min_p`` times the top probability.
        presence_penalty, frequency_penalty: OpenAI penalties over generated tokens, subtracted
            from logits; repetition_penalty: CTRL-style (Keskar et al. 2019) divisor over prompt
            and generated tokens (1 = off).
        logit_bias: token id -> bias added to the logit.
        seed: per-request random seed (same seed, same samples whatever the batch).
        max_tokens: most tokens to generate; min_tokens: EOS and stop tokens are masked before.
        stop_token_ids: extra ids that end generation; ignore_eos: do not stop on EOS.
        stop: stop strings (handled by the detokenizer); include_stop_str_in_output.
        logprobs: None, or the number of top alternatives per token to return with the
            sampled token's log-probability (from the raw model distribution).
        prompt_logprobs: None, or the number of top alternatives to return with the
            log-probability of every prompt token after the first (vLLM's ``prompt_logprobs``):
            computed in the prefill (every prompt position, so such a request takes no prefix-cache
            hits while it scores its prompt) and delivered with the request's first output.
        skip_special_tokens: drop special tokens when detokenizing.
        structured_output: the grammar the output must match (JSON schema, regex, choice,
            grammar, tool calls), or None. A completed grammar ends the request with "stop"
            whatever ``ignore_eos`` and ``min_tokens`` say.

    ``max_tokens == 0`` scores the prompt only: the request finishes with reason ``length`` once
    its prompt is computed, with no token (its prompt log-probabilities, if asked, in that output).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_host_state(self) -> bool:
        """Sampling reads the request's host state every step (penalties over the tokens so
        far, ``min_tokens``, a grammar matcher advanced with the last token), so its sampling
        cannot be queued before the previous step's samples are back (async scheduling defers
        the sampling of the steps holding such a request, behind their forward)."""
        return self.needs_penalties or self.min_tokens > 0 or self.structured_output is not None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # client gone or explicit abort
    ERROR = "error"  # the engine failed while running it


@dataclass
class Request:
    """Engine-side state of one sequence.

    Attributes:
        prompt_token_ids: the prompt; output_token_ids: generated so far.
        num_computed_tokens: tokens whose K/V are in the cache (prefix hits included); the
            next step computes tokens ``num_computed_tokens ..`` of prompt + output. Advanced
            only by the scheduler (admission, ``update_after_launch``, preemption).
        num_cached_tokens: prompt tokens found in the prefix cache at (last) admission.
        The request's KV blocks are not here: the KV cache manager owns them
        (``KVCacheManager.get_block_ids``).
        grammar: the structured-output matcher (None without a grammar); it is advanced with
            every accepted token and survives preemption (the tokens it consumed stay).
        max_len: prompt + output may not exceed this (the engine's max_model_len).
        num_output_placeholders: tokens sampled by launched steps whose ids are not back on the
            host yet (async scheduling, see ``engine.core.llm_engine``): 0 or 1 between steps, 2
            for a moment while a step is launched before the previous one's samples are applied.
        prompt_logprobs: entries (:data:`~engine.core.outputs.PromptLogprob`) of prompt tokens
            ``1 .. len(prompt_logprobs)`` received so far (entry ``i`` scores prompt token
            ``i + 1``); prompt_logprobs_sent: whether they went out with an output.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_output_placeholders: int = 0
    grammar: GrammarState | None = None
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def scores_prompt(self) -> bool:
        """The request asked for prompt log-probabilities and has sampled nothing yet (none in
        flight either): every prompt position it computes now is scored, so it must compute all
        of them (no prefix-cache reads). After its first sample (even across a preemption) its
        prompt is scored and it behaves as any other request."""
        return self.sampling_params.prompt_logprobs is not None and self.sample_index == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens of the sequence once the tokens in flight are back (``num_tokens`` plus them)."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def sample_index(self) -> int:
        """Index in the output of the next token to sample (counts tokens still in flight)."""
        return len(self.output_token_ids) + self.num_output_placeholders

    def token_at(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end`` of prompt + output, without concatenating the two lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
