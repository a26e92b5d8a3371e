"""Which kernel tile table a GPU reads (``kernels/configs``): its own where one was measured on
it, else its architecture's measured device's (an H100 reads the H200's), else none."""

from __future__ import annotations

import json

import pytest

import kernels.configs as configs


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A table folder with a gemv table of the H200 and one of a fake Hopper part, and three
    GPUs whose capability :func:`configs.device_name` has seen."""
    for name, value in (("NVIDIA_H200", "h200"), ("Own_Hopper", "own")):
        (tmp_path / f"gemv_{name}.json").write_text(json.dumps({"from": value}))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(
        configs,
        "_CAPABILITY",
        {"NVIDIA H100 80GB HBM3": (9, 0), "Own Hopper": (9, 0), "NVIDIA A100-SXM4-80GB": (8, 0)},
    )
    configs.kernel_table.cache_clear()
    yield
    configs.kernel_table.cache_clear()


def test_a_hopper_gpu_without_tables_reads_the_h200s(tables):
    assert configs.table_device("gemv", "NVIDIA H100 80GB HBM3") == "NVIDIA H200"
    assert configs.kernel_table("gemv", "NVIDIA H100 80GB HBM3") == {"from": "h200"}


def test_a_gpu_with_its_own_table_reads_it(tables):
    assert configs.kernel_table("gemv", "Own Hopper") == {"from": "own"}
    assert configs.kernel_table("gemv", "NVIDIA H200") == {"from": "h200"}


def test_other_architectures_and_missing_kernels_read_nothing(tables):
    assert configs.kernel_table("gemv", "NVIDIA A100-SXM4-80GB") == {}
    assert configs.kernel_table("gemv", "never seen") == {}  # no capability known: no family
    assert configs.kernel_table("fp8_gemm", "NVIDIA H100 80GB HBM3") == {}  # no H200 table
    assert configs.kernel_table("fp8_gemm", "Own Hopper") == {}


def test_the_repository_serves_its_h200_tables_to_an_h100(monkeypatch):
    monkeypatch.setitem(configs._CAPABILITY, "NVIDIA H100 80GB HBM3", (9, 0))
    configs.kernel_table.cache_clear()
    try:
        for kernel in ("gemv", "gemv_fused", "prefill_attention", "fp8_gemm"):
            own = configs.kernel_table(kernel, "NVIDIA H200")
            assert own, f"no {kernel} table for the H200 in the repository"
            assert configs.kernel_table(kernel, "NVIDIA H100 80GB HBM3") == own
    finally:
        configs.kernel_table.cache_clear()
