"""IncrementalDetokenizer on the embedded Qwen3 tokenizer: deltas, UTF-8, stop strings, fuzz."""

from __future__ import annotations

import random

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import bytes_to_unicode, ensure_embedded_checkpoint

FFFD = "\ufffd"


class _WindowsOnly:
    """The tokenizer without ``decode_stream``: the detokenizer's Python window path."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def __getattr__(self, name):
        if name == "decode_stream":
            raise AttributeError(name)
        return getattr(self._tok, name)


@pytest.fixture(scope="module", params=["decode_stream", "windows"])
def tok(request) -> Tokenizer:
    """The embedded Qwen3 tokenizer; every test runs on both decoding paths."""
    tokenizer = Tokenizer(ensure_embedded_checkpoint())
    if request.param == "windows":
        return _WindowsOnly(tokenizer)
    if tokenizer.decode_stream([]) is None:
        pytest.skip("the installed tokenizers has no DecodeStream with prefill ids (< 0.22)")
    return tokenizer


@pytest.fixture(scope="module")
def byte_id(tok):
    """Token id of each single byte (0..255)."""
    to_unicode = bytes_to_unicode()
    return {b: tok.token_to_id(to_unicode[b]) for b in range(256)}


def stream(
    detok: IncrementalDetokenizer,
    ids: list[int],
    chunks: list[int] | None = None,
    finish: bool = True,
) -> list[str]:
    """Feed `ids` in chunks of the given sizes (default 1); return every delta."""
    out, i = [], 0
    sizes = iter(chunks or [])
    while i < len(ids):
        n = next(sizes, 1)
        out.append(detok.step(ids[i : i + n]))
        i += n
    if finish:
        out.append(detok.finish())
    return out


def cut_at_stop(
    text: str, stops: list[str], include: bool, floor: int = 0
) -> tuple[str, str | None]:
    """Reference: the stop occurrence that ends first past ``floor`` (the text of the
    ``min_tokens`` tokens) cuts the text (ties: longest)."""
    best = None
    for s in stops:
        if s and (pos := text.find(s, max(0, floor - len(s) + 1))) >= 0:
            key = (pos + len(s), pos, s)
            best = key if best is None or key[:2] < best[:2] else best
    if best is None:
        return text, None
    end, pos, s = best
    return text[: end if include else pos], s


TEXTS = [
    "你好，世界！今天天气很好，我们一起去公园散步吧。",
    "Emoji 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 🦜 ❤️ end",
    "def f(x):\n    y  =  x   +    1\n\n\n        return  y  # done\t\t\n",
    "  leading spaces, trailing spaces   ",
    "𠀀𠀁𪚥 rare CJK and ⅧⅨ and Ꙫ and 𝔘𝔫𝔦",
    "mixed English 中文 Русский العربية 日本語 한국어 ...",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunking", ["single", "random"])
def test_stream_equals_decode(tok, text, chunking):
    ids = tok.encode(text)
    rng = random.Random(len(text))
    chunks = None if chunking == "single" else [rng.randint(1, 4) for _ in ids]
    detok = IncrementalDetokenizer(tok, tok.encode("The prompt: "))
    deltas = stream(detok, ids, chunks)
    assert "".join(deltas) == detok.output_text == text
    assert not any(FFFD in d for d in deltas)
    assert detok.stopped is None and detok.stop_reason is None and detok.finished
    assert detok.output_ids == ids


def test_incomplete_character_is_held_back(tok, byte_id):
    ids = [byte_id[b] for b in "é中😀".encode()] + tok.encode(" ok")
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert deltas == ["", "é", "", "", "中", "", "", "", "😀", " ok", ""]


def test_trailing_incomplete_character_flushed_at_finish(tok, byte_id):
    detok = IncrementalDetokenizer(tok)
    first = detok.step(tok.encode("ab") + [byte_id[0xE4], byte_id[0xB8]])
    assert first in ("", "ab")  # windows decode the step at once; the stream id by id
    assert first + detok.finish() == "ab" + FFFD == tok.decode(detok.output_ids)
    assert detok.step([9707]) == "" and detok.finish() == ""


def test_prompt_ending_inside_a_character(tok, byte_id):
    detok = IncrementalDetokenizer(tok, tok.encode("x") + [byte_id[0xE4]])
    out_ids = [byte_id[0xB8], byte_id[0xAD]] + tok.encode("中")
    assert "".join(stream(detok, out_ids)) == tok.decode(out_ids) == FFFD * 2 + "中"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("<think>\nhm\n</think>\n\nHi<|im_end|><|endoftext|>")
    text = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text.startswith("<think>\nhm\n</think>") and ("<|im_end|>" in text) is not skip


def test_stop_string_spanning_tokens(tok):
    text = "Hello world, this is the END of it"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["the END"])
    deltas = stream(detok, ids, finish=False)
    assert detok.stopped == "the END" and detok.stop_reason == "the END" and detok.finished
    assert "".join(deltas) == detok.output_text == "Hello world, this is "
    assert not any("the" in d for d in deltas)  # the partial match was held back
    assert detok.step(tok.encode(" more")) == "" and detok.finish() == ""


def test_include_stop_string(tok):
    ids = tok.encode("Hello world, this is the END of it")
    detok = IncrementalDetokenizer(tok, stop=["the END"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == "Hello world, this is the END"


def test_partial_match_released(tok):
    text = "the ENTRY point, the EN"
    detok = IncrementalDetokenizer(tok, stop=["the END"])
    deltas = stream(detok, tok.encode(text), finish=False)
    assert "".join(deltas) == "the ENTRY point, "  # "the EN" could still become the stop
    assert detok.finish() == "the EN" and detok.stopped is None


def test_first_ending_stop_wins(tok):
    ids = tok.encode("Hello world, this is the END")
    detok = IncrementalDetokenizer(tok, stop=["is the END", "this", ""])
    assert "".join(stream(detok, ids)) == "Hello world, " and detok.stopped == "this"


@pytest.mark.parametrize(
    "text,stop,expected",
    [
        ("STOP now", "STOP", ""),
        ("你好世界和平", "世界", "你好"),
        ("def f():\n    pass\n\n\ndef g():", "\n\n", "def f():\n    pass"),
        ("a 😀 b", "😀", "a "),
    ],
)
def test_stop_strings_in_various_text(tok, byte_id, text, stop, expected):
    for ids in (tok.encode(text), [byte_id[b] for b in text.encode()]):
        detok = IncrementalDetokenizer(tok, stop=[stop])
        assert "".join(stream(detok, ids)) == expected and detok.stopped == stop


def _random_ids(rng: random.Random, byte_id, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            ids.append(rng.randrange(151669))
        elif r < 0.9:  # pieces of multi-byte characters, valid or not
            ids.append(byte_id[rng.choice([rng.randint(0x80, 0xBF), rng.randint(0xC2, 0xF4)])])
        else:
            ids.append(rng.randrange(151643, 151669))
    return ids


def test_fuzz_random_ids(tok, byte_id):
    rng = random.Random(42)
    for _ in range(300):
        ids = _random_ids(rng, byte_id, rng.randint(1, 40))
        skip = rng.random() < 0.5
        prompt = [rng.randrange(151669) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = stream(detok, ids, [rng.randint(1, 5) for _ in ids])
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full, ids
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas)


def test_fuzz_random_stops(tok, byte_id):
    rng = random.Random(7)
    for _ in range(300):
        ids = _random_ids(rng, byte_id, rng.randint(1, 30))
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 6)])
            else:
                stops.append("zz")
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
        text = "".join(stream(detok, ids, [rng.randint(1, 4) for _ in ids]))
        expected, matched = cut_at_stop(full, stops, include)
        assert (text, detok.stopped) == (expected, matched), (ids, stops)


def test_min_tokens_text_ends_no_stop_string(tok):
    """A stop string that ends in the text of the first ``min_tokens`` tokens does not stop the
    output (vLLM, PR #22014); one that begins there and ends after does."""
    ids = tok.encode("a b a b a b END")
    assert tok.decode(ids[:3]) == "a b a"
    plain = IncrementalDetokenizer(tok, stop=["b"])
    assert "".join(stream(plain, ids)) == "a " and plain.stopped == "b"
    held = IncrementalDetokenizer(tok, stop=["b"], min_tokens=3)
    assert "".join(stream(held, ids)) == "a b a " and held.stopped == "b"
    later = IncrementalDetokenizer(tok, stop=["a b"], min_tokens=2)  # "a b" | " a b"
    assert "".join(stream(later, ids)) == "a b " and later.stopped == "a b"
    spanning = IncrementalDetokenizer(tok, stop=["b a"], min_tokens=2)  # "a b" | " a": 2..5
    assert "".join(stream(spanning, ids)) == "a " and spanning.stopped == "b a"
    none = IncrementalDetokenizer(tok, stop=["a", "b"], min_tokens=len(ids))
    assert "".join(stream(none, ids)) == "a b a b a b END" and none.stopped is None


def test_fuzz_min_tokens_stops(tok):
    """Random stop strings and min_tokens on text whose tokens decode to whole characters,
    against the reference cut past the text of the first min_tokens tokens."""
    rng = random.Random(11)
    words = ["the", " end", " a", "b", " 42", ",", "\n", " stop", "to", "ok", " é", "中文"]
    for _ in range(300):
        full = "".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
        ids = tok.encode(full)
        assert tok.decode(ids) == full
        min_tokens = rng.randint(0, len(ids) + 1)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randint(1, 5)])
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(
            tok, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens
        )
        text = "".join(stream(detok, ids, [rng.randint(1, 3) for _ in ids]))
        floor = len(tok.decode(ids[:min_tokens]))
        expected, matched = cut_at_stop(full, stops, include, floor)
        assert (text, detok.stopped) == (expected, matched), (full, stops, min_tokens)


