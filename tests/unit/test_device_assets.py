"""``bench/device_assets.py`` picks the wheels a GPU call carries from the installed dependency
closure (what the device image lacks, at the versions tested here) and writes the old tree."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.device_assets import (  # noqa: E402 - after the path insert
    BASETREE_STAMP,
    DEVICE_IMAGE_HAS,
    canonical,
    closure,
    git_out,
    pip_download_command,
    tree_stamps,
    tree_sums,
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


def _git(repo: Path, *args: str) -> str:
    """:func:`bench.device_assets.git_out` with a committer identity (a CI machine has none)."""
    return git_out(repo, "-c", "user.name=t", "-c", "user.email=t@t", *args)


def test_stamps_name_the_commits_and_any_change_a_call_would_send(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("/.basetree/\n/.benchassets/\n")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "a.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "two")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    base = repo / ".basetree"
    assert tree_stamps(repo, base) == f"tree {head}\nbasetree (none)\n"
    write_basetree("HEAD~1", base, repo)
    assert (base / BASETREE_STAMP).read_text() == f"{first}\n"
    assert (base / "a.py").read_text() == "x = 1\n"
    assert tree_stamps(repo, base) == f"tree {head}\nbasetree {first}\n"  # ignored: clean
    (repo / "new.py").write_text("y = 1\n")  # untracked, not ignored: a call sends it
    assert tree_stamps(repo, base).startswith(f"tree {head} + uncommitted changes\n")
    sums = tree_sums(repo)
    assert [line.split("  ")[1] for line in sums.splitlines()] == [".gitignore", "a.py", "new.py"]
    with pytest.raises(subprocess.CalledProcessError):
        write_basetree("no-such-ref", tmp_path / "other", repo)
    if shutil.which("sha256sum"):  # the device script checks the sums with it
        (repo / ".benchassets").mkdir()
        (repo / ".benchassets" / "tree.sha256").write_text(sums)
        check = ["sha256sum", "-c", "--quiet", ".benchassets/tree.sha256"]
        assert subprocess.run(check, cwd=repo, capture_output=True).returncode == 0
        (repo / "a.py").write_text("x = 3\n")
        assert subprocess.run(check, cwd=repo, capture_output=True).returncode != 0
