"""Prepare, on the development machine, what a GPU call carries: wheels, tokenizer, old tree.

The device image (KINDS.md's package list, read 2026-11-17) lacks the server's web stack and
grammar engine, the benchmark scripts want the real Qwen3 tokenizer for their random
checkpoints, and A/B runs want the previous main as a plain tree. This script makes the three
ignored folders the device calls name in ``carry`` (bench/gpu_env.sh installs the wheels):

* ``.whl/``: one wheel (CPython 3.12, manylinux x86-64) per package in the dependency closure of
  this project's runtime requirements, plus the ``openai`` client the transformers peer of
  ``bench/serve.py`` needs, that the device image does not have, at the versions installed
  in this machine's environment (so the GPU runs the versions ``make test`` tested).
* ``.benchassets/tokenizer/``: tokenizer.json and tokenizer_config.json of the embedded
  checkpoint (the real Qwen3 vocabulary; ``--tokenizer-from`` of the benchmarks).
* ``.basetree/``: ``git archive`` of a commit (``--basetree``: the previous main).
* ``.benchassets/trees.txt`` and ``.benchassets/tree.sha256``: the code these assets were made
  beside, ``tree <HEAD>`` (``+ uncommitted changes`` where the working tree differs from it) and
  ``basetree <commit>``, and the checksums of the files a call sends (tracked, and untracked
  but not ignored); the device copy has no git history, so ``bench/h200_pending.sh`` prints
  the stamps and checks the sums (a file changed or removed after this script ran is
  reported; one added is not).

Usage::

    .venv/bin/python bench/device_assets.py --basetree <previous-main-commit>
    .venv/bin/python bench/device_assets.py --dry-run      # print the pip command only

Raises SystemExit with pip's or git's exit status when either fails.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Packages of the device image ('cuda', KINDS.md, 2026-11-17) that the closure may name: these
#: are not carried. Only names the project's closure can reach are listed.
DEVICE_IMAGE_HAS = frozenset(
    {
        "aiohttp", "annotated-doc", "anyio", "certifi", "charset-normalizer", "click",
        "filelock", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna",
        "jinja2", "markupsafe", "mpmath", "networkx", "numpy", "packaging", "prometheus-client",
        "pyyaml", "regex", "requests", "safetensors", "setuptools", "sympy", "tiktoken",
        "tokenizers", "torch", "tqdm", "transformers", "triton", "typing-extensions", "urllib3",
        "uvloop", "zipp",
    }
)  # fmt: skip

#: environment markers of the device's interpreter (CPython 3.12 on x86-64 Linux): a
#: requirement such as ``typing-extensions; python_version < "3.13"`` is taken as it would be there
DEVICE_MARKERS = {
    "extra": "",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}

#: Roots of the closure: this project (its runtime requirements) and the peer's client.
ROOTS = ("qwen-serve", "openai")

#: pip's platform tags for the device (x86-64, glibc 2.17-2.39: the device README's range); pip
#: matches each exactly, so every glibc minor a wheel may name is listed, newest first.
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Pydantic_Core`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """Installed versions of the roots and everything they require on the device, extras not
    taken (markers evaluated for `DEVICE_MARKERS`).

    Returns:
        canonical name -> installed version, for every distribution reached that is installed
        (a requirement whose marker is false here, or that is not installed, is skipped).
    """
    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = canonical(stack.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(DEVICE_MARKERS):
                stack.append(req.name)
    return seen


def wheels_to_carry(versions: dict[str, str], roots: tuple[str, ...] = ROOTS) -> list[str]:
    """``name==version`` pins of the closure that the device image lacks, sorted.

    The roots that are this project itself travel as source, not as wheels; local version
    labels (``2.13.0+cpu``) never reach the list because torch is in the image.
    """
    own = {canonical(r) for r in roots if r == "qwen-serve"}
    return sorted(
        f"{name}=={version}"
        for name, version in versions.items()
        if name not in DEVICE_IMAGE_HAS and name not in own
    )


def pip_download_command(pins: list[str], dest: Path) -> list[str]:
    """The ``pip download`` line for CPython 3.12 manylinux x86-64 binary wheels of ``pins``."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["-d", str(dest), *pins]


