"""The engine-core process's side of its pipes to one or more front ends (API servers).

With ``--api-server-count N`` one engine core serves N API-server processes (vLLM's layout for
its ``--api-server-count``: the HTTP work of many streams spread over several processes, one
scheduler and KV cache behind them). Each front end has its own ``multiprocessing`` pipe; the
core takes commands from all of them, remembers which front end added each request, and sends
every step's outputs of a request only to that front end. The step's :class:`StepStats` go to
front end 0 alone, so the step-derived metrics (gauges, preemptions, prefix-cache counters,
tokens per step) are counted once.

A front end leaves with a :class:`Shutdown` command or by closing its pipe (its process ended):
its requests still in the engine are aborted (their KV blocks freed) and its pipe is closed.
When the last front end has left, the engine loop is told to shut down.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from multiprocessing.connection import Connection, wait

from engine.core.commands import AbortRequest, Command, CommandKind, Shutdown
from engine.core.outputs import RequestOutput
from engine.core.stats import StepStats

log = logging.getLogger(__name__)


class ClientChannels:
    """Routes commands from, and outputs to, the front ends of one engine core.

    Args:
        conns: one pipe end per front end; the front end at index 0 also receives the step
            stats (every step, with or without outputs of its own).

    ``next_commands`` and ``emit`` are the engine loop's two callbacks
    (``engine.core.engine_loop.run_engine_loop``); both run on the engine loop's thread.
    """

    def __init__(self, conns: list[Connection]):
        self._conns: dict[int, Connection] = dict(enumerate(conns))
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
        """Send each output to the front end that added its request, and ``stats`` to front end
        0 (a step with stats always reaches it, with its outputs or none)."""
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
        if stats is not None:
            routed.setdefault(0, [])
        for index, outs in routed.items():
            self._send(index, outs, stats if index == 0 else None)

    def _send(self, index: int, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        conn = self._conns.get(index)
        if conn is None:
            return
        try:
            conn.send(("out", outputs, stats))
        except (BrokenPipeError, OSError):
            pass  # it is gone; next_commands sees the closed pipe and aborts its requests
