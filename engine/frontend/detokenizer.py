"""Streaming detokenization with stop strings.

`IncrementalDetokenizer` turns the token ids a request generates, step by step, into text
deltas whose concatenation is exactly ``tokenizer.decode(output_ids)`` (cut at a stop string).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


#: ``decode_stream(prefill_ids, skip_special_tokens)`` of a tokenizer that has one
#: (`engine.frontend.tokenizer.Tokenizer`): a per-id step returning new text or ``None``.
_StreamStep = Callable[[int], "str | None"]


class IncrementalDetokenizer:
    """Per-request incremental detokenizer (text deltas, stop strings).

    Decoding: the prefix_offset / read_offset method of vLLM's ``detokenize_incrementally``
    and HF's ``TextStreamer``: decode the window ``ids[prefix_offset:]`` and the already-read
    window ``ids[prefix_offset:read_offset]`` and emit the difference. A tokenizer with a
    ``decode_stream`` method (``tokenizers``' ``DecodeStream``, the same method in Rust: one
    call per id instead of two ``decode`` calls, ~5x less CPU per token) runs the steps; the
    Python windows then only flush the tail at `finish`, and take over for good if the stream
    raises (a decode that does not extend the previous one). Decoding whole windows
    (rather than token by token) keeps spaces and multi-byte characters right. A window whose
    text ends with U+FFFD (a UTF-8 character whose bytes are not all generated yet) emits
    nothing until a later token completes it; `finish` flushes what is left. The last few
    prompt tokens are decoded as context (only if their text ends on a whole character), so
    tokenizers whose decoding depends on the previous token still get it.

    Stop strings: text that could be the start of a stop string is held back until it either
    completes one or can no longer do so. When stop strings occur, the one that *ends* first in
    the text wins (ties: the longest, i.e. earliest start); output is cut before it, or after
    it with `include_stop_str_in_output` (then nothing needs holding back). This makes the
    result independent of how the text was split into tokens and steps. With ``min_tokens``, a
    stop string counts only where it ends in text that came after the first ``min_tokens``
    generated tokens (vLLM's detokenizer, PR #22014: the stop-string check skips the text of
    those tokens, as the engine's ``min_tokens`` holds back EOS and ``stop_token_ids``).

    Invariant: ``output_text`` (the concatenation of all returned deltas) equals
    ``tokenizer.decode(output_ids, skip_special_tokens)`` cut at the matched stop string, and
    contains U+FFFD only where that full decode does.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``
            (`engine.frontend.tokenizer.Tokenizer`, a transformers tokenizer).
        prompt_ids: the request's prompt ids (only the last `context_tokens` are used).
        skip_special_tokens: drop special tokens (e.g. ``<|im_end|>``) from the text.
        stop: stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the matched stop string at the end of the output.
        context_tokens: how many trailing prompt tokens to decode as context (vLLM uses 5).
        min_tokens: generated tokens whose text cannot end a stop string (0 = none).

    Attributes:
        output_text: all text emitted so far.
        output_ids: all generated ids fed so far.
        stopped: the matched stop string, or ``None``.
        finished: True after a stop string matched or `finish` was called; later calls
            return "".
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        context_tokens: int = 5,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stops = [s for s in (stop or []) if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # possible partial matches by their last character: c -> (k, stop) with stop[k-1] == c,
        # longest first, so a step looks at only the prefixes that end like the text does
        self._partials: dict[str, list[tuple[int, str]]] = {}
        for stop in self._stops:
            for k in range(1, len(stop)):
                self._partials.setdefault(stop[k - 1], []).append((k, stop))
        for entries in self._partials.values():
            entries.sort(key=lambda e: -e[0])
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._stop_floor = 0  # a stop string must end past this offset of `_text`
        context = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # prompt ends inside a character: decoding from it would misalign
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._fed = len(context)  # ids handed to the decode stream so far
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._stream: _StreamStep | None = (
            make_stream(context, skip_special_tokens) if make_stream is not None else None
        )
        self._text = ""  # decoded output text, whole characters only, not yet cut at a stop
        self.output_text = ""
        self.output_ids: list[int] = []
        self.stopped: str | None = None
        self.finished = False

    @property
    def stop_reason(self) -> str | None:
        """The matched stop string, or ``None`` (same as `stopped`)."""
        return self.stopped

    def step(self, new_ids: Sequence[int]) -> str:
        """Feed the ids generated this step; return the new text to stream (may be "").

        After a stop string matched (``stopped`` is set) or `finish`, the output is final:
        further calls are ignored and return "".
        """
        if self.finished:
            return ""
        held = self._min_tokens - len(self.output_ids)
        if held > 0:  # inside min_tokens: one id at a time, so the floor (the whole characters
            # the first min_tokens ids decode to) does not depend on how ids come in steps
            for token in new_ids[:held]:
                self._feed((token,))
            new_ids = new_ids[held:]
        if new_ids:
            self._feed(new_ids)
        return self._emit(final=False)

    def _feed(self, new_ids: Sequence[int]) -> None:
        """Append generated ids and their text; inside the first ``min_tokens`` ids, raise the
        floor a stop string must end past."""
        self.output_ids.extend(new_ids)
        self._ids.extend(new_ids)
        self._text += self._read_new_text(final=False)
        if len(self.output_ids) <= self._min_tokens:
            self._stop_floor = len(self._text)

    def finish(self) -> str:
        """End of generation (no stop string matched): flush held-back text and return it.

        Emits a trailing incomplete character as U+FFFD and any text held back as a possible
        stop-string start. Returns "" if already finished.
        """
        if self.finished:
            return ""
        self._text += self._read_new_text(final=True)
        delta = self._emit(final=True)
        self.finished = True
        return delta

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _read_new_text(self, final: bool) -> str:
        """Text of the ids past read_offset, if it ends on a whole character (or `final`)."""
        if len(self._ids) == self._read_offset:
            return ""
        if self._stream is not None and not final:
            return self._stream_new_text()
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. only skipped special tokens so far
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # wait for the rest of the character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _stream_new_text(self) -> str:
        """`_read_new_text` through the decode stream, keeping the window offsets in step (a
        step that returns text reads every id fed so far, as a window decode would)."""
        assert self._stream is not None
        pieces = []
        for i in range(self._fed, len(self._ids)):
            try:
                piece = self._stream(self._ids[i])
            except Exception:  # the stream's prefix check failed: windows from here on
                self._stream = None
                return "".join(pieces) + self._read_new_text(final=False)
            if piece:
                pieces.append(piece)
                self._prefix_offset, self._read_offset = self._read_offset, i + 1
        self._fed = len(self._ids)
        return "".join(pieces)

    def _emit(self, final: bool) -> str:
        """Move `_text` to `output_text`: cut at a stop string, hold back a possible one."""
        start = len(self.output_text)
        # Without hold-back (include mode) a stop string may begin in text already emitted.
        match = self._find_stop(max(0, start - self._max_stop_len + 1))
        if match is not None:
            stop, pos = match
            end = pos + len(stop) if self._include_stop else pos
            self.stopped = stop
            self.finished = True
        elif final or self._include_stop:
            end = len(self._text)
        else:
            end = len(self._text) - self._partial_stop_len(start)
        delta = self._text[start:end]
        self.output_text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[str, int] | None:
        """Earliest-ending stop string occurrence starting at or after `start` and ending past
        the ``min_tokens`` text (ties: the longest). Occurrences that ended before the last
        check were found by that check."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            pos = self._text.find(stop, max(start, self._stop_floor - len(stop) + 1))
            if pos >= 0:
                key = (pos + len(stop), pos, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[2], best[1])

    def _partial_stop_len(self, start: int) -> int:
        """Length of the longest suffix of `_text` (after `start`) that begins a stop string."""
        available = len(self._text) - start
        if available <= 0:
            return 0
        for k, stop in self._partials.get(self._text[-1], ()):
            if k <= available and self._text.endswith(stop[:k]):
                return k
        return 0
