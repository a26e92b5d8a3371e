"""Extract Hermes-style ``<tool_call>`` blocks from Qwen3 output as OpenAI tool calls.

Behavioural reference: vLLM's hermes tool parser, as used for Qwen (behaviour only, no code
taken from it).
"""

from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)


def _partial(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's extension


def json_object(text: str) -> dict | None:
    """``text`` parsed, where it is a JSON object (strict JSON: no NaN or Infinity); else None
    (not JSON, another JSON value, or nested deeper than the parser's recursion limit)."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _parse_call(body: str) -> dict | None:
    """The OpenAI tool call (without index) for a block body, or None if it does not parse."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str) or json_object(args) is None:
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


class Qwen3ToolParser:
    """Streaming extractor of Qwen3 (Hermes format) tool calls.

    Format: zero or more blocks ``<tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>``,
    possibly after normal text and separated by newlines. Each block body is read with
    json.loads; ``arguments`` (or ``parameters``) that is not a string becomes a JSON string
    (json.dumps, ensure_ascii=False); a string is kept as is where it is a JSON object itself (a
    model that wrote the arguments object as a string), else encoded as a JSON string literal
    (``"123"`` stays the string "123"), so ``arguments`` always parses as JSON (OpenAI's
    contract; vLLM encodes every string). A block that does not parse to an object with a string
    ``name`` stays in the content verbatim, tags included. An unclosed block at end of stream is
    parsed too (as vLLM does) and kept as content when it fails.

    Content is the text outside the blocks, with leading and trailing whitespace stripped. When
    streaming, text that could start ``<tool_call>`` is held back until resolved, a block is held
    until its closing tag, and a whitespace run is held until non-whitespace text follows it (so
    the trailing whitespace of the whole output is never sent). The concatenated streamed content
    therefore equals `parse`'s content (or "" where it is None).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._index = 0
        self._started = False  # some non-whitespace content has been sent
        self._ws = ""  # whitespace held back after the last content sent

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Consume one text delta; return ``(content_delta, calls)``.

        `calls` holds each tool call whose closing tag arrived in this delta, as
        ``{"index": i, "id": "call_<24 hex>", "type": "function",
        "function": {"name": str, "arguments": str}}`` with `i` counting from 0 per response.
        """
        self._buf += delta
        out: list[str] = []
        calls: list[dict] = []
        while True:
            if self._in_call:
                j = self._buf.find(END)
                if j < 0:
                    break
                self._close(self._buf[:j], END, out, calls)
                self._buf = self._buf[j + len(END) :]
                continue
            i = self._buf.find(START)
            if i < 0:
                keep = len(self._buf) - _partial(self._buf, START)
                out.append(self._buf[:keep])
                self._buf = self._buf[keep:]
                break
            out.append(self._buf[:i])
            self._buf, self._in_call = self._buf[i + len(START) :], True
        return self._emit("".join(out)), calls

    def finish(self) -> tuple[str, list[dict]]:
        """End of stream: flush held text and an unclosed block; same shape as `feed`."""
        out: list[str] = []
        calls: list[dict] = []
        if self._in_call:
            self._close(self._buf, "", out, calls)
        else:
            out.append(self._buf)
        self._buf = ""
        return self._emit("".join(out)), calls

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict]]:
        """Parse a whole output; return ``(content or None, tool_calls)``.

        Tool calls have the ``message.tool_calls`` shape ``{"id", "type", "function"}`` (no index).
        """
        parts: list[str] = []
        calls: list[dict] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            parts.append(text[pos : m.start()])
            call = _parse_call(m.group(1) if m.group(1) is not None else m.group(2))
            if call is None:
                parts.append(m.group(0))
            else:
                calls.append(call)
            pos = m.end()
        parts.append(text[pos:])
        return "".join(parts).strip() or None, calls

    def _close(self, body: str, end: str, out: list[str], calls: list[dict]) -> None:
        call = _parse_call(body)
        if call is None:
            out.append(START + body + end)
        else:
            calls.append({"index": self._index, **call})
            self._index += 1
        self._in_call = False

    def _emit(self, text: str) -> str:
        core = text.rstrip()
        if not core:
            if self._started:
                self._ws += text
            return ""
        if not self._started:
            core, self._started = core.lstrip(), True
        out, self._ws = self._ws + core, text[len(text.rstrip()) :]
        return out
