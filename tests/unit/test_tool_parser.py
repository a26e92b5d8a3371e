"""Qwen3ToolParser: streamed output, under every chunking, equals the non-streamed parse."""

import json
import random
import re
import zlib

import pytest

from server.tool_parser import Qwen3ToolParser

W = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    "\n</tool_call>"
)
T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "东京 🗼"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
WEATHER = ("get_weather", '{"city": "Paris", "unit": "c"}')
TIME = ("get_time", '{"tz": "东京 🗼"}')

CASES = {  # text -> (content, [(name, arguments)])
    "plain": ("Just an answer.\nWith two lines.", "Just an answer.\nWith two lines.", []),
    "one_call": (W, None, [WEATHER]),
    "two_calls": (W + "\n" + T, None, [WEATHER, TIME]),
    "content_then_call": (
        "Let me check the weather.\n\n" + W,
        "Let me check the weather.",
        [WEATHER],
    ),
    "text_between_and_after": (
        "a\n" + W + "\nb\n" + T + "\n\nc \n",
        "a\n\nb\n\n\nc",
        [WEATHER, TIME],
    ),
    "malformed_json": (BAD, BAD, []),
    "malformed_then_good": ("x " + BAD + "\n" + T, "x " + BAD, [TIME]),
    "not_an_object": ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    "empty_block": ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    "string_arguments": (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [("f", '{"x": 1}')],
    ),
    "string_arguments_not_json": (  # encoded as a JSON string literal: arguments always parse
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        None,
        [("f", '"not json"')],
    ),
    "string_arguments_json_but_not_an_object": (  # "123" stays a string, not the number 123
        '<tool_call>{"name": "f", "arguments": "123"}</tool_call>',
        None,
        [("f", '"123"')],
    ),
    "string_arguments_nan": (  # Python's json takes NaN; strict JSON parsers do not
        '<tool_call>{"name": "f", "arguments": "NaN"}</tool_call>',
        None,
        [("f", '"NaN"')],
    ),
    "no_arguments": ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    "unclosed_valid": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',
        None,
        [("f", '{"a": 1}')],
    ),
    "unclosed_truncated": (
        'ok <tool_call>\n{"name": "f", "argu',
        'ok <tool_call>\n{"name": "f", "argu',
        [],
    ),
    "chinese_emoji": ("好的，我来查一下 😊\n" + T, "好的，我来查一下 😊", [TIME]),
    "lt_not_tags": (
        "if a < b and b <tool x then <tool_cal",
        "if a < b and b <tool x then <tool_cal",
        [],
    ),
    "tool_prefix_at_end": ("the end <tool", "the end <tool", []),
    "close_tag_outside": ("a </tool_call> b", "a </tool_call> b", []),
    "whitespace_only": ("  \n\n ", None, []),
    "empty": ("", None, []),
}


def chunkings(text, seed=0, n_random=30):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(8, len(text) + 1))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]  # may contain empty deltas


def stream(chunks):
    p = Qwen3ToolParser()
    content, calls = [], []
    for c in chunks:
        t, cs = p.feed(c)
        content.append(t)
        calls += cs
    t, cs = p.finish()
    return "".join(content) + t, calls + cs


def shape(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name", CASES)
def test_parse_expected(name):
    text, content, calls = CASES[name]
    got_content, got_calls = Qwen3ToolParser.parse(text)
    assert got_content == content
    assert shape(got_calls) == calls
    for c in got_calls:
        assert set(c) == {"id", "type", "function"} and c["type"] == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"])
        json.loads(c["function"]["arguments"])


@pytest.mark.parametrize("name", CASES)
def test_streamed_equals_parse(name):
    text = CASES[name][0]
    content, calls = Qwen3ToolParser.parse(text)
    for chunks in chunkings(text, seed=zlib.crc32(name.encode())):
        s_content, s_calls = stream(chunks)
        assert s_content == (content or ""), chunks
        assert shape(s_calls) == shape(calls), chunks
        assert [c["index"] for c in s_calls] == list(range(len(calls)))
        for c in s_calls:
            assert c["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c["id"])


def test_call_emitted_when_closing_tag_arrives():
    p = Qwen3ToolParser()
    assert p.feed("Sure.\n<tool") == ("Sure.", [])
    assert p.feed(W[5:-5]) == ("", [])  # '_call>\n{...}\n</tool_'
    content, calls = p.feed("call>\n")
    assert content == "" and shape(calls) == [WEATHER] and calls[0]["index"] == 0
    assert p.finish() == ("", [])


def test_no_tag_fragment_leaks():
    p = Qwen3ToolParser()
    out = [p.feed(c)[0] for c in "ok " + W + "\n" + T] + [p.finish()[0]]
    assert "".join(out) == "ok" and all("<" not in o for o in out)
