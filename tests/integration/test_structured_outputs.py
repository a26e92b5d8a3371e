"""Structured outputs and enforced tool calls over real HTTP, on the embedded random-weight model.

Its free output is gibberish, so every valid output here is the grammar's doing. Outputs are
checked with independent tools: the ``jsonschema`` validator (formats included), Python's ``re``,
and the openai client's own ``chat.completions.parse``.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.schemas import SCHEMAS, obj
from tests.serverproc import ServerProcess

MODEL = "qwen3-embedded"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": obj(
            {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            }
        ),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": obj({"zone": {"enum": ["UTC", "CET", "PST"]}}),
    },
}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def srv():
    """A server without the reasoning parser (grammars constrain from the first token)."""
    s = ServerProcess("--max-model-len", "2048", "--grammar-compile-timeout", "20").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(
        base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )


def _validate(schema, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


async def _chat_all(base: str, bodies: list[dict], stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) of each chat body, all sent at once."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(body):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "JSON please"}],
                **body,
            }
            if not stream:
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return choice["message"]["content"], choice["finish_reason"]
            text, finish = "", None
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for c in chunk["choices"]:
                        text += c["delta"].get("content") or ""
                        finish = c.get("finish_reason") or finish
            return text, finish

        return await asyncio.gather(*(one(b) for b in bodies))


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_json_schemas_at_temperature_1_finish_with_stop_and_validate(srv, stream):
    bodies = [
        {
            "temperature": 1.0,
            "max_tokens": 300,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": s, "strict": True},
            },
        }
        for i, s in enumerate(SCHEMAS)
    ]
    results = asyncio.run(_chat_all(srv.base_url, bodies, stream))
    assert len(results) >= 50
    for schema, (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (schema, text)
        _validate(schema, text)


def test_json_object_regex_and_choice_on_both_endpoints(srv):
    # json_object: any object. The random model's logits are near flat, so a bias towards the
    # tokens that close an object or a string ("}", "}\n", '"}', '"') lets it end (40 of 40
    # seeds ended within 200 tokens); the grammar still decides which of them may come next.
    close = {"92": 6.0, "532": 6.0, "9207": 6.0, "1": 5.0}
    r = httpx.post(
        srv.base_url + "/v1/chat/completions",
        timeout=300,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "obj"}],
            "max_tokens": 200,
            "temperature": 1.0,
            "seed": 4,
            "response_format": {"type": "json_object"},
            "logit_bias": close,
        },
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(
        json.loads(choice["message"]["content"]), dict
    )
    cases = [
        (
            {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}},
            lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,4}", t),
        ),
        ({"guided_regex": "(ab|cd)+x"}, lambda t: re.fullmatch("(ab|cd)+x", t)),
        (
            {"structured_outputs": {"choice": ["yes", "no way", 'a "quoted" one', "ß\\n"]}},
            lambda t: t in ["yes", "no way", 'a "quoted" one', "ß\\n"],
        ),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        (
            {
                "structured_outputs": {
                    "json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
                }
            },
            lambda t: isinstance(json.loads(t), list),
        ),
        (
            {"guided_json": json.dumps(obj({"k": {"enum": [1, 2]}}))},
            lambda t: json.loads(t)["k"] in (1, 2),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "x" ("y" | "z")+ "."'}},
            lambda t: re.fullmatch("x[yz]+\\.", t),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "q" [0-9] [0-9]'}},
            lambda t: re.fullmatch("q[0-9]{2}", t),
        ),
    ]
    for i, (fields, check) in enumerate(cases):
        for endpoint in ("chat", "completions"):
            path, body = _endpoint_request(endpoint, fields)
            body.update(temperature=1.0, max_tokens=60, seed=i)
            r = httpx.post(srv.base_url + path, json=body, timeout=300)
            assert r.status_code == 200, (fields, r.text)
            c = r.json()["choices"][0]
            text = c["message"]["content"] if endpoint == "chat" else c["text"]
            assert c["finish_reason"] == "stop" and check(text), (fields, endpoint, text)


def _endpoint_request(endpoint: str, fields: dict) -> tuple[str, dict]:
    """(path, body) of a request to "chat" or "completions" with the prompt "go" and ``fields``."""
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], **fields}
        return "/v1/chat/completions", body
    return "/v1/completions", {"model": MODEL, "prompt": "go", **fields}


def test_grammar_text_equal_to_a_special_token_is_spelled_with_ordinary_tokens(srv):
    # llguidance 1.9 tokenizes forced text with the HF tokenizer, which matches added tokens
    # inside text: its mask then allowed the special token alone and its parser refused it
    # (a 400 up front, or an error mid-request). The text must come out, spelled with ordinary
    # tokens (the detokenized text is the same).
    cases = [
        ({"structured_outputs": {"regex": "[a-z]{2}<\\|im_start\\|>"}}, "[a-z]{2}<\\|im_start\\|>"),
        ({"structured_outputs": {"regex": "abc </tool_call>"}}, "abc </tool_call>"),
        ({"guided_regex": "x<\\|im_end\\|>"}, "x<\\|im_end\\|>"),
        (
            {"response_format": _schema_format({"type": "string", "const": "<tool_call>"})},
            '"<tool_call>"',
        ),
    ]
    for i, (fields, pattern) in enumerate(cases):
        for endpoint, stream in (("chat", False), ("completions", False), ("chat", True)):
            path, body = _endpoint_request(endpoint, fields)
            body.update(temperature=1.0, max_tokens=40, seed=i, stream=stream)
            r = httpx.post(srv.base_url + path, json=body, timeout=300)
            assert r.status_code == 200, (fields, r.text)
            if stream:
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert events[-1] == "[DONE]" and "error" not in r.text, r.text
                chunks = [json.loads(e)["choices"] for e in events[:-1]]
                text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
                finish = [c[0]["finish_reason"] for c in chunks if c and c[0]["finish_reason"]]
            else:
                c = r.json()["choices"][0]
                text = c["message"]["content"] if endpoint == "chat" else c["text"]
                finish = [c["finish_reason"]]
            assert finish == ["stop"] and re.fullmatch(pattern, text), (fields, endpoint, text)
    # a choice between a special token's text and plain text (not forced at its start, so
    # llguidance's own mask already offered "<"): both options stay reachable
    seen = set()
    for seed in range(12):
        path, body = _endpoint_request(
            "completions", {"structured_outputs": {"choice": ["<think>", "x"]}}
        )
        body.update(temperature=1.0, max_tokens=20, seed=seed)
        r = httpx.post(srv.base_url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        seen.add(r.json()["choices"][0]["text"])
    assert seen == {"<think>", "x"}, seen


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    admin: bool


def test_openai_client_parse_returns_the_pydantic_object(oai):
    """``chat.completions.parse`` sends a strict json_schema response_format built from the model
    and parses the reply with pydantic: a ValidationError would fail the test."""
    r = oai.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "a person"}],
        response_format=Person,
        temperature=1.0,
        max_tokens=100,
        seed=4,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def _tool_args_ok(call: dict, tools: list[dict]) -> None:
    fn = {t["function"]["name"]: t["function"] for t in tools}[call["function"]["name"]]
    schema = fn.get("parameters") or {"type": "object"}
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_enforced_tool_calls_non_streamed(srv, choice, parallel):
    tools = [WEATHER, TIME, NO_ARGS]
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    for seed in range(4):
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            timeout=300,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "use a tool"}],
                "tools": tools,
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel,
                "temperature": 1.0,
                "max_tokens": 300,
                "seed": seed,
            },
        )
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        calls = c["message"]["tool_calls"]
        # OpenAI's: "tool_calls" for "required", "stop" for a named function
        assert c["finish_reason"] == ("stop" if choice == "named" else "tool_calls") and calls, c
        if not parallel or choice == "named":
            assert len(calls) == 1
        if choice == "named":
            assert calls[0]["function"]["name"] == "get_time"
        assert len({tc["id"] for tc in calls}) == len(calls)
        for tc in calls:
            _tool_args_ok(tc, tools)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_enforced_tool_calls_streamed(oai, parallel):
    tools = [WEATHER, TIME]
    for seed in range(3):
        stream = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "use a tool"}],
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            max_tokens=300,
            seed=seed,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    entry = calls.setdefault(
                        tc.index, {"id": tc.id, "function": {"name": "", "arguments": ""}}
                    )
                    entry["function"]["name"] += tc.function.name or ""
                    entry["function"]["arguments"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and calls
        if not parallel:
            assert len(calls) == 1
        assert len({c["id"] for c in calls.values()}) == len(calls)
        for c in calls.values():
            _tool_args_ok(c, tools)


def test_named_tool_call_streamed_finishes_with_stop(oai):
    """A named function streamed: one call of that function, and OpenAI's finish_reason for a
    named tool choice, "stop" (not "tool_calls")."""
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "use a tool"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=300,
        seed=0,
        stream=True,
    )
    names, args, finish = set(), "", None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    names.add(tc.function.name)
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "stop" and names == {"get_weather"}, (finish, names)
    _tool_args_ok({"function": {"name": "get_weather", "arguments": args}}, [WEATHER])


#: JSON schemas whose required nesting never ends
ENDLESS_OBJECT = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}
ENDLESS_ARRAY = {
    "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
    "$ref": "#/$defs/n",
}


@pytest.mark.parametrize(
    "fields,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1, 2]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"grammar": "start: undefined_rule"}},
            "structured_outputs.grammar",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        # no text matches these: the engine would end with an empty, non-matching output
        ({"guided_grammar": "root ::= root"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "start: x\nx: x"}}, "structured_outputs.grammar"),
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
        # every derivation is endless: llguidance would give up mid-request (was a 500)
        ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar"),
        (
            {"structured_outputs": {"grammar": 'root ::= "(" root ")"'}},
            "structured_outputs.grammar",
        ),
        ({"guided_json": ENDLESS_OBJECT}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": ENDLESS_ARRAY},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(srv, fields, param):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 5,
        **fields,
    }
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    assert "\n" not in err["message"] and "<state>" not in err["message"], err  # no parser dump
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_more_enforced_tools_than_the_grammar_engine_takes_is_a_clear_400(srv):
    """2,500 tools under ``tool_choice: "required"``: one rule of 2,500 alternatives, over
    llguidance's 2,000 per parser row. The 400 names ``tool_choice`` and says so (it read "no
    finite text matches it (it forces an endless output" before), and the server goes on."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(2500)
    ]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 5,
    }
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice", err
    assert "more alternatives than llguidance takes (2,000" in err["message"], err
    assert "2500 items" in err["message"] and "\n" not in err["message"], err
    assert "left-recursive" not in err["message"], err  # llguidance's hint, not for a tools list
    body["tools"], body["tool_choice"] = tools[:3], "required"
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_compile_time_bound_gives_400(tmp_path):
    """A grammar that compiles slower than --grammar-compile-timeout is a 400, and the server
    keeps answering meanwhile."""
    s = ServerProcess("--max-model-len", "512", "--grammar-compile-timeout", "0.01").wait_ready()
    try:
        big = {
            "type": "object",
            "properties": {f"k{i}": {"enum": [f"v{i}_{j}" for j in range(40)]} for i in range(200)},
        }
        r = httpx.post(
            s.base_url + "/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 5,
                "structured_outputs": {"json": big},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.json", (
            r.text
        )
        assert "to compile" in r.json()["error"]["message"]
        ok = httpx.post(
            s.base_url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        )
        assert ok.status_code == 200
    finally:
        s.stop()


