"""``idle_polling``: the engine process keeps polling its pipes for a while after its last work,
then waits as the loop asks."""

from __future__ import annotations

from engine.core.engine_loop import idle_polling


class FakePipes:
    """``next_commands`` over a scripted clock: commands become available at given times; every
    call advances the clock by ``tick`` (a poll) or by the timeout it waited."""

    def __init__(self, arrivals: dict[float, str], tick: float = 0.001):
        self.now, self.tick, self.arrivals = 0.0, tick, dict(arrivals)
        self.calls: list[float] = []

    def clock(self) -> float:
        return self.now

    def next_commands(self, timeout: float) -> list[str]:
        self.calls.append(timeout)
        due = sorted(t for t in self.arrivals if t <= self.now + timeout)
        if due:
            self.now = max(self.now, due[0]) + self.tick
            return [self.arrivals.pop(due[0])]
        self.now += timeout if timeout > 0 else self.tick
        return []


def test_zero_window_is_the_plain_callable():
    pipes = FakePipes({})
    assert idle_polling(pipes.next_commands, 0.0) == pipes.next_commands


def test_a_command_inside_the_window_is_taken_by_polling():
    pipes = FakePipes({0.05: "add"})
    next_commands = idle_polling(pipes.next_commands, 0.2, pipes.clock)
    assert next_commands(0.5) == ["add"]
    # it never blocked: only zero-timeout polls, about one per tick until the arrival
    assert set(pipes.calls) == {0.0} and 45 <= len(pipes.calls) <= 55


def test_after_the_window_it_waits_with_the_loops_timeout():
    pipes = FakePipes({})
    next_commands = idle_polling(pipes.next_commands, 0.2, pipes.clock)
    assert next_commands(0.5) == []
    polls = len(pipes.calls)
    assert pipes.calls[-1] == 0.5 and set(pipes.calls[:-1]) == {0.0}
    assert 195 <= polls <= 205  # 0.2 s of 1 ms polls, then one wait
    assert next_commands(0.5) == [] and pipes.calls[polls:] == [0.5]  # the window stays closed


def test_work_reopens_the_window():
    pipes = FakePipes({1.0: "add"})
    next_commands = idle_polling(pipes.next_commands, 0.2, pipes.clock)
    pipes.now = 0.9  # idle past the window: the next call waits with the timeout
    assert next_commands(0.5) == ["add"] and pipes.calls == [0.5]
    pipes.calls.clear()
    assert next_commands(0.0) == []  # the loop is busy (a step with requests)
    pipes.now += 0.1  # the step's time; the request finished
    pipes.arrivals[pipes.now + 0.05] = "next"
    assert next_commands(0.5) == ["next"]
    assert set(pipes.calls) == {0.0}  # polled: the busy call reopened the window


def test_the_window_opens_when_a_long_step_ends():
    """A step longer than the window: the window counts from the step's end, not from the busy
    call before it."""
    pipes = FakePipes({})
    next_commands = idle_polling(pipes.next_commands, 0.05, pipes.clock)
    assert next_commands(0.0) == []  # busy: a step follows
    pipes.now += 0.1  # the step: twice the window
    pipes.arrivals[pipes.now + 0.01] = "next"
    pipes.calls.clear()
    assert next_commands(0.5) == ["next"]
    assert set(pipes.calls) == {0.0}  # taken by polling, not by a blocking wait
