"""Qwen3ReasoningParser: streamed output, under every chunking, equals the non-streamed split."""

import random
import zlib

import pytest

from server.reasoning import Qwen3ReasoningParser

CASES = {
    "plain": ("Hello, world.\nSecond line.", None, "Hello, world.\nSecond line."),
    "think_answer": (
        "<think>\nLet me think.\nOK.\n</think>\n\nThe answer is 4.",
        "Let me think.\nOK.",
        "The answer is 4.",
    ),
    "unclosed_think": ("<think>\nStill thinking about it\n", "Still thinking about it\n", None),
    "think_no_answer": ("<think>\nonly reasoning\n</think>\n\n", "only reasoning", None),
    "empty_think": ("<think>\n\n</think>\n\nHi", None, "Hi"),
    "only_open_tag": ("<think>", None, None),
    "only_open_tag_newline": ("<think>\n", None, None),  # max_tokens right after the tag
    "empty": ("", None, None),
    "tool_call_after_think": (
        '<think>\nuse tool\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "use tool",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ),
    "chinese_emoji": (
        "<think>\n让我想想 🤔\n</think>\n\n答案是 42 🎉",
        "让我想想 🤔",
        "答案是 42 🎉",
    ),
    "chinese_plain": ("你好，世界 🌍", None, "你好，世界 🌍"),
    "lt_not_tags": (
        "<think>\nis a < b? </thinking> <think>\n</think>\n\nyes, a < b <tool",
        "is a < b? </thinking> <think>",
        "yes, a < b <tool",
    ),
    "lt_plain": ("a < b and <th", None, "a < b and <th"),
    "tag_prefix_at_end": ("<thi", None, "<thi"),
    "unclosed_partial_end_tag": ("<think>\nhmm\n</thi", "hmm\n</thi", None),
    "second_end_tag_is_content": ("<think>x</think>y</think>z", "x", "y</think>z"),
    "newlines_kept_inside": ("<think>\n\na\n\n</think>\n\n\nb\n\n", "\na\n", "b\n\n"),
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


def stream(chunks, **kw):
    p = Qwen3ReasoningParser(**kw)
    rs, cs = [], []
    for c in chunks:
        r, t = p.feed(c)
        rs.append(r)
        cs.append(t)
    r, t = p.finish()
    return "".join(rs) + r, "".join(cs) + t


@pytest.mark.parametrize("name", CASES)
def test_split_expected(name):
    text, reasoning, content = CASES[name]
    assert Qwen3ReasoningParser.split(text) == (reasoning, content)


@pytest.mark.parametrize("name", CASES)
def test_streamed_equals_split(name):
    text = CASES[name][0]
    reasoning, content = Qwen3ReasoningParser.split(text)
    expected = (reasoning or "", content or "")
    for chunks in chunkings(text, seed=zlib.crc32(name.encode())):
        assert stream(chunks) == expected, chunks


def test_no_tag_fragment_leaks():
    text = "<think>\nabc\n</think>\n\ndone"
    p = Qwen3ReasoningParser()
    out = [p.feed(c) for c in text] + [p.finish()]
    assert all("<" not in r and "<" not in c for r, c in out)


def test_in_reasoning_prefilled_prompt():
    text = "\nthinking\n</think>\n\nanswer"
    assert Qwen3ReasoningParser.split(text, in_reasoning=True) == ("thinking", "answer")
    for chunks in chunkings(text):
        assert stream(chunks, in_reasoning=True) == ("thinking", "answer")


def test_late_end_tag_limitation():
    """No leading <think> but a later </think>: split calls the head reasoning, streaming cannot."""
    text = "thinking\n</think>\n\nanswer"
    assert Qwen3ReasoningParser.split(text) == ("thinking", "answer")
    for chunks in chunkings(text):
        assert stream(chunks) == ("", "thinking\nanswer")