def test_constrained_requests_leave_unconstrained_neighbours_unchanged(srv):
    """A greedy unconstrained request: the same text alone and batched with constrained ones."""
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "temperature": 0.0,
        "max_tokens": 24,
    }
    alone = httpx.post(srv.base_url + "/v1/chat/completions", json=base, timeout=120).json()
    bodies = [
        {
            "temperature": 1.0,
            "max_tokens": 200,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMAS[i]},
            },
        }
        for i in range(8)
    ]

    async def mixed():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=600) as c:
            plain = c.post("/v1/chat/completions", json=base)
            constrained = [
                c.post(
                    "/v1/chat/completions", json={"model": MODEL, "messages": base["messages"], **b}
                )
                for b in bodies
            ]
            return await asyncio.gather(plain, *constrained)

    got = asyncio.run(mixed())
    assert (
        got[0].json()["choices"][0]["message"]["content"]
        == alone["choices"][0]["message"]["content"]
    )
    for schema, r in zip(SCHEMAS, got[1:]):
        _validate(schema, r.json()["choices"][0]["message"]["content"])


# ------------------------------------------------------------------ earlier assistant turns
def _hf_render(checkpoint, messages, tools):
    """transformers' own chat-template rendering of the same checkpoint (the reference)."""
    from transformers import PreTrainedTokenizerFast

    from engine.frontend.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    return hf.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        chat_template=tok.chat_template,
    )


