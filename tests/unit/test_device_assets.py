"""``bench/device_assets.py`` picks the wheels a GPU call carries from the installed dependency
closure (what the device image lacks, at the versions tested here) and writes the old tree."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.device_assets import (  # noqa: E402 - after the path insert
    DEVICE_IMAGE_HAS,
    canonical,
    closure,
    pip_download_command,
    tree_stamps,
    wheels_to_carry,
    write_basetree,
)


def test_closure_follows_runtime_requirements_only():
    versions = closure(("qwen-serve",))
    for name in ("fastapi", "starlette", "pydantic", "pydantic-core", "llguidance", "torch"):
        assert versions[name] == md.version(name), name
    assert "pytest" not in versions  # a test extra, not a runtime requirement


def test_carried_wheels_skip_the_image_and_the_project():
    pins = wheels_to_carry({"fastapi": "1.0", "torch": "2.13.0+cpu", "qwen-serve": "0.1.0"})
    assert pins == ["fastapi==1.0"]
    carried = wheels_to_carry(closure())
    names = {p.split("==")[0] for p in carried}
    assert not names & DEVICE_IMAGE_HAS
    assert {"fastapi", "uvicorn", "pydantic-core", "llguidance", "openai"} <= names
    assert canonical("Pydantic_Core") == "pydantic-core"


def test_pip_command_targets_the_device_python_and_glibc():
    cmd = pip_download_command(["llguidance==1.9.1"], Path("/tmp/w"))
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    platforms = {cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"}
    assert {"manylinux_2_31_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= platforms
    assert "--no-deps" in cmd and cmd[-1] == "llguidance==1.9.1"


def test_basetree_is_the_commit_tracked_files(tmp_path):
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dest = tmp_path / "base"
    (dest / "stale").mkdir(parents=True)  # replaced, not merged
    write_basetree(head, dest)
    committed = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{head}:pyproject.toml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert (dest / "pyproject.toml").read_text() == committed
    assert not (dest / "stale").exists() and not (dest / ".venv").exists()


def test_tree_stamps_name_head_and_the_basetree():
    git = ["git", "-C", str(REPO)]
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tree, base = tree_stamps("HEAD").splitlines()  # (HEAD: a shallow clone has no parent)
    assert tree == f"tree {head}" + (" + uncommitted changes" if dirty else "")
    assert base == f"basetree {head}"
    assert tree_stamps(None).splitlines()[1] == "basetree (not written)"