def test_min_tokens_floor_does_not_depend_on_steps(tok, byte_id):
    """With ids that split characters, the min_tokens floor is the same however the ids are
    grouped into steps: ``a`` and the first byte of 中 as the two min_tokens ids keep "a" in
    the held text whether they come in one step or two."""
    ids = tok.encode("a") + [byte_id[b] for b in "中".encode()] + tok.encode("a!")
    for chunks in ([2, 2, 2], [1, 1, 1, 1, 1, 1], [3, 3], [6]):
        detok = IncrementalDetokenizer(tok, stop=["a"], min_tokens=2)
        assert "".join(stream(detok, ids, chunks)) == "a中", chunks
    rng = random.Random(5)
    for _ in range(300):
        ids = _random_ids(rng, byte_id, rng.randint(1, 25))
        full = tok.decode(ids)
        stops = [full[a : a + rng.randint(1, 4)] for a in rng.sample(range(len(full) + 1), 2)]
        kw = dict(stop=stops, min_tokens=rng.randint(0, len(ids)), skip_special_tokens=True)
        single = IncrementalDetokenizer(tok, **kw)
        expected = ("".join(stream(single, ids)), single.stopped)
        grouped = IncrementalDetokenizer(tok, **kw)
        text = "".join(stream(grouped, ids, [rng.randint(1, 4) for _ in ids]))
        assert (text, grouped.stopped) == expected, (ids, kw)


