"""Post-processing of generated chat text: reasoning split and tool-call extraction, streamed or
not.

The non-streamed path runs the same streaming parsers over the whole text, so both agree.
"""

from __future__ import annotations

from server.reasoning import Qwen3ReasoningParser
from server.tool_parser import Qwen3ToolParser


class ChatOutputProcessor:
    """Splits one choice's text into reasoning, content and tool calls.

    Args:
        reasoning: use the Qwen3 reasoning parser (``--reasoning-parser qwen3``).
        in_reasoning: the prompt already opened ``<think>`` (the template pre-filled it).
        tools: parse ``<tool_call>`` blocks (the request offered tools and tool_choice allows them).
        max_tool_calls: keep at most this many calls (1 for ``parallel_tool_calls: false``).
    """

    def __init__(
        self,
        reasoning: bool,
        tools: bool,
        in_reasoning: bool = False,
        max_tool_calls: int | None = None,
    ):
        self.reasoning = Qwen3ReasoningParser(in_reasoning=in_reasoning) if reasoning else None
        self.tools = Qwen3ToolParser() if tools else None
        self.max_tool_calls = max_tool_calls
        self.num_tool_calls = 0

    def _split(self, reasoning: str, content: str, final: bool) -> tuple[str, str, list[dict]]:
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = (
                self.tools.feed(content)
                if not final
                else _join(self.tools.feed(content), self.tools.finish())
            )
        if self.max_tool_calls is not None:  # parallel_tool_calls false: the first call only
            calls = calls[: max(0, self.max_tool_calls - self.num_tool_calls)]
        self.num_tool_calls += len(calls)
        return reasoning, content, calls

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """New text -> (reasoning delta, content delta, completed tool calls)."""
        if self.reasoning is not None:
            r, c = self.reasoning.feed(text)
        else:
            r, c = "", text
        return self._split(r, c, final=False)

    def finish(self) -> tuple[str, str, list[dict]]:
        """Flush what the parsers held back at the end of the choice."""
        if self.reasoning is not None:
            r, c = self.reasoning.finish()
        else:
            r, c = "", ""
        return self._split(r, c, final=True)


def _join(a: tuple[str, list], b: tuple[str, list]) -> tuple[str, list]:
    return a[0] + b[0], a[1] + b[1]
