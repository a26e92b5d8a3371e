"""Server-sent events framing for streamed completions (``data: {json}\\n\\n`` ...
``data: [DONE]``)."""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One SSE event carrying a JSON payload (error events)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChunkWriter:
    """Frames the chunks of one stream; the envelope (id, object, created, model) is encoded once.

    Building each chunk from plain dicts instead of pydantic models keeps the per-token cost of a
    busy server low. Choice dicts follow OpenAI's chunk shapes (``finish_reason`` always present).
    """

    def __init__(self, stream_id: str, obj: str, created: int, model: str):
        dumps = json.dumps
        self._head = (
            f'data: {{"id":{dumps(stream_id)},"object":{dumps(obj)},'
            f'"created":{created},"model":{dumps(model)},"system_fingerprint":null,'
        )

    def choice(self, choice: dict) -> str:
        """One chunk carrying one choice."""
        body = json.dumps(choice, ensure_ascii=False, separators=(",", ":"))
        return f'{self._head}"choices":[{body}]}}\n\n'

    def usage(self, usage: dict) -> str:
        """The final usage chunk (empty choices)."""
        return f'{self._head}"choices":[],"usage":{json.dumps(usage, separators=(",", ":"))}}}\n\n'
