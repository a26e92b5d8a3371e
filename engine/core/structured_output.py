"""Structured outputs in the engine core: a grammar matcher per request, advanced with every
accepted token, and the packed token bitmask of the next step.

The grammar engine is llguidance (Microsoft's Low-level Guidance, a Rust Earley parser with a
lexer over the tokenizer's byte trie; https://github.com/guidance-ai/llguidance), the engine
vLLM's "guidance" backend uses. It imports neither torch nor numpy, so the matchers live here
with the host-side bookkeeping of the engine core; only the packed bitmask (one bit per
vocabulary entry, ``ceil(vocab / 32)`` little-endian int32 words) travels to the sampler.

A grammar is compiled once per distinct grammar text and tokenizer (a template matcher, cached
by :class:`StructuredOutputManager`); each request gets a copy (``LLMatcher.deep_copy``).
Compilation runs in a worker thread (llguidance releases the GIL while it builds), so a request
whose grammar is not compiled yet waits in the queue without holding up the engine loop or other
requests. The bitmasks of a step are filled in parallel by llguidance's own thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

#: how the engine's message of a request failed by its grammar begins (the server answers such
#: a failure as the request's error, not an engine fault)
GRAMMAR_ERROR_PREFIX = "structured output: "


def matcher_error(matcher) -> str:
    """An llguidance matcher's error for a client: its first line, and the reason from the
    line ``error: ...`` below it where there is one (a regex parse error names its reason
    there, e.g. ``unclosed group``); the rest is the pattern with a caret, or the parser's state
    dump (the whole grammar and internals), not for a client."""
    lines = matcher.get_error().strip().split("\n")
    reason = next(
        (ln.strip()[6:].strip() for ln in lines[1:] if ln.strip().startswith("error:")), ""
    )
    return f"{lines[0].rstrip(': ')}: {reason}" if reason else lines[0]


log = logging.getLogger(__name__)


def special_spellings(tokenizer) -> dict[int, list[int]]:
    """Special token id -> the ordinary tokens that spell its text, for the special tokens of
    ``tokenizer`` (an ``llguidance.LLTokenizer``), end-of-sequence ones included (a grammar
    that completes still allows those: :func:`correct_special_tokens` keeps what the matcher
    takes).

    llguidance keeps a tokenizer's added tokens (Qwen3's ``<think>``, ``<tool_call>``,
    ``<|im_start|>``, ...) out of its byte trie: a grammar asks for one only by its special-token
    syntax, and grammar text such as the regex ``a<think>`` must be spelled with ordinary tokens.
    But where that text is forced, llguidance 1.9 tokenizes the forced bytes with the HF
    tokenizer, which matches added tokens inside text, so its mask allows the special token
    alone and its parser then refuses that token (a known llguidance limitation, also reported
    to outlines, dottxt-ai/outlines#1771). :func:`correct_special_tokens` and
    :func:`consume_forced` put the spelling in its place. A token whose text has no ordinary
    spelling (greedy over the byte trie) is left out."""
    out = {}
    for tok in range(tokenizer.vocab_size):
        if not tokenizer.is_special_token(tok):
            continue
        text = tokenizer.decode_bytes([tok])
        # (ids past the tokenizer's own vocabulary, padding to the model's width, read as
        # llguidance's placeholder "<[id]>": no text of theirs)
        if not text or text.startswith(b"\xff") or text == f"<[{tok}]>".encode():
            continue
        try:
            spelling = tokenizer.greedy_tokenize(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        if spelling and not any(tokenizer.is_special_token(t) for t in spelling):
            out[tok] = spelling
    return out


def llg_tokenizer(tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the checkpoint's tokenizer (``llguidance.LLTokenizer``, ~2 s to
    build for a 150k vocabulary) padded to ``vocab_size`` ids, ending at ``eos_token_ids``,
    with its :func:`special_spellings`: ``(tokenizer, spellings)``. Built the same way by the
    engine's :class:`StructuredOutputManager` and the server's grammar validation."""
    from llguidance import LLTokenizer

    tokenizer = LLTokenizer(
        Path(tokenizer_json).read_text(), n_vocab=vocab_size, eos_token=eos_token_ids or None
    )
    return tokenizer, special_spellings(tokenizer)


def special_bytes(spellings) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(byte, bits, tokens)``: the bytes of a packed mask row that hold the bits of the
    special tokens of ``spellings`` (:func:`special_spellings`), each with those bits and
    tokens, so a row is checked a byte at a time (:func:`correct_special_tokens`)."""
    by_byte: dict[int, list[int]] = {}
    for tok in sorted(spellings):
        by_byte.setdefault(tok // 8, []).append(tok)
    return [
        (b, sum(1 << (t % 8) for t in toks), tuple(toks)) for b, toks in sorted(by_byte.items())
    ]


def correct_special_tokens(
    matcher, mask: tuple[bytearray, int, int], spellings, by_byte=None, eos=frozenset()
) -> None:
    """Clear from ``mask`` (a packed row, as :func:`_mask_allows` reads it) the special tokens
    of ``spellings`` (:func:`special_spellings`) that ``matcher`` would refuse, and allow the
    first token of each one's ordinary spelling where the matcher takes it. ``by_byte``:
    :func:`special_bytes` of ``spellings`` (computed when None); only the set bits among them
    cost a matcher call. ``eos``: the matcher's end-of-sequence ids, which it takes exactly
    when it is accepting (one cheap call instead of a token's validation)."""
    buf, start, end = mask
    for b, bits, toks in special_bytes(spellings) if by_byte is None else by_byte:
        if start + b >= end or not buf[start + b] & bits:
            continue
        for tok in toks:
            if not buf[start + b] >> (tok % 8) & 1:
                continue
            if tok in eos and matcher.is_accepting() or matcher.validate_tokens([tok]) == 1:
                continue
            buf[start + b] &= ~(1 << (tok % 8)) & 0xFF
            first = spellings[tok][0]
            if start + first // 8 < end and matcher.validate_tokens([first]) == 1:
                buf[start + first // 8] |= 1 << (first % 8)


def consume_forced(matcher, forced: list[int], spellings) -> bool:
    """Consume the tokens ``forced`` (``matcher.compute_ff_tokens()``) into ``matcher``, each
    special token it refuses replaced by its ordinary spelling (:func:`special_spellings`).
    Returns whether every token (or spelling) was taken."""
    for tok in forced:
        if tok in spellings and matcher.validate_tokens([tok]) == 0:
            if not matcher.consume_tokens(spellings[tok]):
                return False
        elif not matcher.consume_token(tok):
            return False
    return True


def _mask_allows(mask: tuple[bytearray, int, int], token: int) -> bool:
    """Whether bit ``token`` of the packed row ``buf[start:end]`` is set (llguidance's layout:
    little-endian 32-bit words, bit ``t % 32`` of word ``t // 32``, i.e. bit ``t % 8`` of byte
    ``t // 8``); a token past the row is not allowed."""
    buf, start, end = mask
    byte = start + token // 8
    return 0 <= token and byte < end and bool(buf[byte] >> (token % 8) & 1)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a request's output must match (picklable; built and validated by the front end).

    Attributes:
        grammar: an llguidance grammar (the JSON text ``LLMatcher.grammar_from_json_schema`` /
            ``grammar_from_regex`` / ``grammar_from_lark`` return).
        start_after_token: the grammar constrains only the tokens after this one (Qwen3's
            ``</think>``: the reasoning is free, the answer constrained); None: from the first
            generated token.
    """

    grammar: str
    start_after_token: int | None = None

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar (sha256 of the grammar text)."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one packed bitmask row."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Compiled template matchers by grammar key, for one tokenizer, compiled in a worker thread;
    and the bitmasks of a step, filled by llguidance's thread pool (``LLExecutor``).

    Args:
        tokenizer_json: path of the checkpoint's ``tokenizer.json``.
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        eos_token_ids: ids that end generation (what a completed grammar allows).
        capacity: most compiled grammars kept (least recently used evicted).

    The llguidance tokenizer (~2 s to build for a 150k vocabulary) is built on first use, in
    the worker thread.
    """

    def __init__(
        self,
        tokenizer_json: str | Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        capacity: int = 256,
    ):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Future] = OrderedDict()
        self._tokenizer = None
        self._executor = None
        self._spellings: dict[int, list[int]] = {}
        # the bytes of a packed row holding special tokens' bits, with those bits and tokens
        self._special_bytes: list[tuple[int, int, tuple[int, ...]]] = []
        self.mask_bytes = 4 * bitmask_words(vocab_size)

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            tokenizer, self._spellings = llg_tokenizer(
                self.tokenizer_json, self.vocab_size, self.eos_token_ids
            )
            self._special_bytes = special_bytes(self._spellings)
            self._tokenizer = tokenizer  # (last: a later compile finds the spellings built)
        return self._tokenizer

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar does not compile: {matcher_error(matcher)}")
        return matcher

    def template(self, spec: StructuredOutputSpec) -> Future:
        """A future of the compiled template matcher of ``spec`` (shared: copy it per request)."""
        key = spec.key
        with self._lock:
            fut = self._templates.get(key)
            if fut is not None:
                self._templates.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec.grammar)
            self._templates[key] = fut
            while len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
            return fut

    def fill_bitmasks(self, states: list[GrammarState]) -> bytearray:
        """The packed bitmasks of ``states`` (active, compiled), row ``i`` for ``states[i]``:
        ``len(states) * mask_bytes`` bytes, computed in parallel by llguidance's executor; a
        row that allows a special token is corrected by :func:`correct_special_tokens`."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        buf = bytearray(len(states) * self.mask_bytes)
        view = (ctypes.c_char * len(buf)).from_buffer(buf)
        self._executor.unsafe_compute_mask_ptr(
            [(st._matcher, i) for i, st in enumerate(states)],
            ctypes.addressof(view),
            self.mask_bytes,
            len(states),
        )
        del view  # release the buffer export before the bytearray travels on
        for i, st in enumerate(states):
            st._mask = (buf, i * self.mask_bytes, (i + 1) * self.mask_bytes)
            correct_special_tokens(
                st._matcher, st._mask, self._spellings, self._special_bytes, self._eos
            )
        return buf

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher: compiled in the background, then advanced token by token.

    Args:
        spec: the request's structured-output spec.
        template: future of the compiled template matcher
            (:meth:`StructuredOutputManager.template`), kept as ``compiled``.
    """

    def __init__(self, spec: StructuredOutputSpec, template: Future):
        self.spec = spec
        self.compiled = template
        self._matcher = None
        self.error: str | None = None
        #: the error is the engine's, not the request's grammar's: a compile failing after the
        #: front end's check of the same grammar passed, or a sampled token its mask forbade
        self.engine_fault = False
        self.active = spec.start_after_token is None
        # the packed mask the next sampled token was drawn under (buffer, row start, row end),
        # set by `StructuredOutputManager.fill_bitmasks`, cleared by `accept`
        self._mask: tuple[bytearray, int, int] | None = None

    def ready(self) -> bool:
        """Whether the matcher exists (or compilation failed: see ``error``); never blocks."""
        if self._matcher is None and self.error is None and self.compiled.done():
            try:
                self._matcher = self.compiled.result().deep_copy()
            except Exception as exc:  # noqa: BLE001 - reported as the request's failure
                self.error = f"grammar compilation failed: {type(exc).__name__}: {exc}"
                self.engine_fault = True
        return self._matcher is not None or self.error is not None

    def accept(self, token: int) -> None:
        """Advance over a sampled token (before activation: watch for the start token).

        A token the grammar rejects (it cannot be sampled under the mask) puts the matcher in an
        error state: ``error`` is set.
        """
        if not self.active:
            self.active = token == self.spec.start_after_token
            return
        mask, self._mask = self._mask, None
        if not self._matcher.consume_token(token):
            self.error = f"token {token} does not match the grammar: {matcher_error(self._matcher)}"
            # the mask allowed it: the grammar could not go on (e.g. llguidance's limits); it
            # forbade it, or none was applied: the sampler's fault
            self.engine_fault = mask is None or not _mask_allows(mask, token)

    @property
    def failure_message(self) -> str:
        """The message a request failed by this state ends with (``error`` set): prefixed with
        `GRAMMAR_ERROR_PREFIX` (the client's error) unless it is an `engine_fault`."""
        if self.engine_fault:
            return f"structured output failed in the engine: {self.error}"
        return GRAMMAR_ERROR_PREFIX + (self.error or "")

    @property
    def completed(self) -> bool:
        """The grammar matched a whole output and allows nothing more: the request ends."""
        return self.active and self._matcher is not None and self._matcher.is_stopped()

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is constrained (the grammar is active and compiled)."""
        return self.active and self._matcher is not None
