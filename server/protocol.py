"""Pydantic models of the OpenAI request and response bodies (chat and text completions).

Shapes follow OpenAI's API reference; extra sampling fields (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, chat_template_kwargs, ...) follow vLLM. Range rules live
here so that a bad value becomes a 400 naming the parameter.

No field is accepted and then dropped: an unknown top-level field is a 400 naming it (OpenAI's
"Unrecognized request argument supplied"), and the fields of OpenAI's and vLLM's bodies that
this server does not apply (:data:`NOT_APPLIED`, :data:`CHAT_NOT_APPLIED`) are accepted only with
the value that asks for nothing (null, or e.g. ``use_beam_search: false``). Fields without an
effect on the output are accepted: ``user``, ``metadata``, ``prompt_cache_key`` and
``safety_identifier`` (identifiers and hints), ``guided_decoding_backend`` (the server's grammar
engine enforces the constraint whatever it names) and ``spaces_between_special_tokens`` (special
tokens are joined without spaces, as vLLM's fast-tokenizer path joins them whatever it says).
Nested objects stay lenient: clients send back response fields (a message's ``refusal``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
#: a logit_bias key: a token id in canonical decimal (ASCII digits, no sign, space or leading 0)
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")
#: seeds are 64-bit signed integers (as in vLLM); the n choices use seed, seed + 1, ... which torch
#: still accepts (its generators take [-2**63, 2**64 - 1]). Larger values used to fail the whole
#: engine step, i.e. every request batched with them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf: "a finite number"


class _Request(BaseModel):
    """A top-level request body: an unknown field is a validation error (``extra_forbidden``,
    answered as OpenAI's "Unrecognized request argument supplied")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


#: the reason given for a value of a field this server does not apply
_NOT_APPLIED_WHY = {
    "truncate_prompt_tokens": "prompts are not truncated; shorten the prompt",
    "functions": "use tools",
    "function_call": "use tool_choice with tools",
    "store": "completions are not stored",
    "service_tier": "one tier is served",
    "modalities": "text is the only output",
}

#: fields of OpenAI's and vLLM's completion bodies that this server does not apply, and the
#: values (besides null) that ask for nothing: any other value is a 400 naming the field
NOT_APPLIED: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "early_stopping": (False,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "priority": (0,),
    "request_id": (),
    "logits_processors": (),
    "guided_whitespace_pattern": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "structural_tag": (),
    "return_token_ids": (False,),
}
#: the same for fields of the chat body only
CHAT_NOT_APPLIED: dict[str, tuple] = {
    "functions": (),
    "function_call": (),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "documents": (),
    "chat_template": (),
    "mm_processor_kwargs": (),
}


def no_op_only(v, info):
    """A field of :data:`NOT_APPLIED` / :data:`CHAT_NOT_APPLIED` holds null or a value that asks
    for nothing (same type and value: ``0`` is not ``false``); returns None.

    Raises:
        ValueError: for any other value, saying the field is not supported (and why).
    """
    name = info.field_name
    allowed = NOT_APPLIED.get(name, CHAT_NOT_APPLIED.get(name, ()))
    if v is None or any(type(v) is type(a) and v == a for a in allowed):
        return None
    why = _NOT_APPLIED_WHY.get(name)
    noop = " or ".join(json.dumps(a) for a in allowed) or "null"
    raise ValueError(
        f"{name} is not supported by this server (accepted only as {noop})"
        + (f": {why}" if why else "")
    )


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = (
        None  # before content: its validator reads role and tool_calls
    )
    tool_call_id: str | None = Field(None, validate_default=True)
    reasoning_content: str | None = None
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls_only(cls, v, info):
        """Only an assistant message carries tool calls (a template shows them on no other)."""
        if v and info.data.get("role") != "assistant":
            raise ValueError(
                f"tool_calls belong to assistant messages, not {info.data.get('role')!r}"
            )
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_required(cls, v, info):
        """A tool message answers one call: it must name it (OpenAI answers 400 without)."""
        if v is None and info.data.get("role") == "tool":
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        """A content part other than text (``image_url``, ``input_audio``, ``file``...) gets a
        message that says so, and a malformed part (not an object, no ``type``, a text part
        without a string ``text``) one that names it, not the union's "valid string" error."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                if isinstance(part, TextPart):  # built in Python, already validated
                    continue
                if not isinstance(part, dict):
                    raise ValueError(
                        f"content part {i} is not an object: a content list holds "
                        '{"type": "text", "text": "..."} parts'
                    )
                kind = part.get("type")
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type '{kind}' are not supported: this server takes "
                        "text only (a string or a list of text parts)"
                    )
                if not isinstance(kind, str):
                    raise ValueError(
                        f'content part {i} has no string "type" (a text part has "type": "text")'
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f'content part {i} of type "text" needs a string "text"')
        return v

    @field_validator("content")
    @classmethod
    def _content_required(cls, v, info):
        """content may be null or absent only on an assistant message with tool_calls; the error
        names ``messages.<i>.content``."""
        data = info.data
        calls = data.get("role") == "assistant" and data.get("tool_calls")
        if v is None and not calls:
            if data.get("role") == "assistant":
                raise ValueError(
                    "an assistant message needs content (a string or a list of text parts) "
                    "or tool_calls; it has neither (content is null or missing)"
                )
            raise ValueError(
                "content is null or missing: a string or a list of text parts is required"
            )
        if isinstance(v, list) and not v and not calls:  # OpenAI: at least one part
            raise ValueError("content given as a list needs at least one text part")
        return v

    def text(self) -> str | None:
        """The content as one string: text parts joined with newlines (as vLLM joins them for
        templates that take a string)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, strict=True)
    # vLLM's usage in every chunk: not served (null or false only)
    continuous_usage_stats: bool | None = Field(None, strict=True)

    @field_validator("continuous_usage_stats")
    @classmethod
    def _final_usage_only(cls, v):
        if v:
            raise ValueError(
                "continuous_usage_stats is not supported by this server: include_usage puts "
                "the usage in the final chunk"
            )
        return v


