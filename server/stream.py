"""Server-sent events framing for streamed completions (``data: {json}\\n\\n`` ... ``data: [DONE]``)."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    """One SSE event carrying a JSON payload (a pydantic model drops its None fields)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"
