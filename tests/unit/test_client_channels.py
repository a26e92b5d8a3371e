"""The engine core's routing between several front ends (engine.frontend.client_channels) and the
connection slots the API servers share (server.http_protocol.ConnectionSlots), over real
``multiprocessing`` pipes and a real shared value."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from engine.core.commands import AbortRequest, AddRequest, CommandKind, Shutdown
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason, SamplingParams
from engine.core.stats import StepStats, combine_steps
from engine.frontend import client_channels
from engine.frontend.client_channels import ClientChannels
from server.http_protocol import ConnectionSlots


def _stats(running: int) -> StepStats:
    return StepStats(running, 0, 10, 12, 2 / 12, 3, running, 0, 0, 0, 0.001)


def _channels(n: int):
    pipes = [mp.Pipe() for _ in range(n)]
    return ClientChannels([p[1] for p in pipes]), [p[0] for p in pipes]


def _drain(conn) -> list:
    msgs = []
    while conn.poll(0.05):
        msgs.append(conn.recv())
    return msgs


def test_outputs_go_to_the_front_end_that_added_the_request_and_stats_to_front_end_0():
    ch, (c0, c1) = _channels(2)
    c0.send(AddRequest("a", [1, 2], SamplingParams()))
    c1.send(AddRequest("b", [3], SamplingParams()))
    cmds = ch.next_commands(1.0)
    assert sorted(c.request_id for c in cmds) == ["a", "b"]
    ch.emit([RequestOutput("a", [5]), RequestOutput("b", [6])], _stats(2))
    (m0,) = _drain(c0)
    (m1,) = _drain(c1)
    assert m0[0] == "out" and [o.request_id for o in m0[1]] == ["a"] and m0[2].num_running == 2
    assert [o.request_id for o in m1[1]] == ["b"] and m1[2] is None
    # a step without outputs of front end 1: only front end 0 hears of it (the stats)
    ch.emit([RequestOutput("a", [7])], _stats(2))
    assert len(_drain(c0)) == 1 and _drain(c1) == []
    # a finished request is forgotten: a late output for it goes nowhere
    ch.emit([RequestOutput("b", [8], finished=True, finish_reason=FinishReason.LENGTH)], None)
    assert [o.request_id for o in _drain(c1)[0][1]] == ["b"]
    ch.emit([RequestOutput("b", [9])], None)
    assert _drain(c1) == [] and _drain(c0) == []


def test_a_duplicate_id_from_another_front_end_is_failed_back_to_it():
    ch, (c0, c1) = _channels(2)
    c0.send(AddRequest("same", [1], SamplingParams()))
    assert [c.request_id for c in ch.next_commands(1.0)] == ["same"]
    c1.send(AddRequest("same", [2], SamplingParams()))
    assert ch.next_commands(1.0) == []
    (msg,) = _drain(c1)
    assert msg[1][0].error == "duplicate request id" and msg[1][0].finished
    ch.emit([RequestOutput("same", [4])], None)  # still front end 0's
    assert [o.request_id for o in _drain(c0)[0][1]] == ["same"]


def test_a_front_end_that_leaves_has_its_requests_aborted_and_the_last_one_stops_the_loop():
    ch, (c0, c1) = _channels(2)
    c0.send(AddRequest("a", [1], SamplingParams()))
    c1.send(AddRequest("b1", [1], SamplingParams()))
    c1.send(AddRequest("b2", [1], SamplingParams()))
    ch.next_commands(1.0)
    c1.close()  # its process died
    cmds = ch.next_commands(1.0)
    assert all(isinstance(c, AbortRequest) for c in cmds)
    assert sorted(c.request_id for c in cmds) == ["b1", "b2"]
    assert ch.num_clients == 1
    ch.emit([RequestOutput("b1", [3])], _stats(1))  # nothing to send to the gone front end
    c0.send(Shutdown())  # front end 0 leaves politely: its request is aborted, the loop stops
    cmds = ch.next_commands(1.0)
    assert [c.kind for c in cmds] == [CommandKind.ABORT, CommandKind.SHUTDOWN]
    assert cmds[0].request_id == "a"
    assert ch.next_commands(0.0) == []  # one Shutdown only
    try:  # the core closed its end: the front end's reader sees the end of the pipe
        c0.recv()  # (the stats message from before)
        c0.recv()
        raise AssertionError("pipe still open")
    except EOFError:
        pass


def test_a_front_end_aborts_only_its_own_requests_and_an_aborted_request_is_forgotten():
    ch, (c0, c1) = _channels(2)
    c0.send(AddRequest("a", [1], SamplingParams()))
    ch.next_commands(1.0)
    c1.send(AbortRequest("a"))  # not front end 1's request: ignored
    assert ch.next_commands(0.2) == []
    c0.send(AbortRequest("a"))
    assert [(c.kind, c.request_id) for c in ch.next_commands(1.0)] == [(CommandKind.ABORT, "a")]
    assert ch._owner == {}  # nothing left behind (the engine emits nothing for an abort)
    c1.send(AddRequest("a", [2], SamplingParams()))  # the id is free again
    assert [c.request_id for c in ch.next_commands(1.0)] == ["a"]
    c0.send(AbortRequest("a"))  # front end 1's now
    assert ch.next_commands(0.2) == []
    ch.emit([RequestOutput("a", [3])], None)
    assert [o.request_id for o in _drain(c1)[0][1]] == ["a"]


def test_a_front_end_that_does_not_read_never_blocks_the_engine(monkeypatch):
    """Front end 0 (the one that gets every step's stats) reads nothing, as when its process
    is still starting or stopped: the engine keeps emitting to front end 1 without waiting;
    front end 0's backlog stays bounded, its stats merged, no step's counts lost."""
    monkeypatch.setattr(client_channels, "MAX_BACKLOG", 64)
    ch, (c0, c1) = _channels(2)
    c1.send(AddRequest("b", [1], SamplingParams()))
    ch.next_commands(1.0)
    steps = 3000  # ~1 MB of messages: more than a pipe's buffer holds by default
    received: list = []
    reader = threading.Thread(
        target=lambda: received.extend(c1.recv() for _ in range(steps)), daemon=True
    )
    reader.start()
    done = threading.Event()

    def engine() -> None:
        for i in range(steps):
            ch.emit([RequestOutput("b", [i] * 40)], _stats(1 + i))
        done.set()

    threading.Thread(target=engine, daemon=True).start()
    if not done.wait(20):
        pytest.fail("emit blocked on the front end that does not read")
    reader.join(20)
    assert [m[1][0].new_token_ids[0] for m in received] == list(range(steps))  # all, in order
    assert all(m[2] is None for m in received)
    assert len(ch._outboxes[0]._queue) <= 64
    got = _drain(c0)  # front end 0 starts reading: every step's counts arrive, newest state last
    deadline = time.monotonic() + 10
    while sum(m[2].num_generation_tokens for m in got) < sum(range(1, steps + 1)):
        assert time.monotonic() < deadline, len(got)
        got += _drain(c0)
    assert sum(m[2].num_generation_tokens for m in got) == sum(range(1, steps + 1))
    assert sum(m[2].num_prompt_tokens for m in got) == 3 * steps
    assert got[-1][2].num_running == steps


def test_stats_go_to_the_next_front_end_when_front_end_0_left_and_the_queue_drains_at_exit():
    ch, (c0, c1, c2) = _channels(3)
    c2.send(AddRequest("c", [1], SamplingParams()))
    ch.next_commands(1.0)
    c0.send(Shutdown())  # front end 0 finished its shutdown first
    ch.next_commands(1.0)
    ch.emit([RequestOutput("c", [4])], _stats(5))
    (m1,) = _drain(c1)
    (m2,) = _drain(c2)
    assert m1[1] == [] and m1[2].num_running == 5  # the gauges live on
    assert m2[1][0].request_id == "c" and m2[2] is None
    # a fatal step's last outputs, emitted just before the engine exits, are delivered
    ch.emit([RequestOutput.failed("c", "CUDA error")], None)
    ch.close(5.0)
    (last,) = _drain(c2)
    assert last[1][0].error == "CUDA error"


def test_combine_steps_keeps_the_newest_state_and_sums_the_counts():
    a = StepStats(3, 1, 10, 12, 0.2, 100, 3, 1, 64, 32, 0.004)
    b = StepStats(2, 0, 11, 12, 0.1, 0, 2, 0, 16, 16, 0.003, 7, 8, 9)
    c = combine_steps(a, b)
    assert (c.num_running, c.num_waiting, c.num_free_blocks, c.kv_usage) == (2, 0, 11, 0.1)
    assert (c.gpu_memory_allocated, c.gpu_memory_reserved, c.gpu_memory_total) == (7, 8, 9)
    assert (c.num_prompt_tokens, c.num_generation_tokens, c.num_preemptions) == (100, 5, 1)
    assert (c.prefix_queries, c.prefix_hits) == (80, 48)
    assert c.step_seconds == pytest.approx(0.007)


def test_connection_slots_are_one_count_over_processes():
    shared = mp.get_context("spawn").Value("q", 0)
    a, b = ConnectionSlots(3, shared), ConnectionSlots(3, shared)
    assert [a.acquire(), b.acquire(), a.acquire()] == [True] * 3
    assert not b.acquire() and not a.acquire() and len(a) == len(b) == 3
    b.release()
    assert a.acquire() and not b.acquire()
    local = ConnectionSlots(1)
    assert local.acquire() and not local.acquire()
    local.release()
    assert local.acquire() and len(local) == 1