def _conversation(arguments):
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
    ]


def _check_rendering(checkpoint):
    from engine.frontend.tokenizer import Tokenizer
    from server.chat import render_prompt
    from server.protocol import ChatCompletionRequest

    args = {"city": "Paris", "days": 2}
    req = ChatCompletionRequest(
        model="m", messages=_conversation(json.dumps(args)), tools=[WEATHER]
    )
    ours = render_prompt(Tokenizer(checkpoint), req)
    reference = _hf_render(checkpoint, _conversation(args), [WEATHER])  # given the parsed object
    assert ours == reference
    assert '"arguments": {"city": "Paris", "days": 2}' in ours  # JSON once, not a quoted string
    assert '\\"city\\"' not in ours


def test_tool_call_arguments_render_as_json_once_qwen3_template():
    from engine.loader.embedded import ensure_embedded_checkpoint

    _check_rendering(ensure_embedded_checkpoint())


def test_tool_call_arguments_render_as_json_once_qwen25_template():
    from tests.integration.real_checkpoint_reference import (
        REAL_CHECKPOINT_DIR,
        real_checkpoint_available,
    )

    if not real_checkpoint_available():
        pytest.skip(
            "the Qwen2.5 chat template comes with the real checkpoint: run `make real-checkpoint`"
        )
    _check_rendering(REAL_CHECKPOINT_DIR)


