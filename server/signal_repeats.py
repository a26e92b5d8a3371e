"""One stop signal delivered twice counts once.

A SIGTERM sent to the process group of ``make serve`` reaches the server twice: from the
kernel (the server is in the group) and from GNU make, which sends its children another
SIGTERM when it is terminated itself. A second signal means "end the in-flight requests now"
(:class:`server.http_server.GracefulServer`, the supervisor of ``--api-server-count N``), so
the copy would cut short the graceful timeout every ``kill -TERM -- -<pgid>``, ``timeout`` or
process-group supervisor asked for. A repeat of the same signal within :data:`REPEAT_WINDOW_S`
of the last one counted is taken for such a copy: no person sends a second Ctrl-C that fast,
make sends its copy at once.
"""

from __future__ import annotations

import time

#: seconds within which the same signal again is the first one delivered twice
REPEAT_WINDOW_S = 0.1


class SignalRepeats:
    """Tells a signal handler whether a signal is a copy of the one it just counted.

    Safe in a Python signal handler (it runs between bytecodes of the main thread; the state
    is one dict). ``clock`` is injectable for tests (seconds, monotonic).
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._counted: dict[int, float] = {}  # signal number -> when it was last counted

    def is_repeat(self, sig: int) -> bool:
        """True when ``sig`` came within ``window_s`` of the last counted ``sig`` (drop it);
        False otherwise, and the signal is counted from now."""
        now = self._clock()
        last = self._counted.get(sig)
        if last is not None and now - last < self.window_s:
            return True
        self._counted[sig] = now
        return False