class _StreamFailsAfter:
    """A tokenizer whose decode stream raises on its n-th step, as ``DecodeStream`` does when a
    decode does not extend the previous one."""

    def __init__(self, tok: Tokenizer, n: int):
        self._tok, self._n = tok, n

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode_stream(self, prefill_ids, skip_special_tokens=True):
        step = self._tok.decode_stream(prefill_ids, skip_special_tokens)
        calls = 0

        def failing_step(token_id):
            nonlocal calls
            calls += 1
            if calls >= self._n:
                raise RuntimeError("Invalid prefix encountered")
            return step(token_id)

        return failing_step


def test_stream_failure_falls_back_to_windows(byte_id):
    base = Tokenizer(ensure_embedded_checkpoint())
    rng = random.Random(3)
    for _ in range(200):
        ids = _random_ids(rng, byte_id, rng.randint(1, 30))
        skip = rng.random() < 0.5
        tok = _StreamFailsAfter(base, rng.randint(1, len(ids) + 1))
        detok = IncrementalDetokenizer(tok, base.encode("Q: "), skip_special_tokens=skip)
        deltas = stream(detok, ids, [rng.randint(1, 4) for _ in ids])
        assert "".join(deltas) == base.decode(ids, skip_special_tokens=skip), ids


def test_ids_past_the_vocabulary_are_skipped(tok):
    """The model's embedding (151,936 rows) is larger than the vocabulary (151,669 ids): a
    sampled id past it decodes to nothing on both paths, as ``decode`` skips it."""
    ids = tok.encode("hello world") + [151900, 151935] + tok.encode(" again") + [151800]
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    assert "".join(stream(detok, ids)) == tok.decode(ids) == "hello world again"
