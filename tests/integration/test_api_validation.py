"""Request validation over real HTTP: every rule answers 400 with an OpenAI error body naming the
parameter, an unknown model 404, an oversized body 413; an unknown field is a 400 naming it, a
known field the server does not apply is accepted only with the value that asks for nothing;
and no input, bad or merely unusual, breaks the engine loop or changes another request's output.

Requests go through the official openai client (it sends whatever it is given, so it can carry
most bad values); raw httpx is used for what it cannot send (invalid JSON, huge or chunked bodies).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "qwen3-embedded"
MESSAGES = [{"role": "user", "content": "Tell me a short story."}]
GREEDY = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
ERROR_KEYS = {"message", "type", "param", "code"}
EXTRA_FIELDS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "prompt_logprobs",
    "echo",
    "include_stop_str_in_output",
    "chat_template_kwargs",
    "structured_outputs",
}


@pytest.fixture(scope="module")
def baseline(client):
    """The greedy reference text, taken before any bad request."""
    return client.chat.completions.create(**GREEDY).choices[0].message.content


def request_args(endpoint: str, fields: dict) -> dict:
    """openai-client arguments: a small default request overridden by `fields` (vLLM-style
    fields travel in extra_body)."""
    fields = dict(fields)
    extra = {k: fields.pop(k) for k in list(fields) if k in EXTRA_FIELDS}
    base = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "Hello world"}
    return {"model": MODEL, "max_tokens": 4, **base, **fields, "extra_body": extra or None}


def send(client, endpoint: str, fields: dict):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    return create(**request_args(endpoint, fields))


LONG_PROMPT = "word " * 2100  # about 2100 tokens: over --max-model-len 2048 by itself
#: the longest integer Python's JSON parser takes (4300 digits); the prompt length added to it
#: has one more, which str() refuses: messages must not print such sums
HUGE = 10**4300 - 1

# (endpoint, request fields, the parameter the error must name)
BAD_REQUESTS = [
    # messages
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages.0.tool_calls",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}]},
        "messages.0.content",
    ),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages.0.content",
    ),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        "messages.1.content",
    ),
    ("chat", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("chat", {"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ("chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "auto"},
        "tools",
    ),
    ("chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    # sampling ranges
    ("chat", {"temperature": 2.5}, "temperature"),
    ("chat", {"temperature": -0.1}, "temperature"),
    ("completions", {"temperature": 3}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_p": 1.01}, "top_p"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"min_p": 1.5}, "min_p"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"n": 0}, "n"),
    ("completions", {"n": 0}, "n"),
    ("chat", {"seed": 2**64}, "seed"),
    ("chat", {"stop": ["ok", ""]}, "stop"),
    ("chat", {"stop": [str(i) for i in range(17)]}, "stop"),
    ("chat", {"stop_token_ids": [10**9]}, "stop_token_ids"),
    ("chat", {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    # lengths
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_tokens": 2040}, "max_tokens"),
    ("chat", {"max_tokens": None, "max_completion_tokens": 2040}, "max_completion_tokens"),
    ("completions", {"max_tokens": 2047}, "max_tokens"),
    ("chat", {"max_tokens": HUGE}, "max_tokens"),
    ("chat", {"max_tokens": None, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ("completions", {"max_tokens": HUGE}, "max_tokens"),
    ("chat", {"max_tokens": 4, "min_tokens": HUGE}, "min_tokens"),
    ("completions", {"max_tokens": None, "min_tokens": HUGE}, "min_tokens"),
    ("chat", {"max_tokens": None, "min_tokens": 2047}, "min_tokens"),  # more than the room left
    ("completions", {"max_tokens": None, "min_tokens": 2048}, "min_tokens"),
    # other integers, huge
    ("chat", {"n": HUGE}, "n"),
    ("chat", {"seed": HUGE}, "seed"),
    ("chat", {"seed": -HUGE}, "seed"),
    ("chat", {"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("chat", {"logprobs": True, "top_logprobs": HUGE}, "top_logprobs"),
    ("completions", {"logprobs": HUGE}, "logprobs"),
    ("completions", {"prompt_logprobs": HUGE}, "prompt_logprobs"),
    ("completions", {"prompt": [HUGE]}, "prompt"),
    ("chat", {"logit_bias": {str(HUGE): 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"9" * 5000: 5}}, "logit_bias"),  # too long even for int()
    ("completions", {"prompt": LONG_PROMPT}, "prompt"),
    (
        "chat",
        {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": None},
        "messages",
    ),
    # logprobs
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("chat", {"echo": True}, "echo"),
    # max_tokens 0 only scores a prompt (echo / prompt_logprobs)
    ("completions", {"max_tokens": 0}, "max_tokens"),
    # logit_bias
    ("chat", {"logit_bias": {"apple": 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"1.5": 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"151936": 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"100": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"100": -100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"100": "high"}}, "logit_bias.100"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    # keys int() would take: only canonical decimal ids (ASCII digits, no sign/space/leading 0)
    *[
        ("chat", {"logit_bias": {key: 5}}, "logit_bias")
        for key in (" 5", "5 ", "+5", "\u0665", "05", "-0", "1_0", "")
    ],
    ("completions", {"logit_bias": {"\uff15": 1}}, "logit_bias"),  # a fullwidth 5
    # prompts
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": [151936]}, "prompt"),
    ("completions", {"prompt": [-3, 5]}, "prompt"),
    ("completions", {"suffix": "tail"}, "suffix"),
    # strict types: a boolean is not a count, a string not a boolean (OpenAI answers 400)
    ("chat", {"max_tokens": True}, "max_tokens"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"top_p": True}, "top_p"),
    ("completions", {"presence_penalty": "1"}, "presence_penalty"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"n": "2"}, "n"),
    ("completions", {"prompt": [True, False]}, "prompt"),  # not token ids 1 and 0
    ("completions", {"prompt": [[5, True]]}, "prompt"),
    ("chat", {"stop_token_ids": [True]}, "stop_token_ids.0"),
    ("completions", {"logit_bias": {"5": True}}, "logit_bias.5"),
    # nested yes/no options too
    (
        "chat",
        {"stream": True, "stream_options": {"include_usage": "no"}},
        "stream_options.include_usage",
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"},
            }
        },
        "response_format.json_schema.strict",
    ),
    ("chat", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    # json_schema.name: required, a non-empty string (vLLM's rule)
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}},
        "response_format.json_schema.name",
    ),
    # OpenAI's metadata: at most 16 string pairs, keys <= 64 and values <= 512 characters
    ("chat", {"metadata": {"a": 1}}, "metadata.a"),
    ("chat", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("chat", {"metadata": {"k" * 65: "v"}}, "metadata"),
    ("chat", {"metadata": {"k": "v" * 513}}, "metadata"),
    # the Qwen3 template would read the string "no" as thinking on
    ("chat", {"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
    # a named tool choice without its function
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function"},
        },
        "tool_choice",
    ),
    # an enforced tool call needs tools, and a named one a tool of that name
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
    ),
    # more than 64 choices: n names it when n > 1
    ("completions", {"prompt": ["a"] * 5, "n": 16}, "n"),
    # a tool result must name the call it answers (OpenAI answers 400)
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "ok"}]},
        "messages.1.tool_call_id",
    ),
    # stream_options without stream (OpenAI and vLLM answer 400)
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    # null where no default exists
    ("chat", {"messages": None}, "messages"),
    # a tool schema the engine cannot enforce, named by its own path
    (
        "chat",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "o"}}},
                {"type": "function", "function": {"name": "g", "parameters": {"type": "bogus"}}},
            ],
            "tool_choice": "required",
        },
        "tools.0.function.parameters",
    ),
    (
        "chat",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "g", "parameters": {"type": "bogus"}}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tools.1.function.parameters",
    ),
]


def _id(case):
    endpoint, body, param = case
    return f"{endpoint}-{param}-{json.dumps(body)[:40]}"


@pytest.mark.parametrize("endpoint,body,param", BAD_REQUESTS, ids=[_id(c) for c in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_parameter(client, baseline, endpoint, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        send(client, endpoint, body)
    assert e.value.status_code == 400
    payload = e.value.response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS
    err = payload["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_non_text_content_parts_are_named_as_unsupported(client):
    for part in (
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    ):
        content = [{"type": "text", "text": "look"}, part]
        with pytest.raises(openai.BadRequestError) as e:
            send(client, "chat", {"messages": [{"role": "user", "content": content}]})
        err = e.value.body
        assert err["param"] == "messages.0.content"
        assert f"content parts of type '{part['type']}' are not supported" in err["message"]


def test_min_tokens_over_the_limit_names_the_limit_field_sent(client):
    """min_tokens over the completion limit: the message names the field the request used
    (``max_completion_tokens`` or ``max_tokens``; it said max_tokens for either before)."""
    for field in ("max_completion_tokens", "max_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            send(client, "chat", {field: 2, "min_tokens": 3})
        err = e.value.body
        assert err["param"] == "min_tokens", err
        assert f"must not exceed {field} (2)" in err["message"], err


def test_malformed_text_parts_are_named(client):
    """A part without ``type``, a text part without a string ``text``, a part that is not an
    object: each 400 names the part (it read "Input should be a valid string" before)."""
    for part, said in (
        ({"text": "hi"}, 'content part 1 has no string "type"'),
        ({"type": 5, "text": "hi"}, 'content part 1 has no string "type"'),
        ({"type": "text"}, 'content part 1 of type "text" needs a string "text"'),
        ({"type": "text", "text": 3}, 'content part 1 of type "text" needs a string "text"'),
        ("hi", "content part 1 is not an object"),
    ):
        content = [{"type": "text", "text": "look"}, part]
        with pytest.raises(openai.BadRequestError) as e:
            send(client, "chat", {"messages": [{"role": "user", "content": content}]})
        err = e.value.body
        assert err["param"] == "messages.0.content" and said in err["message"], err


def test_null_content_says_what_the_message_needs(client):
    """An assistant message with neither content nor tool_calls is told it needs one of them;
    another role's null content is told the content is null or missing."""
    for messages, param, says in (
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages.1.content",
         "needs content (a string or a list of text parts) or tool_calls"),
        ([{"role": "user", "content": None}], "messages.0.content", "content is null or missing"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            send(client, "chat", {"messages": messages})
        assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


@pytest.mark.parametrize(
    "prompt,says",
    [
        (["a", 1], "element 1 is an integer, element 0 a string"),
        ([5, "a"], "element 1 is a string, element 0 an integer"),
        ([[1, 2], [3, "x"]], "element 1 is an array with a string at index 1"),
        ([[1], 2], "element 1 is an integer, element 0 an array"),
        ([1.5], "element 0 is a number"),
        ([None], "element 0 is null"),
        ([True, False], "element 0 is a boolean"),
        (5, "got an integer"),
        ({"text": "hi"}, "got an object"),
    ],
)
def test_prompt_of_no_allowed_shape_says_which(client, prompt, says):
    """One message naming the four shapes and the offending element (pydantic alone reports
    one union branch, e.g. "Input should be a valid string" for ["a", 1])."""
    with pytest.raises(openai.BadRequestError) as e:
        send(client, "completions", {"prompt": prompt})
    err = e.value.body
    assert err["param"] == "prompt" and "an array of token ids" in err["message"], err
    assert says in err["message"], err


@pytest.mark.parametrize(
    "prompt,says",
    [
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([[]], "prompt must not be empty"),
        (["a", ""], "element 1 is empty"),
        ([[1, 2], []], "element 1 is empty"),
    ],
)
def test_empty_prompts_are_named(client, prompt, says):
    with pytest.raises(openai.BadRequestError) as e:
        send(client, "completions", {"prompt": prompt})
    err = e.value.body
    assert err["param"] == "prompt" and says in err["message"], err
    assert err["code"] == "invalid_value", err


def test_context_length_message_gives_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        send(client, "chat", {"max_tokens": 2040})
    err = e.value.body
    prompt_tokens = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 1}
    ).usage.prompt_tokens
    assert "2048" in err["message"] and f"{prompt_tokens} in the prompt" in err["message"]
    assert "2040 for the completion" in err["message"] and err["code"] == "context_length_exceeded"