def non_empty_name(v: str) -> str:
    """A name that must not be empty (a plain ``str`` field with this after-validator, not
    ``min_length``: a length constraint makes pydantic-core refuse a lone surrogate itself,
    with its own error, before :mod:`server.text_check` can name the field as ``invalid_text``).

    Raises:
        ValueError: for ``""``.
    """
    if not v:
        raise ValueError("the name must not be empty")
    return v


class FunctionDef(_Lenient):
    """A tool's function. ``name`` must not be empty (a call to it could not be told apart);
    OpenAI also holds it to ``^[a-zA-Z0-9_-]{1,64}$``, which this server does not, as vLLM
    does not (see :class:`JsonSchemaFormat`: the openai client names tools after model
    classes too); names are unique within a request (:func:`unique_tool_names`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    _name = field_validator("name")(non_empty_name)


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"] = "function"
    function: NamedFunction


def named_tool_choice(v):
    """``tool_choice`` given as an object, validated as :class:`NamedToolChoice` (a before
    validator: the union would otherwise report the string choices' error for any object).

    Raises:
        ValueError: naming what of the object is wrong.
    """
    if not isinstance(v, dict):
        return v
    try:
        return NamedToolChoice.model_validate(v)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "the object"
        raise ValueError(
            'a named tool choice is {"type": "function", "function": {"name": "..."}}; '
            f"{where}: {err.get('msg', 'invalid')}"
        ) from None


def thinking_switch(v):
    """``chat_template_kwargs``: ``enable_thinking``, where given and not null, must be a JSON
    boolean (the Qwen3 template tests ``enable_thinking is false``: the string "no" would turn
    thinking on; null means unset, as for the template).

    Raises:
        ValueError: for another type.
    """
    flag = v.get("enable_thinking") if isinstance(v, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"enable_thinking must be true or false, got {type(flag).__name__}")
    return v


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


def unique_tool_names(v):
    """``tools``: no two with one function name (a call, or a ``tool_choice`` naming it, would
    not say which of them is meant).

    Raises:
        ValueError: naming the repeated name and both places.
    """
    seen: dict[str, int] = {}
    for i, tool in enumerate(v or ()):
        first = seen.setdefault(tool.function.name, i)
        if first != i:
            raise ValueError(
                f"tools {first} and {i} are both named {tool.function.name!r}: "
                "function names must be unique"
            )
    return v


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema`` (OpenAI): the schema the output must validate against.

    ``name`` is required, as in vLLM (``JsonSchemaResponseFormat.name: str``), and must not be
    empty (this server's rule); a missing or empty one is a 400 naming
    ``response_format.json_schema.name``. OpenAI also holds it to ``^[a-zA-Z0-9_-]{1,64}$``;
    this server does not, as vLLM does not: the openai client's ``parse()`` names the format
    after the model class (``Page[Item]`` for a generic one), and the name changes nothing in
    the output.
    """

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)

    _name = field_validator("name")(non_empty_name)