def write_tokenizer(dest: Path) -> None:
    """Copy the embedded checkpoint's tokenizer.json / tokenizer_config.json into ``dest``."""
    from engine.loader.embedded import ensure_embedded_checkpoint

    ckpt = ensure_embedded_checkpoint()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, dest / name)


#: the file in ``.basetree`` naming the commit it was archived from
BASETREE_STAMP = "BASETREE_COMMIT"


def git_out(repo: Path, *args: str) -> str:
    """``git -C repo args`` output, stripped (git's messages go to this process's stderr).

    Raises:
        subprocess.CalledProcessError: git failed."""
    return subprocess.run(
        ["git", "-C", str(repo), *args], stdout=subprocess.PIPE, text=True, check=True
    ).stdout.strip()


def write_basetree(commit: str, dest: Path, repo: Path = REPO) -> None:
    """Replace ``dest`` with the tracked files of ``commit`` (``git archive``), and name the
    commit's short hash in ``dest / BASETREE_STAMP``."""
    short = git_out(repo, "rev-parse", "--short", commit)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "tree.tar"
        git_out(repo, "archive", "-o", str(archive), commit)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    (dest / BASETREE_STAMP).write_text(short + "\n")


def tree_stamps(repo: Path, basetree: Path) -> str:
    """The lines of ``.benchassets/trees.txt``: ``tree <HEAD short hash>`` (`` + uncommitted
    changes`` appended where ``git status`` lists any change, untracked files not ignored
    included: a call sends those too) and ``basetree <short hash>`` from ``basetree``'s stamp
    (``basetree (none)`` where there is no stamp)."""
    dirty = git_out(repo, "status", "--porcelain")
    tree = git_out(repo, "rev-parse", "--short", "HEAD") + (
        " + uncommitted changes" if dirty else ""
    )
    stamp = basetree / BASETREE_STAMP
    base = stamp.read_text().strip() if stamp.is_file() else "(none)"
    return f"tree {tree}\nbasetree {base}\n"


def tree_sums(repo: Path) -> str:
    """``sha256sum``'s lines (``<hex>  <path>``, paths relative to ``repo``) for the files a
    device call sends: tracked, and untracked but not ignored (``git ls-files --cached
    --others --exclude-standard``), those present as regular files."""
    listed = git_out(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    lines = []
    for rel in sorted(set(filter(None, listed.split("\0")))):
        path = repo / rel
        if path.is_file() and not path.is_symlink():
            lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}\n")
    return "".join(lines)


def main() -> None:
    """Write ``.whl`` (unless ``--skip-wheels``), ``.benchassets/tokenizer`` (unless
    ``--skip-tokenizer``), ``.basetree`` (with ``--basetree``), and the stamps
    ``.benchassets/trees.txt`` and ``.benchassets/tree.sha256``; ``--dry-run`` only prints the
    pins and the pip command."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--basetree", metavar="COMMIT", help="write .basetree from this commit")
    ap.add_argument("--skip-wheels", action="store_true")
    ap.add_argument("--skip-tokenizer", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print what would be carried")
    args = ap.parse_args()
    pins = wheels_to_carry(closure())
    whl = REPO / ".whl"
    if args.dry_run:
        print("\n".join(pins))
        print(" ".join(pip_download_command(pins, whl)))
        return
    if not args.skip_wheels:
        for old in whl.glob("*.whl"):  # one version of each: two stop the install there
            old.unlink()
        subprocess.run(pip_download_command(pins, whl), check=True)
        print(f".whl: {len(list(whl.glob('*.whl')))} wheels for {len(pins)} pins")
    if not args.skip_tokenizer:
        write_tokenizer(REPO / ".benchassets" / "tokenizer")
        print(".benchassets/tokenizer written")
    if args.basetree:
        write_basetree(args.basetree, REPO / ".basetree")
        print(f".basetree = {args.basetree}")
    assets = REPO / ".benchassets"
    assets.mkdir(parents=True, exist_ok=True)
    stamps = tree_stamps(REPO, REPO / ".basetree")
    (assets / "trees.txt").write_text(stamps)
    (assets / "tree.sha256").write_text(tree_sums(REPO))
    print(stamps, end="")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(exc.returncode) from exc
