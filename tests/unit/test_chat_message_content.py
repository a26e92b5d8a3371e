"""An empty list of content parts: refused where OpenAI refuses it, taken as no content on an
assistant message with tool calls (as null is there; vLLM takes both)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.protocol import ChatCompletionRequest

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _request(message: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [message]})


def test_empty_parts_refused_without_tool_calls():
    for message in ({"role": "user", "content": []}, {"role": "assistant", "content": []}):
        with pytest.raises(ValidationError) as exc:
            _request(message)
        assert exc.value.errors()[0]["loc"] == ("messages", 0, "content")


def test_empty_parts_on_an_assistant_tool_call_message_are_no_content():
    req = _request({"role": "assistant", "content": [], "tool_calls": [CALL]})
    assert req.messages[0].text() == ""
    assert _request({"role": "assistant", "content": None, "tool_calls": [CALL]})