class ResponseFormat(_Lenient):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Lenient):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = Field(None, strict=True)


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's ``metadata`` limits: keys of at most 64 characters, values of at most 512.

    Raises:
        ValueError: naming the first key or value over its limit.
    """
    for key, value in (v or {}).items():
        if len(key) > 64:
            raise ValueError(f"metadata keys are at most 64 characters; {key[:20]!r}... is longer")
        if len(value) > 512:
            raise ValueError(f"metadata values are at most 512 characters; {key!r}'s is longer")
    return v


class SamplingFields(_Request):
    """Fields shared by chat and text completions.

    An explicit ``null`` for a field with a default means that default (OpenAI's clients send
    ``null`` for options left unset, e.g. ``n=None``). Integer, float and boolean options are
    strict: ``true`` is not a count, ``"0.5"`` not a temperature and ``"yes"`` not a boolean
    (400, as OpenAI answers); a JSON integer is a float option's value.
    """

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (
                v is None
                and k in fields
                and not fields[k].is_required()
                and fields[k].default is not None
            )
        }

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N, strict=True)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    top_k: int | None = Field(None, ge=-1, strict=True)
    min_p: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, strict=True)
    logit_bias: dict[str, StrictFloat] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = Field(False, strict=True)
    min_tokens: int = Field(0, ge=0, strict=True)
    skip_special_tokens: bool = Field(True, strict=True)
    include_stop_str_in_output: bool = Field(False, strict=True)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    return_tokens_as_token_ids: bool = Field(False, strict=True)
    # accepted, no effect on the output (see the module docstring); OpenAI's limits: at most
    # 16 pairs, string keys of at most 64 characters and string values of at most 512
    metadata: dict[str, str] | None = Field(None, max_length=16, strict=True)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    guided_decoding_backend: str | None = None
    spaces_between_special_tokens: bool = Field(True, strict=True)
    # OpenAI's best_of: only n (every sampled sequence is returned)
    best_of: int | None = Field(None, ge=1, strict=True)
    # not applied: null or the value that asks for nothing (NOT_APPLIED)
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    priority: Any = None
    request_id: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    structural_tag: Any = None
    return_token_ids: Any = None

    _not_applied = field_validator(*NOT_APPLIED, mode="before")(no_op_only)
    _metadata = field_validator("metadata")(check_metadata)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(
                f"best_of must equal n ({n}): this server samples n sequences and returns them all"
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for key, val in v.items():
            # int() would also take " 5", "+5", "05", "1_0" or "\u0665" (a non-ASCII digit)
            if not _TOKEN_ID.fullmatch(key):
                shown = key if len(key) <= 40 else key[:40] + "..."
                raise ValueError(
                    f'logit_bias keys must be token ids written in decimal (e.g. "1234"), '
                    f"got {shown!r}"
                )
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {val}")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = Field(True, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = Field(True, strict=True)
    continue_final_message: bool = Field(False, strict=True)
    add_special_tokens: bool = Field(False, strict=True)
    # vLLM's: false drops reasoning_content (the reasoning parser's split) from the response
    include_reasoning: bool = Field(True, strict=True)
    # vLLM's chat echo (prepend the last message): rejected when true
    echo: bool = Field(False, strict=True)
    # not applied: null or the value that asks for nothing (CHAT_NOT_APPLIED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    modalities: Any = None
    store: Any = None
    service_tier: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    _tool_choice = field_validator("tool_choice", mode="before")(named_tool_choice)
    _tool_names = field_validator("tools")(unique_tool_names)
    _template_kwargs = field_validator("chat_template_kwargs")(thinking_switch)
    _chat_not_applied = field_validator(*CHAT_NOT_APPLIED, mode="before")(no_op_only)


#: what a completions prompt may be (OpenAI's four shapes)
PROMPT_SHAPES = (
    "prompt must be a string, an array of strings, an array of token ids (integers) or an "
    "array of arrays of token ids"
)


def json_kind(value: Any) -> str:
    """The JSON type of a parsed value, with its article ("a string", "an integer", ...)."""
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "an integer", float: "a number", list: "an array"}.get(
        type(value), "null" if value is None else "an object"
    )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=0, strict=True)  # 0: score the prompt only (with echo)
    echo: bool = Field(False, strict=True)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    suffix: str | None = None
    add_special_tokens: bool = Field(True, strict=True)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One clear message for a prompt of none of the four shapes (pydantic's own names one
        union branch's failure, e.g. "Input should be a valid string" for ``["a", 1]``)."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(f"{PROMPT_SHAPES}, got {json_kind(v)}")
        if not v:  # the code the endpoint gives an empty string (server.completions)
            raise PydanticCustomError("invalid_value", "prompt must not be empty")
        first = json_kind(v[0])
        if first not in ("a string", "an integer", "an array"):
            raise ValueError(f"{PROMPT_SHAPES}; element 0 is {first}")
        for i, x in enumerate(v):
            kind = json_kind(x)
            if kind != first:
                raise ValueError(f"{PROMPT_SHAPES}; element {i} is {kind}, element 0 {first}")
            if kind == "an array":
                bad = next((j for j, t in enumerate(x) if json_kind(t) != "an integer"), None)
                if bad is not None:
                    raise ValueError(
                        f"{PROMPT_SHAPES}; element {i} is an array with {json_kind(x[bad])} "
                        f"at index {bad}"
                    )
        return v


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, strict=True)
    return_token_strs: bool = Field(False, strict=True)


class TokenizeChatRequest(_Request):
    """``POST /tokenize`` with chat messages, rendered as ``/v1/chat/completions`` renders them
    (vLLM's shape; ``tool_choice`` "none" leaves the tools out, as in chat completions)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = Field(True, strict=True)
    continue_final_message: bool = Field(False, strict=True)
    add_special_tokens: bool = Field(False, strict=True)
    return_token_strs: bool = Field(False, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    # vLLM's /tokenize takes these too; not applied: null only (CHAT_NOT_APPLIED)
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    _tool_choice = field_validator("tool_choice", mode="before")(named_tool_choice)
    _tool_names = field_validator("tools")(unique_tool_names)
    _template_kwargs = field_validator("chat_template_kwargs")(thinking_switch)
    _not_applied = field_validator("chat_template", "mm_processor_kwargs", mode="before")(
        no_op_only
    )


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[StrictInt]


# ------------------------------------------------------------------ responses
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id matched


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprobValue] | None] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprobValue(BaseModel):
    """One token of vLLM's ``prompt_logprobs`` dicts."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id matched
    prompt_logprobs: list[dict[str, PromptLogprobValue] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qwen-serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
