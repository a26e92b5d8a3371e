"""Turn an API request's sampling fields into the engine's SamplingParams (with checkpoint
defaults)."""

from __future__ import annotations

from engine.core.request import SamplingParams
from server.errors import APIError
from server.protocol import SamplingFields

#: generation_config.json keys that give request defaults
_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

#: integers above this are written "more than ..." in error messages
_SHOWN_MAX = 10**18


def shown(value: int) -> str:
    """A request's integer as an error message writes it: as is, or ``more than 10**18`` /
    ``less than -10**18`` beyond (no real limit comes near; a huge JSON integer, or a sum with
    one, may not even be convertible to text: Python refuses ints of more than 4300 digits)."""
    if value > _SHOWN_MAX:
        return f"more than {_SHOWN_MAX}"
    if value < -_SHOWN_MAX:
        return f"less than -{_SHOWN_MAX}"
    return str(value)


def check_stream_options(req: SamplingFields) -> None:
    """``stream_options`` only with ``stream`` true (OpenAI and vLLM answer 400 otherwise).

    Raises:
        APIError: 400 naming ``stream_options``.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")


def generation_defaults(generation_config: dict) -> dict:
    """Sampling defaults from a checkpoint's generation config (Qwen3: temperature 0.6, top_p 0.95,
    top_k 20). Without ``do_sample`` true the checkpoint asks for greedy decoding."""
    out = {k: generation_config[k] for k in _DEFAULT_KEYS if generation_config.get(k) is not None}
    if generation_config and not generation_config.get("do_sample", False) and "temperature" in out:
        out["temperature"] = 0.0
    return out


def to_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    num_prompt_tokens: int,
    prompt_logprobs: int | None = None,
    max_model_len: int,
    vocab_size: int,
    defaults: dict,
    max_tokens_param: str = "max_tokens",
    prompt_param: str = "messages",
    max_tokens_sent: bool = True,
) -> SamplingParams:
    """Build SamplingParams, applying checkpoint defaults to the fields the request left out.

    Args:
        max_tokens: the request's limit (None = up to the model length; 0 = score the prompt
            only, which the caller allows with echo or prompt_logprobs: the prompt may then
            fill the whole ``max_model_len``).
        logprobs: number of top alternatives to report (None = no logprobs).
        prompt_logprobs: alternatives per prompt token (None = no prompt log-probabilities).
        max_tokens_param, prompt_param: the request fields that errors name ("max_completion_tokens"
            when the chat request used it; "prompt" for text completions).
        max_tokens_sent: False when ``max_tokens`` is the endpoint's default, not the
            request's: a context error then names the prompt and says the limit is a default.

    Raises:
        APIError: 400 when prompt + max_tokens (or, without max_tokens, prompt + min_tokens)
            exceed the model length, the prompt leaves no room for a token (unless max_tokens
            is 0), min_tokens exceeds max_tokens, or a logit_bias /
            stop_token_ids id is outside the vocabulary.
    """
    room = max_model_len - num_prompt_tokens
    generated = 0 if max_tokens == 0 else 1  # scoring only: the prompt may fill the context
    if room < generated:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens"
            + (", which leaves no room for the completion." if generated else "."),
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {shown(num_prompt_tokens + max_tokens)} tokens "
            f"({num_prompt_tokens} in the prompt, "
            f"{shown(max_tokens)} for the completion"
            + ("" if max_tokens_sent else ", the default max_tokens")
            + ").",
            max_tokens_param if max_tokens_sent else prompt_param,
            "context_length_exceeded",
        )
    bias = None
    if req.logit_bias:
        bias = {}
        for key, val in req.logit_bias.items():
            # keys are canonical decimal ids (protocol.py); one longer than 19 digits is outside
            # any vocabulary (and int() refuses more than 4300 digits)
            tok = int(key) if len(key) <= 19 else _SHOWN_MAX + 1
            if not 0 <= tok < vocab_size:
                raise APIError(
                    400,
                    f"logit_bias token id {shown(tok)} is outside the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )
            bias[tok] = float(val)
    for tok in req.stop_token_ids or []:
        if not 0 <= tok < vocab_size:
            raise APIError(
                400,
                f"stop_token_ids entry {shown(tok)} is outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens ({shown(req.min_tokens)}) must not exceed {max_tokens_param} "
            f"({shown(max_tokens)})",
            "min_tokens",
        )
    if req.min_tokens and max_tokens is None and req.min_tokens > room:
        # max_tokens defaults to the room the prompt leaves (vLLM then refuses min_tokens >
        # max_tokens the same way): min_tokens could never be met
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"min_tokens ({shown(req.min_tokens)}) asks for more than the {room} tokens the "
            f"prompt ({num_prompt_tokens} tokens) leaves for the completion.",
            "min_tokens",
            "context_length_exceeded",
        )

    def pick(name, fallback):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name, fallback)
        return value

    return SamplingParams(
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=int(pick("top_k", -1)),
        min_p=float(pick("min_p", 0.0)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        logit_bias=bias,
        seed=req.seed,
        max_tokens=max_tokens if max_tokens is not None else room,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        stop=list(req.stop or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
