"""``limit_host_threads``: one torch CPU thread for a GPU engine unless OMP_NUM_THREADS is set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = (
    "import torch; torch.set_num_threads(3); "
    "from engine.worker.device import limit_host_threads; "
    "changed = limit_host_threads(); print(changed, torch.get_num_threads())"
)


@pytest.mark.parametrize(
    ("omp", "expected"), [(None, "True 1"), ("3", "False 3")], ids=["unset", "set"]
)
def test_limit_host_threads_follows_omp_num_threads(omp, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
