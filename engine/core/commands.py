"""Typed commands from a front end to the engine core (they cross a process pipe: picklable)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.core.request import SamplingParams


class CommandKind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (validated by the front end against ``EngineLimits`` already)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: CommandKind = CommandKind.ADD


@dataclass(frozen=True)
class AbortRequest:
    """Finish a request at once and free its KV blocks (unknown ids are ignored)."""

    request_id: str
    kind: CommandKind = CommandKind.ABORT


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine loop."""

    kind: CommandKind = CommandKind.SHUTDOWN


Command = AddRequest | AbortRequest | Shutdown
