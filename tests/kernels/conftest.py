"""Kernel tests run on the CPU under the Triton interpreter when no CUDA device is present.

``TRITON_INTERPRET=1`` must be set before the kernel modules are imported (they are imported
by the test modules, which pytest collects after this conftest).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
