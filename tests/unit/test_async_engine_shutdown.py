"""AsyncEngine's shutdown paths without an engine: abort_all, the refusal after it, and a
RequestStream that keeps the tokens queued before an error output."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.core.commands import AbortRequest, AddRequest
from engine.core.limits import EngineLimits
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason, SamplingParams
from engine.frontend.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    RequestStream,
    ServerShuttingDown,
)

LIMITS = EngineLimits(
    max_model_len=64,
    vocab_size=100,
    eos_token_ids=frozenset({0}),
    num_kv_blocks=16,
    block_size=16,
    max_num_batched_tokens=64,
    enable_chunked_prefill=True,
    dtype="float32",
)


class FakeCore:
    """An engine core that records commands; ``fail_aborts`` makes every AbortRequest raise (a
    broken pipe to a dead engine process)."""

    engine = None
    limits = LIMITS

    def __init__(self, fail_aborts: bool = False):
        self.fail_aborts = fail_aborts
        self.sent: list = []
        self.abort_attempts = 0

    def start(self, emit, on_death):
        pass

    def send(self, command):
        if isinstance(command, AbortRequest):
            self.abort_attempts += 1
            if self.fail_aborts:
                raise BrokenPipeError(32, "Broken pipe")
        self.sent.append(command)

    def shutdown(self, timeout):
        pass

    def is_alive(self):
        return True


async def _drain(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def _engine_with_requests(core: FakeCore, n: int) -> tuple[AsyncEngine, list[RequestStream]]:
    engine = AsyncEngine(core)
    streams = [engine.add_request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(n)]
    return engine, streams


def test_abort_all_ends_every_stream_and_aborts_in_the_core():
    core = FakeCore()
    engine, streams = _engine_with_requests(core, 3)
    assert engine.num_in_flight == 3 and engine.in_flight == streams
    assert engine.abort_all("gone") == 3
    assert engine.num_in_flight == 0 and engine.in_flight == []
    assert [c.request_id for c in core.sent if isinstance(c, AbortRequest)] == ["r0", "r1", "r2"]
    for s in streams:
        (last,) = asyncio.run(_drain(s))
        assert last.finished and last.finish_reason == FinishReason.ABORT and last.error == "gone"


def test_abort_all_ends_every_stream_when_the_core_cannot_take_the_aborts(caplog):
    """A send that raises (broken pipe) neither leaves a stream without its final output nor
    stops the others being ended; it is logged once, not raised (abort_all runs in a loop
    callback, where the exception would be lost)."""
    core = FakeCore(fail_aborts=True)
    engine, streams = _engine_with_requests(core, 3)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.async_engine"):
        assert engine.abort_all("gone") == 3
    assert engine.num_in_flight == 0
    for s in streams:
        (last,) = asyncio.run(_drain(s))
        assert last.finished and last.error == "gone"
    assert core.abort_attempts == 1  # not retried for every request once the core is gone
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 request(s)" in warnings[0].getMessage()


def test_requests_after_abort_all_are_refused_as_shutting_down():
    core = FakeCore()
    engine, _ = _engine_with_requests(core, 1)
    engine.abort_all("the request did not finish within the 2 s graceful timeout")
    with pytest.raises(ServerShuttingDown) as exc:
        engine.add_request("late", [1, 2], SamplingParams())
    assert isinstance(exc.value, EngineUnavailable)  # callers catching the base still work
    assert str(exc.value) == "the server is shutting down"
    assert not any(isinstance(c, AddRequest) and c.request_id == "late" for c in core.sent)


def test_stream_delivers_the_tokens_queued_before_an_error():
    """Outputs queued behind a slow consumer merge, but never into an error output: the tokens
    come first, then the error (a consumer stopping at the error still has every token)."""
    for error_reason in (FinishReason.ABORT, FinishReason.ERROR):
        stream = RequestStream("r", 3)
        stream._put(RequestOutput("r", [5], [None]))
        stream._put(RequestOutput("r", [6, 7], [None, None]))
        stream._put(RequestOutput("r", [], finished=True, finish_reason=error_reason, error="boom"))
        outs = asyncio.run(_drain(stream))
        assert [o.new_token_ids for o in outs] == [[5, 6, 7], []]
        assert outs[0].error is None and not outs[0].finished
        assert outs[1].error == "boom" and outs[1].finished
        assert outs[1].finish_reason == error_reason
