"""Prompt text -> token ids on the request path, through ``fastokens`` where it is exact.

Tokenizing a long prompt with `tokenizers` (its Oniguruma regex split, then BPE on every word
it has not cached: random-token benchmark prompts are the worst case) costs milliseconds before
the request reaches the engine: 4.5-5.2 ms for a 1,024-token random-token chat prompt on the
development VM, against ~1.0 ms with the tiktoken port this module held until 2026-12-05 and
0.05-0.3 ms with ``fastokens`` (Crusoe's Rust reimplementation of the ``tokenizers`` encoder
over the same ``tokenizer.json``; vLLM's ``--tokenizer-mode fastokens``). It releases the GIL
while it works. Timings: docs/benchmarks.md, "The 1k-token request path on the CPU", 2026-12-05.

:class:`PromptEncoder` uses ``fastokens`` only when it loads ``tokenizer.json`` (it refuses
what it does not implement, say an NFKC normalizer or a WordPiece model) and a start-up check
over a fixed set of texts and decodings of random ids gives the same ids as ``tokenizers``;
otherwise, or without ``fastokens``, it calls ``Tokenizer.encode``. A text ``fastokens``
rejects at encode time (lone surrogates, a regex resource limit) goes to ``tokenizers``, whose
answer, ids or error, is the reference.
"""

from __future__ import annotations

import logging
import random

from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: texts whose ids must match ``tokenizers``' before the fast path is used (with random ones)
CHECK_TEXTS = (
    "Hello, world! It's a test: don't, I'll, we've, you're, she'd, I'm.",
    "   leading spaces\n\n\ntrailing   \t\n  ",
    "def f(x):\n    return x ** 2  # comment\r\n\tindent",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F 1,000,000",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "Emoji 😀👍🏽 👨‍👩‍👧 and symbols ©®™ ≯ ∑ ∫ √ ≠",
    "Combining: e\u0301 a\u0308 n\u0303 (NFD) vs é ä ñ (NFC); >\u0338",
    (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    '<think>\nreasoning\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "x<|im_end|>y<|endoftext|><|endoftext|>z <|im_start|> ",
    "ALL CAPS 'S 'T 'RE 'VE 'M 'LL 'D and MiXeD 'Ll",
    "URLs https://example.com/a?b=c&d=e#f and paths /usr/local/bin/python3.11",
    "Arabic مرحبا بالعالم, Hebrew שלום עולם, Thai สวัสดีครับ, Hindi नमस्ते दुनिया",
    "\u00a0non-breaking\u2003em-space\u200bzero-width\ufeffbom",
    "",
    " ",
    "\n",
)


class PromptEncoder:
    """Encodes prompts like ``tokenizer.encode(text)`` (no special tokens added), faster where it
    can.

    Args:
        tokenizer: the checkpoint's tokenizer (``tokenizer.json`` is read from its directory).

    Attributes:
        backend: "fastokens" or "tokenizers" (what :meth:`encode` uses).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.backend = "tokenizers"
        self._fast = None
        try:
            import fastokens

            fast = fastokens.Tokenizer.from_file(str(tokenizer.path / "tokenizer.json"))
        except ImportError:
            log.info("prompt encoding: tokenizers (fastokens is not installed)")
            return
        except Exception as exc:  # noqa: BLE001 - a shape it does not implement: no fast path
            log.info("prompt encoding: tokenizers (fastokens cannot load this tokenizer: %s)", exc)
            return
        for text in _check_texts(tokenizer):
            try:
                same = fast.encode(text).ids == tokenizer.encode(text)
            except Exception:  # noqa: BLE001 - either side refusing a check text: no fast path
                same = False
            if not same:
                log.warning(
                    "prompt encoding: tokenizers (fastokens gives other ids for %r)", text[:80]
                )
                return
        self._fast, self.backend = fast, "fastokens"
        log.info("prompt encoding: fastokens (checked against tokenizers)")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added tokens written in it (``<|im_start|>``...) map to their
        ids.

        Raises:
            what ``Tokenizer.encode`` raises for a text it refuses (the server turns
            ``TypeError``/``ValueError``/``UnicodeError`` into a 400).
        """
        if self._fast is not None:
            try:
                return self._fast.encode(text).ids
            except Exception:  # noqa: BLE001 - tokenizers, the reference, decides such a text
                log.debug("fastokens refused a prompt; encoding it with tokenizers")
        return self.tokenizer.encode(text)


def _check_texts(tokenizer: Tokenizer, n_random: int = 24, seed: int = 0) -> list[str]:
    """The fixed texts plus decodings of random ids (odd byte sequences, words never cached)."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    texts = list(CHECK_TEXTS)
    for _ in range(n_random):
        texts.append(
            tokenizer.decode(
                [rng.randrange(vocab) for _ in range(rng.randint(1, 200))],
                skip_special_tokens=False,
            )
        )
    return texts
