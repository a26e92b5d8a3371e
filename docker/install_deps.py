"""Install the project's dependencies without replacing the torch/triton already in the image.

Usage (in docker/Dockerfile, both stages): ``python install_deps.py /app/pyproject.toml``.
Writes a pip constraints file pinning the torch and triton versions present (the CPU wheel in
the cpu stage, the CUDA build of the base image in the cuda stage), so the project's
``torch>=...`` requirement never pulls another build, then installs ``[project].dependencies``.
"""

import importlib.metadata as md
import subprocess
import sys

try:
    import tomllib
except (
    ImportError
):  # Python < 3.11 (the CUDA base image's Python may be older): pip's vendored tomli
    from pip._vendor import tomli as tomllib


def main(pyproject: str) -> None:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    have = {(d.metadata["Name"] or "").lower(): d.version for d in md.distributions()}
    pins = "".join(f"{name}=={have[name]}\n" for name in ("torch", "triton") if name in have)
    with open("/tmp/constraints.txt", "w") as f:
        f.write(pins)
    print(pins, flush=True)
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-c", "/tmp/constraints.txt", *deps]
    )


if __name__ == "__main__":
    main(sys.argv[1])
