"""A real Prometheus (Debian's ``prometheus`` package, installed by ``.ci/run``) scrapes a test
server with ``docker/prometheus.yml``'s scrape jobs, and every PromQL expression of the Grafana
dashboard (``docker/grafana/dashboards/qwen-serve.json``) and of any rule file the config names
is evaluated through its HTTP API after a short load: each returns at least one finite sample;
the GPU-memory panels read 0 on this CPU server, every other panel a non-zero value.

Dashboard variables are substituted as Grafana would: ``$model`` by the served model name,
``$__rate_interval`` by ``1m``; the ``model`` variable's ``label_values(...)`` query is checked
through the label-values API. The scrape interval is lowered to 1 s (the compose stack's is
5 s) so that a 20-second load gives enough samples for every ``rate``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serverproc import REPO, ServerProcess, free_port

DOCKER = REPO / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "qwen-serve.json"
MODEL = "qwen3-embedded"
RATE_INTERVAL = "1m"
GPU_PANELS = {"GPU memory"}

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (.ci/run installs Debian's `prometheus` "
    "package: apt-get install prometheus)",
)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target of every panel (rows included)."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def rule_queries(config: dict) -> list[tuple[str, str]]:
    """(rule name, expression) of every alerting/recording rule in the config's rule files."""
    out = []
    for pattern in config.get("rule_files") or []:
        for path in sorted(DOCKER.glob(pattern)):
            for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
                for rule in group.get("rules", []):
                    out.append((rule.get("alert") or rule.get("record"), rule["expr"]))
    return out


def substitute(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", MODEL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The test server (small cache: preemptions; 4 running at most: a waiting queue) and a
    Prometheus scraping it with docker/prometheus.yml's jobs."""
    srv = ServerProcess(
        "--max-model-len", "512", "--num-kv-blocks", "16", "--max-num-seqs", "4"
    ).wait_ready()
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    prom_port = free_port()
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for static in jobs["qwen-serve"]["static_configs"]:
        static["targets"] = [f"127.0.0.1:{srv.port}"]
    for static in jobs["prometheus"]["static_configs"]:
        static["targets"] = [f"127.0.0.1:{prom_port}"]
    if config.get("rule_files"):
        config["rule_files"] = [str(DOCKER / f) for f in config["rule_files"]]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{prom_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(api + "/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        assert time.monotonic() < deadline, "prometheus did not become ready"
        time.sleep(0.3)
    yield srv, api, config
    proc.terminate()
    proc.wait(30)
    log.close()
    srv.stop()


def _load(base: str, stop: threading.Event) -> None:
    """Eight clients sending streamed and plain completions over shared prefixes until stopped."""
    rng = random.Random(4)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(48)] for _ in range(3)]

    async def client_loop(i: int):
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            while not stop.is_set():
                prompt = rng.choice(prefixes) + [rng.randrange(1000, 20000) for _ in range(20)]
                body = {"prompt": prompt, "max_tokens": rng.randint(40, 100), "ignore_eos": True}
                if i % 2:
                    async with client.stream(
                        "POST", "/v1/completions", json={**body, "stream": True}
                    ) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    await client.post("/v1/completions", json=body)

    async def main():
        await asyncio.gather(*(client_loop(i) for i in range(8)))

    asyncio.run(main())


def _query(api: str, expr: str) -> list[dict]:
    r = httpx.get(api + "/api/v1/query", params={"query": expr}, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
    return r.json()["data"]["result"]


def _range_max(api: str, expr: str, start: float, end: float) -> float:
    params = {"query": expr, "start": start, "end": end, "step": "1s"}
    r = httpx.get(api + "/api/v1/query_range", params=params, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
    values = [float(v) for s in r.json()["data"]["result"] for _, v in s["values"]]
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else float("nan")


def test_every_dashboard_and_rule_expression_evaluates_on_a_real_prometheus(stack):
    srv, api, config = stack
    queries = dashboard_queries() + rule_queries(config)
    assert len(queries) >= 20, queries
    stop = threading.Event()
    start = time.time()
    loader = threading.Thread(target=_load, args=(srv.base_url, stop), daemon=True)
    loader.start()
    try:
        time.sleep(20)  # load, scraped every second
        targets = httpx.get(api + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        assert health == {"qwen-serve": "up", "prometheus": "up"}, targets
        end = time.time()
        failures = []
        for title, raw in queries:
            expr = substitute(raw)
            result = _query(api, expr)
            values = [float(s["value"][1]) for s in result]
            if not values or not all(math.isfinite(v) for v in values):
                failures.append(f"{title}: {expr} -> {values} (no finite sample)")
                continue
            peak = _range_max(api, expr, start, end)
            if title in GPU_PANELS:
                if peak != 0:
                    failures.append(f"{title}: {expr} reads {peak} on a CPU server")
            elif not peak > 0:
                failures.append(f"{title}: {expr} never above 0 during the load ({peak})")
        assert not failures, "\n".join(failures)
    finally:
        stop.set()
        loader.join(120)

    # the dashboard's `model` variable: label_values(qwen_serve:num_requests_running, model_name)
    r = httpx.get(
        api + "/api/v1/label/model_name/values",
        params={"match[]": "qwen_serve:num_requests_running"},
        timeout=10,
    )
    assert r.json()["data"] == [MODEL]
    assert Path(DASHBOARD).is_file()
