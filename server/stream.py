"""Server-sent events framing for streamed completions (``data: {json}\\n\\n`` ... ``data: [DONE]``)."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    """One SSE event carrying a JSON payload.

    A pydantic payload drops its None fields, except each choice's ``finish_reason``, which
    OpenAI always sends (null until the last chunk of the choice).
    """
    if isinstance(payload, BaseModel):
        data = payload.model_dump(exclude_none=True)
        for choice in data.get("choices", ()):
            choice.setdefault("finish_reason", None)
    else:
        data = payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
