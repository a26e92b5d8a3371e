"""The package layout as a rule: imports flow one way, never in a circle, and the engine core is
pure Python.

Reads every module of ``server/``, ``engine/`` and ``kernels/`` with ``ast`` (imports inside
functions count too: a lazy import is still a dependency) and checks:

* no import cycle between project modules;
* layers, highest first: ``server`` > ``engine.frontend`` > ``engine.worker`` >
  ``engine.models``, ``engine.loader`` > ``engine.core``, ``engine.attention``,
  ``engine.layers`` > ``kernels``. A module imports only from its own package or from lower
  layers (so siblings of one layer do not import each other either);
* ``kernels`` imports only torch, triton and the standard library; the engine never imports the
  HTTP stack or the Prometheus client;
* nothing reachable from ``engine.core`` imports torch, statically (this graph) and at run time
  (a fresh interpreter imports every core module and must not have loaded torch).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engine", "kernels")

#: package prefix -> layer (higher may import lower)
LAYERS = {
    "server": 5,
    "engine.frontend": 4,
    "engine.worker": 3,
    "engine.models": 2,
    "engine.loader": 2,
    "engine.core": 1,
    "engine.attention": 1,
    "engine.layers": 1,
    "kernels": 0,
}
TORCH = {"torch", "triton"}
HTTP_STACK = {"fastapi", "starlette", "uvicorn", "prometheus_client"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(project modules, top-level external packages) that ``name`` imports anywhere."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    project, external = set(), set()

    def add(target: str) -> None:
        top = target.split(".")[0]
        if top in PACKAGES:
            # the longest prefix that is a project module, and every package above it (importing
            # a.b.c runs a/__init__.py and a/b/__init__.py first)
            parts = target.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()
            for i in range(1, len(parts) + 1):
                project.add(".".join(parts[:i]))
        else:
            external.add(top)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "__future__":
                continue
            add(mod)
            for alias in node.names:  # `from pkg import submodule`
                if f"{mod}.{alias.name}" in MODULES:
                    add(f"{mod}.{alias.name}")
    project.discard(name)
    return project, external


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> tuple[str, int] | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return best


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if _layer(m) is None and m not in ("engine",)]
    assert not unplaced, f"modules outside every layer: {unplaced}"


def test_engine_package_init_imports_nothing_of_the_project():
    """``engine/__init__.py`` runs before any engine module: it belongs to no layer, so it may
    import no project module (it would pull that layer into every other)."""
    assert GRAPH["engine"][0] == set(), GRAPH["engine"][0]


def test_model_registry_names_only_model_modules():
    """The registry imports its classes by module name (invisible to ``ast``): each one must be a
    module of ``engine/models/``."""
    from engine.models.registry import MODELS

    for arch, (module, cls) in MODELS.items():
        assert module in MODULES and module.startswith("engine.models."), (arch, module)
        assert f"class {cls}(" in MODULES[module].read_text(), (arch, cls)


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m][0]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_imports_follow_the_layers():
    wrong = []
    for m, (deps, _) in GRAPH.items():
        src = _layer(m)
        if src is None:
            continue
        for dep in deps:
            if dep in PACKAGES:  # a top-level package's __init__ (checked on its own above)
                continue
            dst = _layer(dep)
            if dst is None or dst[0] == src[0]:
                continue
            if dst[1] >= src[1]:
                wrong.append(f"{m} ({src[0]}) imports {dep} ({dst[0]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_kernels_import_only_torch_and_triton_and_engine_no_http_stack():
    stdlib = set(sys.stdlib_module_names)
    for m, (deps, ext) in GRAPH.items():
        if m.startswith("kernels"):
            assert not deps - {d for d in deps if d.startswith("kernels")}, f"{m} imports {deps}"
            assert ext <= TORCH | stdlib, f"{m} imports {ext - TORCH - stdlib}"
        if m.startswith("engine"):
            assert not ext & HTTP_STACK, f"{m} imports {ext & HTTP_STACK}"


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(GRAPH[m][0])
    return seen


def test_engine_core_reaches_no_torch_statically():
    core = [m for m in MODULES if m == "engine.core" or m.startswith("engine.core.")]
    assert len(core) > 5
    for m in core:
        for dep in _reachable(m):
            ext = GRAPH[dep][1]
            assert not ext & (TORCH | {"numpy", "safetensors", "transformers"}), (
                f"{m} reaches {dep}, which imports {ext & (TORCH | {'numpy'})}"
            )


def test_engine_core_imports_no_torch_at_run_time():
    core = sorted(m for m in MODULES if m.startswith("engine.core."))
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in core)
        + (
            "bad = sorted(k for k in sys.modules "
            "if k.split('.')[0] in ('torch', 'triton', 'numpy'))\n"
        )
        + "print(','.join(bad[:5]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"importing engine.core loads {out.stdout.strip()}"


def test_the_graph_reader_finds_an_edge_between_every_adjacent_layer():
    """The rules are not vacuous: the real graph has edges of every allowed kind."""
    edges = {
        (s[0], d[0])
        for m, (deps, _) in GRAPH.items()
        for dep in deps
        if (s := _layer(m)) and (d := _layer(dep)) and s[0] != d[0]
    }
    for pair in [
        ("server", "engine.frontend"),
        ("engine.frontend", "engine.worker"),
        ("engine.worker", "engine.models"),
        ("engine.models", "engine.attention"),
        ("engine.attention", "kernels"),
    ]:
        assert pair in edges, (
            f"no import from {pair[0]} to {pair[1]}: the graph reader misses imports"
        )


def test_a_cpu_server_does_not_import_triton():
    """The server, the engine builder and the model import no Triton at module level: kernels
    are imported where a CUDA (or interpreter) path needs them. A CPU server that imported it
    would pay its import time and print nanobind's leak report at every shutdown."""
    code = (
        "import sys; import server.app, engine.worker.build, engine.models.qwen3, "
        "engine.models.qwen3_moe; "
        "sys.exit(1 if 'triton' in sys.modules else 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:] or "triton was imported"


def test_kernel_switch_values_are_checked():
    """QWEN_SERVE_SMALL_M_GEMV / QWEN_SERVE_FUSED_QK_ROPE / QWEN_SERVE_FUSED_NORM_GEMV /
    QWEN_SERVE_FUSED_SWIGLU_GEMV take 0/1-style values; a typo is refused by name instead of
    silently leaving the kernel on."""
    code = (
        "from engine.layers import kernel_switches as k; "
        "print(k.SMALL_M_GEMV, k.FUSED_QK_ROPE, k.FUSED_NORM_GEMV, k.FUSED_SWIGLU_GEMV)"
    )
    run = lambda **env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True
    )
    r = run(
        QWEN_SERVE_SMALL_M_GEMV="off",
        QWEN_SERVE_FUSED_QK_ROPE="1",
        QWEN_SERVE_FUSED_NORM_GEMV="no",
        QWEN_SERVE_FUSED_SWIGLU_GEMV="on",
    )
    assert r.returncode == 0 and r.stdout.split() == [b"False", b"True", b"False", b"True"], (
        r.stderr
    )
    r = run(QWEN_SERVE_SMALL_M_GEMV="of")
    assert r.returncode != 0 and b"QWEN_SERVE_SMALL_M_GEMV='of'" in r.stderr
    r = run(QWEN_SERVE_FUSED_SWIGLU_GEMV="2")
    assert r.returncode != 0 and b"QWEN_SERVE_FUSED_SWIGLU_GEMV='2'" in r.stderr