def test_arguments_that_are_not_a_json_object_stay_as_they_are():
    from server.chat import tool_arguments

    assert tool_arguments('{"a": 1}') == {"a": 1}
    assert tool_arguments("not json") == "not json"
    assert tool_arguments("[1, 2]") == "[1, 2]"
    assert tool_arguments({"b": 2}) == {"b": 2}
    deep = "[" * 100_000 + "]" * 100_000  # past json's recursion limit (a RecursionError, a 500)
    assert tool_arguments(deep) == deep
    assert tool_arguments('{"a": NaN}') == '{"a": NaN}'  # not JSON (the parser's json_object)


# ------------------------------------------------------------------ with the reasoning parser
SMALL = obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}})


def test_grammar_constrains_the_answer_after_think_with_the_reasoning_parser(server):
    """The shared server runs ``--reasoning-parser qwen3``. Thinking off (the template closes the
    think block): constrained from the first token. Thinking on: the reasoning is free and the
    answer after ``</think>`` is constrained (a bias makes the random model close its reasoning
    at once; the mask then overrides the bias)."""
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL}}
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 80,
        "response_format": rf,
    }
    off = httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=300,
        json={**base, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    _validate(SMALL, off["choices"][0]["message"]["content"])
    on = httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=300,
        json={**base, "logit_bias": {"151668": 100}},
    ).json()
    msg = on["choices"][0]["message"]
    _validate(SMALL, msg["content"])
    assert on["choices"][0]["finish_reason"] == "stop"
    assert not msg.get("reasoning_content")


def test_thinking_state_on_rendered_qwen3_prompts():
    """Where the grammar starts, and whether the output starts as reasoning, is read off the
    prompt the Qwen3 template renders: a new turn with thinking on waits for the model's
    reasoning; thinking off, and a continued final message whose think block the template
    closed (or that only mentions the tag), start with the answer; a continued message still
    inside its reasoning, or a prompt ending in an open ``<think>``, starts inside it."""
    from engine.frontend.tokenizer import Tokenizer
    from engine.loader.embedded import ensure_embedded_checkpoint
    from server.chat import render_prompt
    from server.protocol import ChatCompletionRequest
    from server.reasoning import thinking_state

    tok = Tokenizer(ensure_embedded_checkpoint())
    user = [{"role": "user", "content": "hi"}]

    def state(messages, **extra):
        req = ChatCompletionRequest(model=MODEL, messages=messages, **extra)
        return thinking_state(render_prompt(tok, req), req.continue_final_message)

    assert state(user) == "before"
    assert state(user, chat_template_kwargs={"enable_thinking": False}) == "after"
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    for text, expected in [
        ("Answer:", "after"),
        ("The <think> tag is", "after"),
        ("<think>\nLet me see", "inside"),
        ("<think>\nDone.\n</think>\n\nSo", "after"),
    ]:
        assert state(user + [{"role": "assistant", "content": text}], **cont) == expected, text
    opened = render_prompt(tok, ChatCompletionRequest(model=MODEL, messages=user)) + "<think>\n"
    assert thinking_state(opened, False) == "inside"
    assert thinking_state("no assistant turn at all", True) == "before"
    assert thinking_state("other template </think>\n", False) == "after"


def test_grammar_constrains_a_continued_final_message_with_the_reasoning_parser(server):
    """``continue_final_message`` under ``--reasoning-parser qwen3``: the template closed the
    think block before the partial answer, so the continuation is constrained from its first
    token (it waited for a ``</think>`` the model never writes: unconstrained text)."""
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL}}
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Answer:"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 80,
        "response_format": rf,
    }
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300, json=body).json()
    _validate(SMALL, r["choices"][0]["message"]["content"])
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_grammar_failing_mid_request_is_the_requests_error(srv, stream):
    """A grammar that starts fine but whose chosen branch never ends (``logit_bias`` steers the
    first token into it) fails while the request runs: the client gets the request's error
    (400 / an error event, code ``grammar_error``, llguidance's first line only), not an
    engine fault, and the server keeps serving."""
    a_id = httpx.post(srv.base_url + "/tokenize", json={"prompt": "a"}, timeout=60).json()
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 8,
        "temperature": 0,
        "guided_grammar": 'root ::= "b" | "a" x\nx ::= "(" x ")"',
        "logit_bias": {str(a_id["tokens"][0]): 100},
        "stream": stream,
    }
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
    if stream:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        err = events[-1]["error"]
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    assert err["code"] == "grammar_error" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("structured output: ") and "\n" not in err["message"], err
    assert httpx.get(srv.base_url + "/health").status_code == 200