def test_huge_max_tokens_is_context_length_exceeded(server):
    """A max_tokens (or max_completion_tokens) far past any context: 400 context_length_exceeded
    naming the field used, the huge numbers written as "more than ...", on both endpoints."""
    cases = [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": HUGE}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": HUGE},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": HUGE}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 10**18 + 1}, "max_tokens"),
    ]
    for path, body, param in cases:
        for stream in (False, True):
            r = httpx.post(
                server.base_url + path,
                content=json.dumps({"model": MODEL, **body, "stream": stream}),
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 400, (path, param, r.text[:500])
            err = r.json()["error"]
            assert set(err) == ERROR_KEYS and err["param"] == param, err
            assert err["code"] == "context_length_exceeded", err
            assert "maximum context length is 2048 tokens" in err["message"], err
            assert "more than 1000000000000000000 for the completion" in err["message"], err
            assert len(err["message"]) < 300, err["message"][:300]


def test_huge_token_id_to_detokenize_is_400(server):
    r = httpx.post(
        server.base_url + "/detokenize",
        content=json.dumps({"tokens": [1, HUGE]}),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tokens", r.text[:500]
    assert "more than 1000000000000000000" in err["message"] and len(err["message"]) < 200


def test_values_nested_too_deeply_for_the_template_are_400(server):
    """A tool schema or call arguments nested some hundreds deep: JSON and pydantic take them,
    the template's conversion recursed past Python's limit (a 500 RecursionError). Now a 400
    naming the field, on chat completions and /tokenize, and the server goes on."""
    deep = '{"type": "string"}'
    for _ in range(400):
        deep = '{"type": "object", "properties": {"a": ' + deep + "}}"
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]"
    call = '{"id": "c1", "type": "function", "function": {"name": "f", "arguments": ' + deep + "}}"
    user = '{"role": "user", "content": "x"}'
    cases = (
        (f'{{"messages": [{user}], "tools": {tools}, "tool_choice": "auto"', "tools"),
        (
            f'{{"messages": [{user}, {{"role": "assistant", "tool_calls": [{call}]}}, '
            f'{{"role": "tool", "tool_call_id": "c1", "content": "r"}}]',
            "messages",
        ),
    )
    for fields, param in cases:
        for path, extra in (("/v1/chat/completions", ', "max_tokens": 2}'), ("/tokenize", "}")):
            r = httpx.post(
                server.base_url + path,
                content=fields + extra,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 400, (path, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and "nested too deeply" in err["message"], err
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_invalid_json_is_400(server):
    for raw in (
        b"{not json",
        b"[" * 100_000,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    ):
        r = httpx.post(
            server.base_url + "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS


def test_body_bytes_that_are_not_utf8_are_invalid_text(server):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        for raw in (b'{"prompt": "a\xffb", "max_tokens": 1}', b'{"prompt": "\xc3", "n": 1}'):
            r = httpx.post(
                server.base_url + path,
                content=raw,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "invalid_text", (path, r.text)
            assert "UTF-8" in err["message"] and err["param"] is None


def test_json_nested_too_deeply_is_json_invalid(server):
    """Valid JSON nested past the parser's recursion limit: a 400 that says so (not a text
    encoding error), and the server keeps answering."""
    raw = b'{"model": "m", "prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(
            server.base_url + path,
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "json_invalid", (path, r.text)
        assert "nested too deeply" in err["message"] and err["param"] is None
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_integer_literal_too_long_is_json_invalid(server):
    """An integer literal of more than 4300 digits (Python's limit: json.loads raises a
    ValueError, which FastAPI chains to its "error parsing the body"): 400 json_invalid saying
    so, not a text-encoding error; on every JSON route."""
    raw = b'{"model": "m", "prompt": "a", "messages": [], "tokens": [1], "n": ' + b"9" * 4301
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        r = httpx.post(
            server.base_url + path,
            content=raw + b"}",
            headers={"content-type": "application/json"},
            timeout=60,
        )
        err = r.json()["error"]
        assert r.status_code == 400 and set(err) == ERROR_KEYS, (path, r.text)
        assert err["code"] == "json_invalid" and err["param"] is None, (path, err)
        assert "integer literal too long to parse" in err["message"], (path, err)
        assert "UTF-8" not in err["message"]
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_null_means_the_default(client, baseline):
    """OpenAI's clients send null for options left unset: null is the field's default."""
    out = client.chat.completions.create(
        **GREEDY, n=None, stream=None, logprobs=None, parallel_tool_calls=None
    )
    assert len(out.choices) == 1 and out.choices[0].message.content == baseline
    assert out.choices[0].logprobs is None
    text = client.completions.create(
        model=GREEDY["model"], prompt="Hello", max_tokens=3, echo=None, logprobs=None, n=None
    )
    assert len(text.choices) == 1 and text.choices[0].logprobs is None


def test_empty_body_gets_a_clear_message(server):
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(
            server.base_url + endpoint, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 400 and "body is empty" in r.json()["error"]["message"]


def test_body_that_is_not_a_json_object_says_what_it_got(server):
    """A JSON array / string / null body names what it is; a JSON object sent as text/plain
    points at the content type. Both 400 with code invalid_type."""
    url = server.base_url + "/v1/completions"
    for body, got in (
        (b"[1, 2]", "an array"),
        (b'"hi"', "a string"),
        (b"null", "null"),
        (b"5", "an integer"),
        (b"2.5", "a number"),
        (b"true", "a boolean"),
    ):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_type", err
        assert err["message"] == f"the request body must be a JSON object, got {got}"
    r = httpx.post(
        url, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"}, timeout=60
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_type"
    assert "Content-Type: application/json" in err["message"]


def test_unknown_model_is_404(client):
    for call in (
        lambda: client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1),
        lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        err = e.value.response.json()["error"]
        assert (
            set(err) == ERROR_KEYS and err["param"] == "model" and err["code"] == "model_not_found"
        )
        assert "gpt-4o" in err["message"]


def test_oversized_body_is_413(server):
    """The default limit (4 MiB) holds for a declared Content-Length and for a chunked body."""
    big = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "a" * (5 << 20)}]}
    ).encode()
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=big,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS


def test_fields_without_effect_accepted_and_text_parts_accepted(client, baseline):
    """Fields that change no output (identifiers, hints, the no-op values of fields the server
    does not apply) and response fields echoed back inside a message are accepted."""
    messages = GREEDY["messages"] + [
        {"role": "assistant", "content": "Once", "refusal": None, "annotations": []},
        {"role": "user", "content": "Go on."},
    ]
    ref = client.chat.completions.create(**{**GREEDY, "messages": messages})
    out = client.chat.completions.create(
        **{**GREEDY, "messages": messages},
        extra_body={
            "metadata": {"k": "v"},
            "store": False,
            "parallel_tool_calls": False,
            "service_tier": "auto",
            "user": "u-1",
            "prompt_cache_key": "k",
            "modalities": ["text"],
            "use_beam_search": False,
            "length_penalty": 1.0,
            "best_of": 1,
            "bad_words": [],
            "priority": 0,
            "guided_decoding_backend": "xgrammar",
            "spaces_between_special_tokens": True,
            "reasoning_effort": None,
        },
    )
    assert out.choices[0].message.content == ref.choices[0].message.content
    # text parts: the same output as their text joined with a newline (vLLM's join)
    parts = [{"type": "text", "text": "Tell me a"}, {"type": "text", "text": "short story."}]
    out = client.chat.completions.create(
        **{**GREEDY, "messages": [{"role": "user", "content": parts}]}
    )
    joined = [{"role": "user", "content": "Tell me a\nshort story."}]
    ref = client.chat.completions.create(**{**GREEDY, "messages": joined})
    assert out.choices[0].message.content == ref.choices[0].message.content
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, n=2, extra_body={"best_of": 2}
    )
    assert out.usage.completion_tokens == 4
    # metadata at OpenAI's limits (16 pairs, 64-character keys, 512-character values) and a
    # json_schema name OpenAI would refuse but vLLM takes (the openai client's parse() of a
    # generic model sends "Page[Item]")
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    fmt = {"type": "json_schema", "json_schema": {"name": "Page[Item] x", "schema": {}}}
    out = client.chat.completions.create(
        **GREEDY, extra_body={"metadata": metadata, "response_format": fmt}
    )
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "endpoint,fields,param,says",
    [
        ("chat", {"frobnicate": [1]}, "frobnicate", "Unrecognized request argument"),
        ("completions", {"whatever": 1}, "whatever", "Unrecognized request argument"),
        ("chat", {"best_of": 3}, "best_of", "best_of must equal n"),
        ("completions", {"use_beam_search": True}, "use_beam_search", "not supported"),
        ("completions", {"use_beam_search": 0}, "use_beam_search", "not supported"),
        ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
        ("completions", {"bad_words": ["the"]}, "bad_words", "not supported"),
        ("completions", {"truncate_prompt_tokens": 1}, "truncate_prompt_tokens", "shorten"),
        ("chat", {"functions": [{"name": "f"}]}, "functions", "use tools"),
        ("chat", {"function_call": {"name": "f"}}, "function_call", "tool_choice"),
        ("chat", {"chat_template": "{{ 1/0 }}"}, "chat_template", "not supported"),
        ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
        ("chat", {"store": True}, "store", "not stored"),
        ("chat", {"service_tier": "flex"}, "service_tier", '"auto" or "default"'),
        (
            "chat",
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
            "final chunk",
        ),
    ],
)
def test_fields_not_applied_are_refused(client, endpoint, fields, param, says):
    """An unknown field, or a known one this server does not apply set to a value that asks
    for something: a 400 naming it (never accepted and dropped)."""
    fields = dict(fields)
    direct = {k: fields.pop(k) for k in ("stream", "stream_options") if k in fields}
    call = client.chat.completions if endpoint == "chat" else client.completions
    with pytest.raises(openai.BadRequestError) as exc:
        call.create(**{**request_args(endpoint, direct), "extra_body": fields})
    err = exc.value.body
    assert err["param"] == param and says in err["message"], err


CHAT_ONLY = {"chat_template_kwargs", "tools", "tool_choice", "logprobs", "top_logprobs"}

# Accepted but unusual values: each must work and leave other requests alone.
EDGE_REQUESTS = [
    {"seed": -(2**63), "temperature": 1.0},
    {"seed": 2**63 - 1, "temperature": 1.0, "n": 3},
    {"top_k": 10**9, "temperature": 1.0},
    {"top_k": 0, "temperature": 2.0, "top_p": 1e-9},
    {"repetition_penalty": 1e-6, "temperature": 0.5},
    {"min_p": 1.0, "temperature": 2.0},
    {"temperature": 1e-9},
    {
        "logit_bias": {str(i): (100 if i % 2 else -100) for i in range(0, 600, 3)},
        "temperature": 1.0,
    },
    {"logprobs": True, "top_logprobs": 20, "n": 4, "temperature": 1.0},
    {"stop": [str(i) for i in range(16)], "stop_token_ids": [0, 151643], "min_tokens": 2},
    {"ignore_eos": True, "logit_bias": {"151645": 100}},
    {"logit_bias": {"0": 1, "10": -1}},
    {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 1.0},
    {"n": 16, "max_tokens": 1, "temperature": 1.0},
    {"chat_template_kwargs": {"enable_thinking": False, "custom": {"nested": [1, 2]}}},
    {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "auto",
    },
]


def test_no_input_crashes_the_engine_or_changes_another_output(server, baseline):
    """A greedy stream runs while every bad request and every unusual valid one is sent; its
    text stays the reference, the server stays healthy, and greedy output is unchanged after."""

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as ac:

            async def victim():
                text = ""
                async for c in await ac.chat.completions.create(**GREEDY, stream=True):
                    text += (c.choices[0].delta.content or "") if c.choices else ""
                return text

            async def one(endpoint, fields):
                create = ac.chat.completions.create if endpoint == "chat" else ac.completions.create
                try:
                    return 200, await create(**request_args(endpoint, fields))
                except openai.APIStatusError as exc:
                    return exc.status_code, None

            task = asyncio.ensure_future(victim())
            await asyncio.sleep(0.05)
            results = await asyncio.gather(
                *(one(e, b) for e, b, _ in BAD_REQUESTS),
                *(one("chat", b) for b in EDGE_REQUESTS),
                *(
                    one("completions", {k: v for k, v in b.items() if k not in CHAT_ONLY})
                    for b in EDGE_REQUESTS
                ),
            )
            return await task, results

    text, results = asyncio.run(run())
    assert text == baseline
    statuses = [s for s, _ in results]
    assert statuses[: len(BAD_REQUESTS)] == [400] * len(BAD_REQUESTS)
    assert statuses[len(BAD_REQUESTS) :] == [200] * (2 * len(EDGE_REQUESTS))
    n16 = results[
        len(BAD_REQUESTS) + EDGE_REQUESTS.index({"n": 16, "max_tokens": 1, "temperature": 1.0})
    ][1]
    assert [c.index for c in n16.choices] == list(range(16))

    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    assert client.chat.completions.create(**GREEDY).choices[0].message.content == baseline


def test_a_taken_port_fails_start_up_before_the_model_loads(server):
    """A second server on the running server's port exits at once with one line naming the
    address (the socket is bound before the engine loads), and the first keeps serving."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "server", "--port", str(server.port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "engine ready" not in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t < 60
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_named_tool_choice_error_says_what_the_object_lacks(client):
    """An object ``tool_choice`` is checked as a named choice, not reported as a bad string."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice, lacking in (
        ({"type": "function"}, "function"),
        ({"type": "function", "function": {}}, "function.name"),
        ({"type": "tool", "function": {"name": "f"}}, "type"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            send(client, "chat", {"tools": tools, "tool_choice": choice})
        err = e.value.body
        assert err["param"] == "tool_choice"
        assert "a named tool choice is" in err["message"] and f"{lacking}:" in err["message"], err
