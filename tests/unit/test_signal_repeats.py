"""SignalRepeats: the same signal again within the window is a copy; later, or another signal,
is a signal of its own."""

from __future__ import annotations

import signal

from server.signal_repeats import SignalRepeats


def test_a_copy_within_the_window_is_dropped_and_later_ones_count():
    now = [100.0]
    repeats = SignalRepeats(window_s=0.1, clock=lambda: now[0])
    assert not repeats.is_repeat(signal.SIGTERM)  # the first one counts
    now[0] += 0.001
    assert repeats.is_repeat(signal.SIGTERM)  # make's copy
    assert not repeats.is_repeat(signal.SIGINT)  # another signal is not a copy
    now[0] += 0.05
    assert repeats.is_repeat(signal.SIGTERM)  # still within the window of the counted one
    now[0] += 0.06  # 0.111 s after the counted SIGTERM: a person's second signal
    assert not repeats.is_repeat(signal.SIGTERM)
    now[0] += 0.099
    assert repeats.is_repeat(signal.SIGTERM)  # the window runs from the last counted one
