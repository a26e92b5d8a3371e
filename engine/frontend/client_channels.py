"""The engine-core process's side of its pipes to one or more front ends (API servers).

With ``--api-server-count N`` one engine core serves N API-server processes (vLLM's layout for
its ``--api-server-count``: the HTTP work of many streams spread over several processes, one
scheduler and KV cache behind them). Each front end has its own ``multiprocessing`` pipe; the
core takes commands from all of them, remembers which front end added each request, and sends
every step's outputs of a request only to that front end. The step's :class:`StepStats` go to
one front end alone (0, or the lowest-numbered one left), so the step-derived metrics
(gauges, preemptions, prefix-cache counters, tokens per step) are counted once.

A front end may abort only requests it added (an abort of another front end's request, say one
whose duplicate id was refused, is ignored), and an aborted request is forgotten at once.

With several front ends the engine thread never writes to a pipe itself: each front end has an
:class:`_Outbox` whose sender thread writes its messages in order (vLLM's engine core sends its
outputs from a separate thread too), so a front end that is slow to read, still starting or
stopped (SIGSTOP) holds back only its own messages, never the engine loop. While one's backlog
is over :data:`MAX_BACKLOG` messages, its stats-only messages are merged (newest state, summed
counts; a warning says so); nothing is dropped. At the engine's exit the sender threads deliver
what is queued (:meth:`ClientChannels.close`).

A front end leaves with a :class:`Shutdown` command or by closing its pipe (its process ended):
its requests still in the engine are aborted (their KV blocks freed) and its pipe is closed.
When the last front end has left, the engine loop is told to shut down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from multiprocessing.connection import Connection, wait

from engine.core.commands import AbortRequest, Command, CommandKind, Shutdown
from engine.core.outputs import RequestOutput
from engine.core.stats import StepStats, combine_steps

log = logging.getLogger(__name__)

#: messages waiting for one front end beyond which its stats-only messages are merged
MAX_BACKLOG = 4096


class _Outbox:
    """The messages waiting for one front end and the daemon thread that sends them, in order,
    over its pipe (a blocking ``Connection.send`` that waits only for that front end).

    Over :data:`MAX_BACKLOG` queued messages, a stats-only message is merged into the last one
    queued when that one is stats-only too (:func:`combine_steps`: newest state, summed counts),
    so a front end that does not read costs bounded memory and loses no count."""

    def __init__(self, index: int, conn: Connection):
        self.index = index
        self._conn = conn
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._closed = False  # stop now, discard what is queued
        self._draining = False  # stop once the queue is empty
        self._merged = 0
        self._thread = threading.Thread(target=self._run, name=f"send-{index}", daemon=True)
        self._thread.start()

    def put(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Queue one ``("out", outputs, stats)`` message (called from the engine thread)."""
        first_merge = False
        with self._cond:
            if self._closed or self._draining:
                return
            last = self._queue[-1] if self._queue else None
            if (
                not outputs
                and stats is not None
                and len(self._queue) >= MAX_BACKLOG
                and not last[1]
                and last[2] is not None
            ):
                self._queue[-1] = ("out", [], combine_steps(last[2], stats))
                self._merged += 1
                first_merge = self._merged == 1
                waiting = len(self._queue)
            else:
                self._queue.append(("out", outputs, stats))
                self._cond.notify()
        if first_merge:
            log.warning(
                "front end %d is not reading (%d messages waiting): merging its step stats "
                "until it catches up",
                self.index,
                waiting,
            )

    def close(self, drain_timeout: float | None = None) -> None:
        """Stop sending: at once, discarding what is queued (the front end left), or with
        ``drain_timeout`` seconds after the queued messages were sent (the engine is exiting:
        its last outputs, say the errors of a fatal step, must reach the front ends)."""
        with self._cond:
            if drain_timeout is None:
                self._closed = True
                self._queue.clear()
            else:
                self._draining = True
            self._cond.notify()
        if drain_timeout is not None:
            self._thread.join(drain_timeout)

    def _run(self) -> None:
        while True:
            caught_up = 0
            with self._cond:
                while not self._queue and not self._closed and not self._draining:
                    self._cond.wait()
                if self._closed or not self._queue:
                    return
                msg = self._queue.popleft()
                if self._merged and not self._queue:
                    caught_up, self._merged = self._merged, 0
            if caught_up:
                log.info("front end %d caught up (%d step stats merged)", self.index, caught_up)
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                return  # it is gone; next_commands sees the closed pipe and aborts its requests


