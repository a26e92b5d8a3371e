"""What the route handlers share: the engine, tokenizer and server settings (explicit, no globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.tokenizer import Tokenizer
from server.metrics import ServerMetrics


@dataclass
class ServerContext:
    """Attributes:
        engine: the shared async engine; tokenizer: the checkpoint's tokenizer.
        model_name: the served model id (requests naming another model get 404).
        defaults: sampling defaults from generation_config.json.
        reasoning_parser: "qwen3" to split <think> into reasoning_content, or None.
        api_key: bearer token required on /v1 routes, or None.
        max_body_bytes: request bodies above this get 413.
        max_prompt_tokens: prompts above this get 400 (defaults to the model length).
    """

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    defaults: dict = field(default_factory=dict)
    reasoning_parser: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    protect_metrics: bool = False

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size
