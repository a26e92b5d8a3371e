"""Split Qwen3 output into reasoning ("<think>...</think>") and answer content.

Behavioural reference: vLLM's qwen3 reasoning parser (behaviour only, no code taken from it).
"""

from __future__ import annotations

import re
from typing import Literal

START, END = "<think>", "</think>"
ASSISTANT_TURN = "<|im_start|>assistant"
_CLOSED_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)


def thinking_state(prompt: str, continuing: bool) -> Literal["before", "inside", "after"]:
    """Where a rendered Qwen3 chat prompt leaves the model in the turn it generates.

    ``"before"``: the model opens its reasoning itself (a new turn with thinking on);
    ``"inside"``: the prompt ends inside an open ``<think>`` (a template that opens it, or a
    continued final message still reasoning), so the output starts as reasoning;
    ``"after"``: the answer comes next (thinking off: the template wrote a closed block; a
    continued message past its reasoning, or with none). Read off the generated turn, the
    text after the last ``<|im_start|>assistant``: closed ``<think>...</think>`` blocks at its
    start are skipped, then only a ``<think>`` at the start of what is left counts (a tag
    further on in a continued message is text). ``continuing``: the turn is a continued final
    message (``continue_final_message``), whose text, tags aside, is the answer's. A prompt
    without that header (another template): ``"after"`` if it ends with ``</think>``, else
    ``"before"``.
    """
    start = prompt.rfind(ASSISTANT_TURN)
    if start < 0:
        return "after" if prompt.rstrip().endswith(END) else "before"
    rest = prompt[start + len(ASSISTANT_TURN) :].lstrip()
    skipped = False
    while (block := _CLOSED_BLOCK.match(rest)) is not None:
        rest, skipped = rest[block.end() :], True
    if rest.startswith(START):
        return "inside"
    if skipped or rest or continuing:
        return "after"
    return "before"


def _partial(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class Qwen3ReasoningParser:
    """Streaming splitter of Qwen3 output into (reasoning, content).

    Format: thinking models emit ``<think>\\n...\\n</think>\\n\\n`` and then the answer. With
    enable_thinking=false the template pre-fills an empty think block in the prompt, so the
    output normally has no tags and is all content (the rules read the output, not the
    setting: an output that opens ``<think>`` anyway is split the same way).

    Rules (same for `feed`/`finish` and `split`):
      * output starting with ``<think>``: the tag is dropped; text up to the first ``</think>``
        is reasoning, the rest is content; with no ``</think>`` (max_tokens hit) all is reasoning;
      * output not starting with ``<think>`` and without ``</think>``: all is content;
      * whitespace choice: one "\\n" right after ``<think>`` and one "\\n" right before
        ``</think>`` are removed from the reasoning; all "\\n" directly after ``</think>`` are
        removed from the content. Everything else is kept verbatim.

    Streaming holds back only what could still be a tag (or the "\\n" before ``</think>``), so tag
    fragments split over deltas never leak, and streamed output equals `split` for outputs that
    start with ``<think>`` or have no tags. Limitation (as in vLLM): if the output does not start
    with ``<think>`` but a ``</think>`` comes later, the text before it was already streamed as
    content; the tag is then dropped and later text stays content, whereas `split` reports the
    text before it as reasoning. When the prompt itself ends with ``<think>\\n`` (templates that
    force thinking) pass ``in_reasoning=True`` so the output is read as already inside the block.
    """

    def __init__(self, in_reasoning: bool = False) -> None:
        self._mode = "reasoning" if in_reasoning else "start"  # start|reasoning|late|content
        self._buf = ""
        self._lead_nl = in_reasoning  # drop one "\n" right after <think>
        self._strip_nl = False  # drop the "\n"s right after </think>

    def feed(self, delta: str) -> tuple[str, str]:
        """Consume one text delta; return ``(reasoning_delta, content_delta)``, each maybe ""."""
        self._buf += delta
        reasoning = content = ""
        if self._mode == "start":
            if self._buf.startswith(START):
                self._buf, self._mode, self._lead_nl = self._buf[len(START) :], "reasoning", True
            elif START.startswith(self._buf):  # empty or a fragment of "<think>": wait
                return "", ""
            else:
                self._mode = "late"
        if self._mode == "reasoning":
            if self._lead_nl and self._buf:
                self._lead_nl = False
                if self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
            i = self._buf.find(END)
            if i < 0:
                held = max(_partial(self._buf, "\n" + END), _partial(self._buf, END))
                keep = len(self._buf) - held
                reasoning, self._buf = self._buf[:keep], self._buf[keep:]
                return reasoning, ""
            reasoning = self._buf[:i]
            if reasoning.endswith("\n"):
                reasoning = reasoning[:-1]
            self._buf, self._mode, self._strip_nl = self._buf[i + len(END) :], "content", True
        elif self._mode == "late":
            i = self._buf.find(END)
            if i < 0:
                keep = len(self._buf) - _partial(self._buf, END)
                content, self._buf = self._buf[:keep], self._buf[keep:]
                return "", content
            content = self._buf[:i]
            self._buf, self._mode, self._strip_nl = self._buf[i + len(END) :], "content", True
        if self._strip_nl:
            self._buf = self._buf.lstrip("\n")
            self._strip_nl = not self._buf
        content, self._buf = content + self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of stream: flush held-back text as ``(reasoning_delta, content_delta)``."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._mode == "reasoning" else ("", rest)

    @classmethod
    def split(cls, text: str, in_reasoning: bool = False) -> tuple[str | None, str | None]:
        """Parse a whole output; return ``(reasoning_content, content)``, None for empty parts."""
        thinking = in_reasoning or text.startswith(START)
        body = text[len(START) :] if thinking and not in_reasoning else text
        head, sep, tail = body.partition(END)
        if not sep:
            if not thinking:
                return None, text or None
            reasoning, content = head[1:] if head.startswith("\n") else head, ""
        else:
            reasoning = head[1:] if thinking and head.startswith("\n") else head
            reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
            content = tail.lstrip("\n")
        return reasoning or None, content or None
