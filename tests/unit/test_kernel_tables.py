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
    (tmp_path / "fp8_gemm_NVIDIA_H200.json").write_text(json.dumps({"from": "h200 fp8"}))
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


def test_the_fallback_is_per_kernel(tables):
    """A GPU with its own gemv table still reads the architecture's table of another kernel."""
    assert configs.kernel_table("fp8_gemm", "Own Hopper") == {"from": "h200 fp8"}
    assert configs.kernel_table("fp8_gemm", "NVIDIA H100 80GB HBM3") == {"from": "h200 fp8"}
    assert configs.kernel_table("prefill_attention", "Own Hopper") == {}  # none measured
    summary = configs.tables_summary("Own Hopper")
    assert summary == "gemv: Own Hopper, gemv_fused: none, prefill_attention: none, " \
        "fp8_gemm: NVIDIA H200"  # fmt: skip
    assert configs.tables_summary("NVIDIA H200") != "own"  # two kernels have no table here


def test_other_architectures_read_nothing(tables):
    assert configs.kernel_table("gemv", "NVIDIA A100-SXM4-80GB") == {}
    assert configs.kernel_table("fp8_gemm", "NVIDIA A100-SXM4-80GB") == {}
    assert configs.kernel_table("gemv", "never seen") == {}  # no capability known: no family


def test_device_name_records_the_capability(monkeypatch):
    monkeypatch.setattr(configs.torch.cuda, "get_device_name", lambda index: "Some Hopper")
    monkeypatch.setattr(configs.torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(configs, "_CAPABILITY", {})
    configs._cuda_name.cache_clear()
    try:
        assert configs.device_name(configs.torch.device("cuda", 3)) == "Some Hopper"
        assert configs._CAPABILITY == {"Some Hopper": (9, 0)}
        assert configs.table_device("gemv", "Some Hopper") == "NVIDIA H200"
    finally:
        configs._cuda_name.cache_clear()


def test_current_table_is_a_copy(tables):
    table = configs.current_table("gemv", "NVIDIA H100 80GB HBM3")
    table["from"] = "changed"
    assert configs.kernel_table("gemv", "NVIDIA H100 80GB HBM3") == {"from": "h200"}


def test_the_repository_serves_its_h200_tables_to_an_h100(monkeypatch):
    monkeypatch.setitem(configs._CAPABILITY, "NVIDIA H100 80GB HBM3", (9, 0))
    configs.kernel_table.cache_clear()
    try:
        for kernel in configs.TABLE_KERNELS:
            own = configs.kernel_table(kernel, "NVIDIA H200")
            assert own, f"no {kernel} table for the H200 in the repository"
            assert configs.kernel_table(kernel, "NVIDIA H100 80GB HBM3") == own
        assert configs.tables_summary("NVIDIA H200") == "own"
        assert configs.tables_summary("NVIDIA H100 80GB HBM3") == ", ".join(
            f"{k}: NVIDIA H200" for k in configs.TABLE_KERNELS
        )
    finally:
        configs.kernel_table.cache_clear()