class ClientChannels:
    """Routes commands from, and outputs to, the front ends of one engine core.

    Args:
        conns: one pipe end per front end; the lowest-numbered front end still connected also
            receives the step stats (every step, with or without outputs of its own).
        sender_threads: send through one :class:`_Outbox` thread per front end (None: when
            there are several front ends; a single front end is written to directly, as it
            is the only one the engine serves anyway).

    ``next_commands`` and ``emit`` are the engine loop's two callbacks
    (``engine.core.engine_loop.run_engine_loop``); both run on the engine loop's thread.
    """

    def __init__(self, conns: list[Connection], sender_threads: bool | None = None):
        self._conns: dict[int, Connection] = dict(enumerate(conns))
        if sender_threads is None:
            sender_threads = len(conns) > 1
        self._outboxes: dict[int, _Outbox] = (
            {i: _Outbox(i, c) for i, c in self._conns.items()} if sender_threads else {}
        )
        self._owner: dict[str, int] = {}  # request id -> index of the front end that added it
        self._shutdown_sent = False

    @property
    def num_clients(self) -> int:
        """Front ends still connected."""
        return len(self._conns)

    def next_commands(self, timeout: float) -> list[Command]:
        """The commands queued by all front ends, waiting up to ``timeout`` seconds for one.

        A front end that left (Shutdown, or a closed pipe) turns into aborts of its requests;
        when none is left the list ends with one :class:`Shutdown` for the engine loop. An add
        whose id another front end is already using is failed back to its sender and dropped.
        """
        commands: list[Command] = []
        if not self._conns:
            return self._final(commands)
        try:
            ready = wait(list(self._conns.values()), timeout)
        except OSError:  # a pipe closed under us: treated below as that front end leaving
            ready = list(self._conns.values())
        for index, conn in list(self._conns.items()):
            if conn not in ready:
                continue
            try:
                while conn.poll(0):
                    cmd = conn.recv()
                    if cmd.kind is CommandKind.SHUTDOWN:
                        raise EOFError
                    if cmd.kind is CommandKind.ADD:
                        owner = self._owner.setdefault(cmd.request_id, index)
                        if owner != index:
                            self._send(
                                index,
                                [RequestOutput.failed(cmd.request_id, "duplicate request id")],
                                None,
                            )
                            continue
                    elif cmd.kind is CommandKind.ABORT:
                        owner = self._owner.get(cmd.request_id)
                        if owner is None:  # finished already (or never added): nothing to do
                            continue
                        if owner != index:
                            log.debug(
                                "ignored an abort of %s from front end %d", cmd.request_id, index
                            )
                            continue
                        del self._owner[cmd.request_id]
                    commands.append(cmd)
            except (EOFError, OSError):  # it left: abort what it still had in the engine
                commands.extend(self._leave(index))
        return self._final(commands)

    def _final(self, commands: list[Command]) -> list[Command]:
        if not self._conns and not self._shutdown_sent:
            self._shutdown_sent = True
            commands.append(Shutdown())
        return commands

    def _leave(self, index: int) -> list[Command]:
        conn = self._conns.pop(index)
        outbox = self._outboxes.pop(index, None)
        if outbox is not None:
            outbox.close()
        try:
            conn.close()
        except OSError:
            pass
        mine = [rid for rid, owner in self._owner.items() if owner == index]
        for rid in mine:
            del self._owner[rid]
        if mine or len(self._conns):
            log.info(
                "front end %d left (%d request(s) aborted); %d still connected",
                index,
                len(mine),
                len(self._conns),
            )
        return [AbortRequest(rid) for rid in mine]

    def emit(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Send each output to the front end that added its request, and ``stats`` to the
        lowest-numbered front end still connected (front end 0 unless it left first, as it
        may during a shutdown; a step with stats always reaches it, with its outputs or
        none)."""
        if len(self._conns) == 1 and 0 in self._conns:  # the common single-front-end case
            for out in outputs:
                if out.finished:
                    self._owner.pop(out.request_id, None)
            self._send(0, outputs, stats)
            return
        routed: dict[int, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            owner = self._owner.pop(out.request_id, None) if out.finished else None
            if owner is None:
                owner = self._owner.get(out.request_id)
            if owner is not None:
                routed[owner].append(out)
        stats_to = min(self._conns) if self._conns else None
        if stats is not None and stats_to is not None:
            routed.setdefault(stats_to, [])
        for index, outs in routed.items():
            self._send(index, outs, stats if index == stats_to else None)

    def close(self, drain_timeout: float) -> None:
        """At the engine's exit: let each sender thread deliver what is queued, waiting at most
        ``drain_timeout`` seconds in all (a direct sender has nothing queued)."""
        deadline = time.monotonic() + drain_timeout
        for outbox in self._outboxes.values():
            outbox.close(max(0.0, deadline - time.monotonic()))

    def _send(self, index: int, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        outbox = self._outboxes.get(index)
        if outbox is not None:
            outbox.put(outputs, stats)
            return
        conn = self._conns.get(index)
        if conn is None:
            return
        try:
            conn.send(("out", outputs, stats))
        except (BrokenPipeError, OSError):
            pass  # it is gone; next_commands sees the closed pipe and aborts its requests
