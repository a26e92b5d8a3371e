"""The engine loop shared by the in-thread and the separate-process engine cores.

Commands (:mod:`engine.core.commands`) arrive in batches. Each iteration applies all queued
commands, runs one engine step when there is work, and emits that step's outputs and stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.core.commands import Command, CommandKind
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.stats import StepStats

log = logging.getLogger(__name__)

Emit = Callable[[list[RequestOutput], "StepStats | None"], None]


def apply_commands(engine: LLMEngine, commands: list[Command], emit: Emit) -> tuple[bool, bool]:
    """Apply adds and aborts in order; returns (anything changed, shutdown requested).

    An add whose request was aborted in the same batch is skipped; an add the engine rejects
    produces a finished output with ``error`` set.
    """
    aborted = {c.request_id for c in commands if c.kind is CommandKind.ABORT}
    shutdown = False
    for cmd in commands:
        if cmd.kind is CommandKind.ADD:
            if cmd.request_id in aborted:
                continue
            try:
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            except ValueError as exc:  # validated by the front end already; a race lands here
                emit([RequestOutput.failed(cmd.request_id, str(exc))], None)
        elif cmd.kind is CommandKind.ABORT:
            engine.abort(cmd.request_id)
        elif cmd.kind is CommandKind.SHUTDOWN:
            shutdown = True
    return bool(commands), shutdown


def idle_polling(
    next_commands: Callable[[float], list[Command]],
    poll_seconds: float,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[float], list[Command]]:
    """``next_commands`` that keeps polling (timeout 0) for ``poll_seconds`` after the engine's
    last work before it waits with the loop's timeout.

    The engine's last work ends at the first waiting call (timeout > 0) after a busy one
    (timeout 0: the loop had requests and ran a step in between), or when a call returned
    commands. Within the window a waiting call spins on ``next_commands(0)`` until commands
    arrive or the window closes, then waits as asked. The process stays on a running core, so
    a request that arrives shortly after the previous one finished skips the sleeping process's
    wake-up and meets warm caches. ``poll_seconds`` <= 0 returns ``next_commands`` itself.
    """
    if poll_seconds <= 0:
        return next_commands
    last_work = clock()
    busy = False

    def polling(timeout: float) -> list[Command]:
        nonlocal last_work, busy
        if timeout == 0:
            busy = True
            commands = next_commands(0.0)
            if commands:
                last_work = clock()
            return commands
        if busy:  # the loop just went idle: the window opens now, whatever the step's length
            busy, last_work = False, clock()
        while clock() - last_work < poll_seconds:
            commands = next_commands(0.0)
            if commands:
                last_work = clock()
                return commands
        commands = next_commands(timeout)
        if commands:
            last_work = clock()
        return commands

    return polling


def run_engine_loop(
    engine: LLMEngine,
    next_commands: Callable[[float], list[Command]],
    emit: Emit,
    log_interval: float = 10.0,
) -> None:
    """Serve until a shutdown command.

    Args:
        engine: the engine, used only from this loop.
        next_commands: returns the queued commands; waits up to the given timeout (seconds) for
            one when the engine is idle (0 = do not wait).
        emit: receives each step's outputs and stats (stats None after a crash).
        log_interval: seconds between periodic engine log lines (0 = never).

    Raises:
        Exception: a step's device error (``engine.is_fatal``), after failing every request;
            what ``engine.prepare_thread`` raises, before any step.
    """
    engine.prepare_thread()  # the device libraries' per-thread caches, for this thread
    emit([], engine.idle_stats())  # the gauges (free KV blocks...) have values before a request
    last_log = time.monotonic()
    tokens = [0, 0]
    while True:
        changed, shutdown = apply_commands(
            engine, next_commands(0.0 if engine.has_unfinished() else 0.5), emit
        )
        if shutdown:
            return
        if not engine.has_unfinished():
            if changed:  # e.g. the last requests were aborted: publish the emptied state
                emit([], engine.idle_stats())
            continue
        try:
            outputs, stats = engine.step()
        except Exception as exc:  # noqa: BLE001 - fail everyone; keep serving unless the device is broken
            log.exception("engine step crashed; failing all in-flight requests")
            outputs = engine.take_undelivered()  # e.g. requests that finished before the crash
            for rid in list(engine.requests):
                engine.abort(rid)
                outputs.append(RequestOutput.failed(rid, str(exc)))
            emit(outputs, None)
            if engine.is_fatal(exc):
                raise  # the core dies; the front end fails what is left and reports 503
            continue
        emit(outputs, stats)
        tokens[0] += stats.num_prompt_tokens
        tokens[1] += stats.num_generation_tokens
        now = time.monotonic()
        if log_interval and now - last_log >= log_interval:
            dt = now - last_log
            log.info(
                "engine: running %d, waiting %d, KV usage %.1f%%, prompt %.1f tok/s, "
                "generation %.1f tok/s",
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_usage,
                tokens[0] / dt,
                tokens[1] / dt,
            )
            last_log, tokens = now, [0, 0]
