"""Text that cannot be encoded -- a lone UTF-16 surrogate, what a JavaScript client sends when it
cuts an emoji in half -- in any string field of any endpoint is a 400 naming the field, never a
500, and leaks nothing."""

from __future__ import annotations

import httpx
import pytest

from server.context import ServerContext
from server.errors import APIError
from tests.metricsutil import num_kv_blocks, scrape

MODEL = "qwen3-embedded"
LONE = "\\ud800"  # a JSON escape: json.loads gives a str holding the surrogate
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _chat(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [USER], **fields}


# (path, JSON body text with LONE in one field, expected param)
CASES = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": f"a{LONE}b"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": f"x{LONE}"}]}]},
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [USER, {"role": "user", "content": "ok", "name": f"n{LONE}"}]},
        "messages.1.name",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "x", "reasoning_content": f"r{LONE}"},
                USER,
            ]
        },
        "messages.1.reasoning_content",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {**CALL, "function": {"name": "f", "arguments": f'{{"k": "{LONE}"}}'}}
                    ],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {**CALL, "function": {"name": "f", "arguments": {"k": [f"v{LONE}"]}}}
                    ],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments.k.0",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "r", "tool_call_id": f"call{LONE}"},
            ]
        },
        "messages.2.tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"tools": [{**TOOL, "function": {**TOOL["function"], "description": f"d{LONE}"}}]},
        "tools.0.function.description",
    ),
    (
        "/v1/chat/completions",
        {
            "tools": [
                {
                    **TOOL,
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {f"p{LONE}": {}}},
                    },
                }
            ]
        },
        "tools.0.function.parameters.properties",
    ),
    (
        "/v1/chat/completions",
        {"tools": [{**TOOL, "function": {"name": f"f{LONE}"}}]},
        "tools.0.function.name",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": f"n{LONE}"}}},
        "response_format.json_schema.name",
    ),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": f"{LONE}"}}, "chat_template_kwargs.x"),
    ("/v1/chat/completions", {"stop": f"s{LONE}"}, "stop.0"),
    ("/v1/chat/completions", {"stop": ["ok", f"{LONE}"]}, "stop.1"),
    ("/v1/chat/completions", {"model": f"m{LONE}"}, "model"),
    ("/v1/chat/completions", {"user": f"u{LONE}"}, "user"),
    ("/v1/completions", {"prompt": f"p{LONE}"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", f"p{LONE}"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "ok", "stop": [f"{LONE}x"]}, "stop.0"),
    ("/tokenize", {"prompt": f"p{LONE}"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": f"{LONE}"}]}, "messages.0.content"),
    ("/detokenize", {"tokens": [1], "model": f"{LONE}"}, "model"),
]


def _body_text(path: str, fields: dict) -> str:
    """The request as JSON text, with the surrogate as a JSON escape (what clients send)."""
    import json

    if path == "/v1/chat/completions":
        body = _chat(**fields)
    elif path == "/v1/completions":
        body = {"model": MODEL, "max_tokens": 2, **fields}
    else:
        body = fields
    # json.dumps would escape the backslash of LONE; undo that so the body holds \ud800
    return json.dumps(body).replace("\\\\ud800", "\\ud800")


@pytest.mark.parametrize("path,fields,param", CASES, ids=[c[2] + " " + c[0] for c in CASES])
def test_lone_surrogate_is_a_400_naming_the_field(server, path, fields, param):
    text = _body_text(path, fields)
    assert "\\ud800" in text and "\\\\ud800" not in text
    r = httpx.post(
        server.base_url + path,
        content=text.encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["code"] == "invalid_text" and err["type"] == "invalid_request_error"


def test_invalid_utf8_bytes_are_a_400(server):
    """Bytes that are not UTF-8 reach the request as surrogate escapes: the same 400."""
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}',  # a surrogate encoded as UTF-8
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "invalid_text"


def test_nothing_leaked_and_the_server_still_serves(server, client):
    for path, fields, _ in CASES[:3]:
        httpx.post(
            server.base_url + path,
            content=_body_text(path, fields).encode(),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "half an emoji: 😀"}], max_tokens=2
    )
    assert out.usage.completion_tokens >= 1
    m = scrape(server.base_url)
    assert m["qwen_serve:num_requests_running"] == 0
    assert m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m)


class _RefusingEncoder:
    """A tokenizer front that refuses a text (as tokenizers does with a value it cannot take)."""

    def encode(self, text: str) -> list[int]:
        raise ValueError("cannot encode this")


def test_any_text_the_tokenizer_refuses_is_a_400_naming_the_parameter():
    ctx = ServerContext(
        engine=None, tokenizer=None, model_name=MODEL, metrics=None, encoder=_RefusingEncoder()
    )
    with pytest.raises(APIError) as exc:
        ctx.encode_prompt("anything", "prompt.3")
    assert exc.value.status == 400 and exc.value.param == "prompt.3"
