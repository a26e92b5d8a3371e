"""Run a ``bench/*_compile_check.py`` script as the tests do: in a subprocess without
``TRITON_INTERPRET`` (the interpreter compiles nothing), the repository on ``PYTHONPATH``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_compile_check(script: str, *args: str, timeout: float = 600) -> str:
    """Run ``bench/<script>`` with ``args``; return its stdout.

    Raises:
        AssertionError: the script exited non-zero (the end of its stdout and stderr shown).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout
