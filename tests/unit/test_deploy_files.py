"""Static checks of the deployment files: docker/compose.yaml, docker/Dockerfile, /.dockerignore,
docker/prometheus.yml and the Grafana provisioning and dashboard.

No Docker engine is needed. The compose file is additionally run through a real compose parser
(`docker compose config -q` or `docker-compose config -q`) when one is installed; that test is
skipped otherwise (Debian: apt-get install -y --no-install-recommends docker-compose).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PROMETHEUS = DOCKER / "prometheus.yml"
GRAFANA_DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
GRAFANA_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "qwen-serve.json"
LOCUSTFILE = REPO / "tests" / "load" / "locustfile.py"

SERVER_PORT = 8000
# Server flags (python -m server --help); each is also QWEN_SERVE_<FLAG>. Host and port are
# fixed inside the image, the others pass through docker/compose.yaml.
SERVER_FLAGS = [
    "model",
    "host",
    "port",
    "dtype",
    "device",
    "max-model-len",
    "block-size",
    "num-kv-blocks",
    "kv-cache-memory-gb",
    "max-num-seqs",
    "max-num-batched-tokens",
    "served-model-name",
    "attention-backend",
    "api-key",
    "log-level",
    "reasoning-parser",
    "no-prefix-caching",
]
FIXED_IN_IMAGE = {"host", "port"}

# The server's Prometheus metrics (server/metrics.py).
GAUGES = {
    "qwen_serve:num_requests_running",
    "qwen_serve:num_requests_waiting",
    "qwen_serve:kv_cache_usage_perc",
    "qwen_serve:num_free_kv_blocks",
    "qwen_serve:gpu_memory_allocated_bytes",
    "qwen_serve:gpu_memory_reserved_bytes",
    "qwen_serve:gpu_memory_total_bytes",
    "qwen_serve:rank_weight_bytes",
    "qwen_serve:rank_kv_cache_bytes",
    "process_resident_memory_bytes",
}
COUNTERS = {
    "qwen_serve:prompt_tokens_total",
    "qwen_serve:generation_tokens_total",
    "qwen_serve:request_success_total",
    "qwen_serve:num_preemptions_total",
    "qwen_serve:prefix_cache_queries_total",
    "qwen_serve:prefix_cache_hits_total",
}
HISTOGRAMS = {
    "qwen_serve:time_to_first_token_seconds",
    "qwen_serve:inter_token_latency_seconds",
    "qwen_serve:e2e_request_latency_seconds",
    "qwen_serve:request_queue_time_seconds",
    "qwen_serve:request_prompt_tokens",
    "qwen_serve:request_generation_tokens",
    "qwen_serve:iteration_tokens_total",
}
INFOS = {"qwen_serve:model_info"}
SERIES = (
    GAUGES
    | COUNTERS
    | INFOS
    | {h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)

REQUIRED_PANELS = [
    "request rate",
    "output tokens/s",
    "ttft p50/p99",
    "itl p50/p99",
    "kv cache usage",
    "running / waiting",
    "gpu memory",
    "preemptions",
]


# --------------------------------------------------------------------------------------------
# compose helpers
# --------------------------------------------------------------------------------------------
_VAR = re.compile(
    r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: str) -> str:
    """Compose variable interpolation with no variables set: ${VAR:-default} -> default.
    A variable without a default fails, so the file works without any .env."""

    def repl(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, default = match.group(2), match.group(3)
        if op in (":-", "-"):
            return default
        raise AssertionError(f"compose variable {name!r} has no default in {value!r}")

    return _VAR.sub(repl, value)


def _walk_strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _walk_strings(key)
            yield from _walk_strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_strings(item)


@pytest.fixture(scope="module")
def compose() -> dict:
    assert COMPOSE.is_file(), COMPOSE
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def services(compose: dict) -> dict:
    return compose["services"]


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        out = {}
        for item in env:
            key, sep, value = item.partition("=")
            out[key] = value if sep else None
        return out
    return dict(env)


def parse_port(spec) -> tuple[str, int, int]:
    """'[ip:]host:container[/proto]' -> (ip, host, container)."""
    text = interpolate(str(spec)).split("/")[0]
    parts = text.split(":")
    assert len(parts) in (2, 3), f"port {spec!r}: publish it as [ip:]host:container"
    ip = parts[0] if len(parts) == 3 else ""
    return ip, int(parts[-2]), int(parts[-1])


def mounts_of(service: dict) -> list[tuple[str, str, str]]:
    """(source, target, mode) of each volume entry (short syntax), interpolated."""
    out = []
    for item in service.get("volumes") or []:
        assert isinstance(item, str), f"use the short volume syntax: {item!r}"
        parts = interpolate(item).split(":")
        assert len(parts) in (2, 3), f"volume {item!r}"
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else "rw"))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def host_path(service: dict, container_path: str) -> Path | None:
    """The file on this machine that a bind mount puts at container_path, if any."""
    best = None
    for source, target, _ in mounts_of(service):
        if not is_bind(source):
            continue
        target = target.rstrip("/")
        if container_path == target or container_path.startswith(target + "/"):
            if best is None or len(target) > len(best[1]):
                best = (source, target)
    if best is None:
        return None
    rest = container_path[len(best[1]) :].lstrip("/")
    return (DOCKER / best[0] / rest).resolve()


def server_flags() -> list[str]:
    """SERVER_FLAGS plus every flag `python -m server --help` lists (when the server runs here)."""
    flags = set(SERVER_FLAGS)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "server", "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        result = None
    if result is not None and result.returncode == 0:
        flags |= set(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", result.stdout)) - {"help"}
    return sorted(flags)


# --------------------------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------------------------
def test_compose_services_and_profiles(compose):
    svc = services(compose)
    assert set(svc) == {"server", "server-cpu", "prometheus", "grafana", "locust"}
    assert "profiles" not in svc["server"], "the GPU server is the profile-less default"
    assert svc["server-cpu"].get("profiles") == ["cpu"]
    assert svc["locust"].get("profiles") == ["loadtest"]
    assert "profiles" not in svc["prometheus"] and "profiles" not in svc["grafana"]
    for name, service in svc.items():
        assert service.get("image") or service.get("build"), name
        for dep in service.get("depends_on") or []:
            assert dep in svc, f"{name} depends on unknown service {dep}"
            # either server may be the one running; depending on one would start it
            assert dep not in ("server", "server-cpu"), f"{name} must not depend_on {dep}"
    # every ${VAR} used anywhere has a default
    for text in _walk_strings(compose):
        interpolate(text)


def test_compose_gpu_and_cpu_servers_are_interchangeable(compose):
    svc = services(compose)
    gpu, cpu = svc["server"], svc["server-cpu"]

    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        "gpu" in (d.get("capabilities") or []) and d.get("driver") == "nvidia" for d in devices
    ), devices
    assert "devices" not in str(cpu.get("deploy", "")), "server-cpu must not reserve a GPU"

    for service in (gpu, cpu):
        aliases = [
            a
            for net in (service.get("networks") or {}).values()
            for a in ((net or {}).get("aliases") or [])
        ]
        assert "server" in aliases, "both servers answer to the network alias `server`"
        assert [parse_port(p)[2] for p in service["ports"]] == [SERVER_PORT]
    assert set(gpu["networks"]) == set(cpu["networks"])
    assert gpu["ports"] == cpu["ports"]
    assert mounts_of(gpu) == mounts_of(cpu)
    assert env_of(gpu) == env_of(cpu)

    targets = {t for _, t, _ in mounts_of(gpu)}
    assert "/models" in targets, "the model directory is mounted at /models"
    models_mode = [m for _, t, m in mounts_of(gpu) if t == "/models"][0]
    assert models_mode == "ro"

    env = env_of(gpu)
    for flag in server_flags():
        key = "QWEN_SERVE_" + flag.upper().replace("-", "_")
        if flag in FIXED_IN_IMAGE:
            assert key not in env, f"{key} is fixed by the image (healthcheck, scrape target)"
        else:
            assert key in env, f"{key} is not passed through to the server"


def test_compose_builds_use_the_dockerfile_stages(compose):
    stages = {stage for stage, _ in dockerfile_stages()}
    for name, target in (("server", "cuda"), ("server-cpu", "cpu")):
        build = services(compose)[name]["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO, f"{name}: build context must be the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert build.get("target") == target and target in stages, (name, build, stages)


def test_compose_files_and_volumes_exist(compose):
    named = set((compose.get("volumes") or {}).keys())
    for name, service in services(compose).items():
        for source, target, mode in mounts_of(service):
            assert target.startswith("/"), (name, target)
            assert mode in ("ro", "rw"), (name, mode)
            if not is_bind(source):
                assert source in named, f"{name}: named volume {source} is not declared"
            elif target == "/models":
                pass  # the operator's model directory; docker creates it when missing
            else:
                assert (DOCKER / source).exists(), f"{name}: {source} does not exist"
        # any absolute path a service is told about (env, command) that lies under a bind
        # mount must exist on this side of the mount
        for text in _walk_strings(
            [service.get("environment"), service.get("command"), service.get("entrypoint")]
        ):
            for word in interpolate(text).split():
                if word.startswith("/"):
                    path = host_path(service, word)
                    if path is not None:
                        assert path.exists(), f"{name}: {word} -> {path} does not exist"
    for name in named:
        assert any(
            source == name for s in services(compose).values() for source, _, _ in mounts_of(s)
        ), f"volume {name} is unused"


def test_compose_ports(compose):
    svc = services(compose)
    expected = {
        "server": 8000,
        "server-cpu": 8000,
        "prometheus": 9090,
        "grafana": 3000,
        "locust": 8089,
    }
    host_ports: dict[int, str] = {}
    for name, container_port in expected.items():
        ports = [parse_port(p) for p in svc[name].get("ports") or []]
        assert [c for _, _, c in ports] == [container_port], (name, ports)
        for _, host, _ in ports:
            if name == "server-cpu":
                assert host_ports.get(host) == "server"  # the alternative to `server`
                continue
            assert host not in host_ports, f"{name} and {host_ports.get(host)} both use {host}"
            host_ports[host] = name


def test_compose_monitoring_wiring(compose):
    svc = services(compose)
    prom = svc["prometheus"]
    assert host_path(prom, "/etc/prometheus/prometheus.yml") == PROMETHEUS.resolve()

    grafana = svc["grafana"]
    assert (
        host_path(grafana, "/etc/grafana/provisioning/datasources/prometheus.yaml")
        == GRAFANA_DATASOURCES.resolve()
    )
    assert (
        host_path(grafana, "/etc/grafana/provisioning/dashboards/dashboards.yaml")
        == GRAFANA_PROVIDERS.resolve()
    )
    providers = yaml.safe_load(GRAFANA_PROVIDERS.read_text())
    assert providers["apiVersion"] == 1
    paths = [p["options"]["path"] for p in providers["providers"] if p.get("type") == "file"]
    assert paths, providers
    for path in paths:
        mounted = host_path(grafana, path)
        assert mounted is not None and (mounted / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    home = env_of(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert host_path(grafana, home) == DASHBOARD.resolve()

    locust = svc["locust"]
    env = env_of(locust)
    assert host_path(locust, env["LOCUST_LOCUSTFILE"]) == LOCUSTFILE.resolve()
    assert env["LOCUST_HOST"] == f"http://server:{SERVER_PORT}"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_with_compose_cli():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI (apt-get install -y --no-install-recommends docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    cmd = cli + ["-f", str(COMPOSE), "--profile", "cpu", "--profile", "loadtest", "config", "-q"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout}\n{result.stderr}"


# --------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore
# --------------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and pending):
            continue  # comment lines (also inside a continuation) and blank continuation lines
        if not stripped:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = pending + stripped
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def _global_args(instructions) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "FROM":
            break
        if word == "ARG":
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
    return args


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text
    )


def dockerfile_stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """[(stage name, instructions of the stage including its FROM)] in file order."""
    instructions = dockerfile_instructions()
    global_args = _global_args(instructions)
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for word, rest in instructions:
        if word == "FROM":
            tokens = [t for t in rest.split() if not t.startswith("--")]
            name = tokens[2] if len(tokens) == 3 and tokens[1].lower() == "as" else ""
            image = _substitute(tokens[0], global_args)
            stages.append((name, [("FROM", image)]))
        elif stages:
            stages[-1][1].append((word, rest))
    return stages


def _stage_args(instructions, global_args) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "ARG":
            key, sep, value = rest.partition("=")
            key = key.strip()
            args[key] = value.strip() if sep else global_args.get(key, "")
    return args


def _exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def _copy_sources(rest: str) -> list[str]:
    words = _exec_form(rest) if rest.startswith("[") else shlex.split(rest)
    words = [w for w in words if not w.startswith("--")]
    assert len(words) >= 2, rest
    return words[:-1]


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:].strip() if negate else line
        line = os.path.normpath(line).lstrip("/")
        rx = ""
        i = 0
        while i < len(line):
            if line.startswith("**", i):
                rx += ".*"
                i += 2
            elif line[i] == "*":
                rx += "[^/]*"
                i += 1
            elif line[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(line[i])
                i += 1
        patterns.append((negate, re.compile(rx)))
    return patterns


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, rx in _dockerignore_patterns():
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def _project_packages() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(
        ".".join(p.relative_to(REPO).parts[:-1])
        for p in REPO.glob("*/**/__init__.py")
        if p.parts[len(REPO.parts)] in ("server", "engine", "kernels")
    )
    unshipped = [p for p in packages if not any(fnmatch.fnmatch(p, pat) for pat in include)]
    assert not unshipped, f"packages the wheel would not contain: {unshipped}"
    return packages


def test_dockerfile_stages_and_runtime_contract():
    stages = dict(dockerfile_stages())
    assert set(stages) == {"cpu", "cuda"}, list(stages)
    assert dockerfile_stages()[-1][0] == "cuda", "a plain `docker build` builds the GPU image"
    assert re.fullmatch(
        r"pytorch/pytorch:2\.\d+\.\d+-cuda12\.\d+-cudnn\d+-runtime", stages["cuda"][0][1]
    ), stages["cuda"][0][1]
    assert stages["cpu"][0][1] == "python:3.11-slim"

    global_args = _global_args(dockerfile_instructions())
    cpu_args = _stage_args(stages["cpu"], global_args)
    cpu_runs = [_substitute(rest, cpu_args) for word, rest in stages["cpu"] if word == "RUN"]
    assert any(
        "torch==2.13.0" in r and "--index-url https://download.pytorch.org/whl/cpu" in r
        for r in cpu_runs
    ), cpu_runs

    for name, instructions in stages.items():
        words = [w for w, _ in instructions]
        users = [rest for w, rest in instructions if w == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: non-root USER"
        assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), (
            f"{name}: USER comes after the last RUN"
        )

        health = [rest for w, rest in instructions if w == "HEALTHCHECK"]
        assert len(health) == 1, name
        assert "/health" in health[0] and "urllib" in health[0] and "curl" not in health[0]

        entry = [rest for w, rest in instructions if w == "ENTRYPOINT"]
        assert entry and _exec_form(entry[-1]) == ["python", "-m", "server"], name

        volumes = [v for w, rest in instructions if w == "VOLUME" for v in _exec_form(rest)]
        assert "/models" in volumes, name
        exposed = [p for w, rest in instructions if w == "EXPOSE" for p in rest.split()]
        assert str(SERVER_PORT) in exposed, name

        env = {}
        for w, rest in instructions:
            if w == "ENV":
                for token in shlex.split(rest):
                    key, _, value = token.partition("=")
                    env[key] = value
        assert env.get("QWEN_SERVE_HOST") == "0.0.0.0", name
        assert env.get("QWEN_SERVE_PORT") == str(SERVER_PORT), name
        assert str(SERVER_PORT) in health[0] or "QWEN_SERVE_PORT" in health[0]


def test_dockerfile_copy_sources_exist_and_are_not_dockerignored():
    assert DOCKERIGNORE.is_file(), "the build context is the repository root: /.dockerignore"
    packages = {p.split(".")[0] for p in _project_packages()}
    for name, instructions in dockerfile_stages():
        copied = set()
        for word, rest in instructions:
            if word not in ("COPY", "ADD"):
                continue
            assert "--from" not in rest, rest
            for source in _copy_sources(rest):
                assert not source.startswith(("/", "..")), source
                path = REPO / source
                assert path.exists(), f"{name}: COPY source {source} does not exist"
                assert not dockerignored(source), f"{name}: {source} is excluded by .dockerignore"
                if path.is_dir():
                    init = path / "__init__.py"
                    if init.exists():
                        assert not dockerignored(f"{source}/__init__.py"), source
                copied.add(source.rstrip("/"))
        assert "pyproject.toml" in copied, name
        missing = packages - copied
        assert not missing, f"{name}: packages not copied into the image: {missing}"


def test_dockerignore_keeps_the_context_small():
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "checkpoints/x/model.safetensors",
        "tests/load/locustfile.py",
        "server/__pycache__/app.cpython-311.pyc",
    ):
        assert dockerignored(path), path
    for path in (
        "pyproject.toml",
        "server/__init__.py",
        "engine/models/__init__.py",
        "kernels/__init__.py",
    ):
        assert not dockerignored(path), path


# --------------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------------
def test_prometheus_scrapes_the_server():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert "scrape_interval" in config.get("global", {})
    jobs = [
        job
        for job in config["scrape_configs"]
        if any(
            f"server:{SERVER_PORT}" in sc.get("targets", []) for sc in job.get("static_configs", [])
        )
    ]
    assert len(jobs) == 1, config["scrape_configs"]
    assert jobs[0].get("metrics_path", "/metrics") == "/metrics"
    assert jobs[0].get("scheme", "http") == "http"
    names = [job["job_name"] for job in config["scrape_configs"]]
    assert len(names) == len(set(names))


def test_prometheus_config_with_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(PROMETHEUS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# Grafana
# --------------------------------------------------------------------------------------------
PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "count",
    "count_over_time",
    "count_values",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_sum",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "predict_linear",
    "present_over_time",
    "quantile",
    "quantile_over_time",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev",
    "stddev_over_time",
    "stdvar",
    "stdvar_over_time",
    "sum",
    "sum_over_time",
    "time",
    "timestamp",
    "topk",
    "vector",
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "atan2",
    "inf",
    "nan",
}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, function names) used by a PromQL expression (Grafana variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana variables outside matchers
    metrics, functions = set(), set()
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = match.group(0)
        if s[match.end() :].lstrip().startswith("("):
            functions.add(token)
        elif token.lower() not in PROMQL_KEYWORDS:
            metrics.add(token)
    return metrics, functions


def test_promql_name_parser():
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate(qwen_serve:time_to_first_token_seconds_"
        'bucket{model_name=~"$model", x="a{b}"}[$__rate_interval]))) / on(instance) '
        "clamp_min(sum without (le) (process_resident_memory_bytes offset 5m), 1e3)"
    )
    metrics, functions = promql_names(expr)
    assert metrics == {
        "qwen_serve:time_to_first_token_seconds_bucket",
        "process_resident_memory_bytes",
    }
    assert functions == {"histogram_quantile", "sum", "rate", "clamp_min"}


def _panels(panels):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_grafana_datasource_points_at_compose_prometheus(compose):
    config = yaml.safe_load(GRAFANA_DATASOURCES.read_text())
    assert config["apiVersion"] == 1
    [source] = config["datasources"]
    assert source["type"] == "prometheus" and source.get("uid")
    prom_ports = [parse_port(p)[2] for p in services(compose)["prometheus"]["ports"]]
    assert source["url"] == f"http://prometheus:{prom_ports[0]}"


def test_grafana_dashboard_panels_and_queries(dashboard):
    datasource_uid = yaml.safe_load(GRAFANA_DATASOURCES.read_text())["datasources"][0]["uid"]
    assert dashboard["uid"] and dashboard["title"] == "Qwen Serve"
    panels = list(_panels(dashboard["panels"]))
    titles = [p.get("title", "").lower() for p in panels]
    for required in REQUIRED_PANELS:
        assert any(required in t for t in titles), f"no panel {required!r} in {titles}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"

    exprs: list[str] = []
    for panel in panels:
        if panel.get("type") == "row":
            continue
        assert panel.get("targets"), f"panel {panel.get('title')!r} has no query"
        for target in panel["targets"]:
            for ds in (panel.get("datasource"), target.get("datasource")):
                if ds is not None:
                    assert ds == {"type": "prometheus", "uid": datasource_uid}, ds
            exprs.append(target["expr"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if variable.get("type") == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            assert match, query
            exprs.append(match.group(1))

    for expr in exprs:
        metrics, functions = promql_names(expr)
        assert metrics, f"no metric in {expr!r}"
        unknown = metrics - SERIES
        assert not unknown, f"{expr!r} uses metrics the server does not export: {unknown}"
        assert functions <= PROMQL_FUNCTIONS, f"{expr!r}: unknown functions {functions}"
        assert expr.count("(") == expr.count(")"), expr

    joined = "\n".join(exprs)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(qwen_serve:{hist}_bucket" in joined


def test_grafana_dashboard_layout(dashboard):
    boxes = []
    for panel in _panels(dashboard["panels"]):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel.get("title")
        for other_title, o in boxes:
            overlap = (
                g["x"] < o["x"] + o["w"]
                and o["x"] < g["x"] + g["w"]
                and g["y"] < o["y"] + o["h"]
                and o["y"] < g["y"] + g["h"]
            )
            assert not overlap, f"{panel.get('title')!r} overlaps {other_title!r}"
        boxes.append((panel.get("title"), g))
