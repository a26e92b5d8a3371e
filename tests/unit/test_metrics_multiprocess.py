"""ServerMetrics with several API-server processes (prometheus_client's multiprocess mode): every
process renders one exact aggregate. Two spawned "API servers" record random requests (server 0
also the engine's steps), each renders the aggregate, and a third process renders it again after
both exited; the parent checks the sums against what the children report they recorded."""

from __future__ import annotations

import multiprocessing
import os
import random
from collections import Counter

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from engine.core.layout import RankLayout
from engine.core.stats import RequestStats, StepStats
from server.metrics import FINISH_REASONS, MULTIPROC_ENV, ServerMetrics

P = "qwen_serve:"
MODEL = "tiny"
INFO = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 64}
RANKS = (
    RankLayout(0, "cuda:0", "hostA", 11, 1000, 2000, 2),
    RankLayout(1, "cuda:1", "hostA", 12, 1001, 2001, 2),
)
STEP_GAUGES = {
    "num_requests_running": "num_running",
    "num_requests_waiting": "num_waiting",
    "kv_cache_usage_perc": "kv_usage",
    "num_free_kv_blocks": "num_free_blocks",
    "gpu_memory_allocated_bytes": "gpu_memory_allocated",
    "gpu_memory_reserved_bytes": "gpu_memory_reserved",
    "gpu_memory_total_bytes": "gpu_memory_total",
}
TIMEOUT = 60


def _record(metrics: ServerMetrics, rng: random.Random, steps: bool) -> dict:
    """Random requests (and with ``steps`` random engine steps) into ``metrics``, the way the
    front end feeds it; returns what was recorded."""
    rec = {"prompt": 0, "generation": 0, "reasons": Counter(), "ttft": 0, "itl": 0}
    for i in range(rng.randint(5, 40)):
        prompt, gen = rng.randint(1, 5000), rng.randint(0, 700)
        metrics.count_tokens(prompt, 0)
        left = gen
        while left:  # delivered in stream chunks
            chunk = rng.randint(1, left)
            metrics.count_tokens(0, chunk)
            left -= chunk
        reason = rng.choice(FINISH_REASONS)
        early = reason == "abort" and rng.random() < 0.5  # aborted before the first token
        itls = [rng.uniform(0.001, 0.2) for _ in range(min(max(gen - 1, 0), 15))]
        metrics.on_request_finished(
            RequestStats(
                request_id=f"r{i}",
                finish_reason=reason,
                num_prompt_tokens=prompt,
                num_generation_tokens=gen,
                num_cached_tokens=rng.randint(0, prompt),
                queue_time=None if early else rng.uniform(0, 2),
                ttft=None if early else rng.uniform(0.001, 5),
                e2e_latency=rng.uniform(0.01, 60),
            ),
            itls,
        )
        rec["prompt"] += prompt
        rec["generation"] += gen
        rec["reasons"][reason] += 1
        rec["ttft"] += not early
        rec["itl"] += len(itls)
    rec["iterations"] = rec["preemptions"] = rec["prefix_queries"] = rec["prefix_hits"] = 0
    rec["last_step"] = None
    for _ in range(rng.randint(3, 12) if steps else 0):
        blocks = 64
        free = rng.randint(0, blocks)
        idle = rng.random() < 0.2  # a step that computed nothing: no iteration_tokens sample
        s = StepStats(
            num_running=rng.randint(0, 50),
            num_waiting=rng.randint(0, 50),
            num_free_blocks=free,
            num_blocks=blocks,
            kv_usage=(blocks - free) / blocks,
            num_prompt_tokens=0 if idle else rng.randint(0, 2048),
            num_generation_tokens=0 if idle else rng.randint(1, 64),
            num_preemptions=rng.randint(0, 3),
            prefix_queries=rng.randint(0, 500),
            prefix_hits=rng.randint(0, 100),
            step_seconds=rng.uniform(0.001, 0.1),
            gpu_memory_allocated=rng.randint(1, 1 << 40),
            gpu_memory_reserved=rng.randint(1, 1 << 40),
            gpu_memory_total=rng.randint(1, 1 << 40),
        )
        metrics.on_step(s)
        rec["iterations"] += not idle
        rec["preemptions"] += s.num_preemptions
        rec["prefix_queries"] += s.prefix_queries
        rec["prefix_hits"] += s.prefix_hits
        rec["last_step"] = {g: float(getattr(s, f)) for g, f in STEP_GAUGES.items()}
    return rec


def api_server(index: int, seed: int, path: str, barrier, results) -> None:
    """Child process: one API server's ServerMetrics in ``path``; records, waits until every
    server has recorded, then renders the aggregate. Puts ``(index, recorded, text)``."""
    assert values.ValueClass._multiprocess, "spawned without " + MULTIPROC_ENV
    metrics = ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=path)
    rec = _record(metrics, random.Random(seed), steps=index == 0)
    barrier.wait(TIMEOUT)
    results.put((index, rec, metrics.render().decode()))


def scraper(path: str, results) -> None:
    """Child process: a server that recorded nothing renders the aggregate."""
    results.put(("scraper", None, ServerMetrics(MODEL, INFO, RANKS, path).render().decode()))


def _run(ctx, target, args, n_results: int, results) -> list:
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        out = [results.get(timeout=TIMEOUT) for _ in range(n_results)]
    finally:
        for p in procs:
            p.join(TIMEOUT)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return out


def _samples(text: str) -> dict[tuple, float]:
    """``(sample name, sorted labels without model_name)`` -> value; fails on a repeated
    series."""
    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name", MODEL) == MODEL
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"series {key} twice"
            out[key] = s.value
    return out


def _type_lines(text: str) -> Counter:
    return Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))


def test_aggregate_over_api_servers_is_exact(tmp_path, monkeypatch):
    seed = random.SystemRandom().randrange(1 << 30)
    path = str(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    # the children import prometheus_client with the variable set (this process did without)
    monkeypatch.setenv(MULTIPROC_ENV, path)
    results = ctx.Queue()
    barrier = ctx.Barrier(2)
    served = _run(
        ctx, api_server, [(i, seed + i, path, barrier, results) for i in (0, 1)], 2, results
    )
    after = _run(ctx, scraper, [(path, results)], 1, results)
    recs = {i: rec for i, rec, _ in served}
    texts = [text for _, _, text in served + after]
    assert len(os.listdir(path)) == 3 * 3, "counter, histogram, gauge file per process"

    m = _samples(texts[0])
    msg = f"seed {seed}"
    # any process renders the same aggregate, also once the recording servers have exited
    for text in texts[1:]:
        assert _samples(text) == m, msg
    for text in texts:
        types = _type_lines(text)
        assert max(types.values()) == 1, f"a metric family twice: {types}"
        assert not any(name.startswith("process_") for name in types), "process_* aggregated"
    assert not any("pid" in dict(labels) for _, labels in m), "a pid label in the aggregate"

    def value(name: str, **labels) -> float:
        return m[(P + name, tuple(sorted(labels.items())))]

    # the token counters: the sums of what both servers counted and of their histograms
    prompt = sum(r["prompt"] for r in recs.values())
    generation = sum(r["generation"] for r in recs.values())
    assert value("prompt_tokens_total") == prompt == value("request_prompt_tokens_sum"), msg
    assert value("generation_tokens_total") == generation, msg
    assert value("request_generation_tokens_sum") == generation, msg
    n_requests = sum(sum(r["reasons"].values()) for r in recs.values())
    assert value("request_prompt_tokens_count") == n_requests, msg
    assert value("e2e_request_latency_seconds_count") == n_requests, msg
    for reason in FINISH_REASONS:
        expected = sum(r["reasons"][reason] for r in recs.values())
        assert value("request_success_total", finished_reason=reason) == expected, msg
    ttft = sum(r["ttft"] for r in recs.values())
    assert value("time_to_first_token_seconds_count") == ttft, msg
    assert value("time_to_first_token_seconds_bucket", le="+Inf") == ttft, msg
    assert value("request_queue_time_seconds_count") == ttft, msg
    assert value("inter_token_latency_seconds_count") == sum(r["itl"] for r in recs.values())

    # the engine's steps reached server 0 only: its last gauges, its step counters
    steps = recs[0]
    assert recs[1]["last_step"] is None and steps["last_step"] is not None
    for gauge, expected in steps["last_step"].items():
        series = [k for k in m if k[0] == P + gauge]
        assert series == [(P + gauge, ())], f"{gauge}: {series}"
        assert value(gauge) == expected, f"{gauge} ({msg})"
    assert value("iteration_tokens_total_count") == steps["iterations"], msg
    assert value("num_preemptions_total") == steps["preemptions"], msg
    assert value("prefix_cache_queries_total") == steps["prefix_queries"], msg
    assert value("prefix_cache_hits_total") == steps["prefix_hits"], msg

    # static metrics: the rank gauges once per rank, the info metric once
    for gauge, field in (
        ("rank_weight_bytes", "weight_bytes"),
        ("rank_kv_cache_bytes", "kv_cache_bytes"),
    ):
        series = {dict(lab)["rank"]: v for (name, lab), v in m.items() if name == P + gauge}
        assert series == {str(r.rank): float(getattr(r, field)) for r in RANKS}, gauge
    info = [labels for name, labels in m if name == P + "model_info"]
    assert info == [tuple(sorted({k: str(v) for k, v in INFO.items()}.items()))]
    for text in texts:
        assert text.count(f"# HELP {P}model_info ") == 1

    # the families of single-process mode, less the per-process ones (process_*, *_created)
    single = _type_lines(ServerMetrics(MODEL, INFO, RANKS).render().decode())
    assert set(_type_lines(texts[0])) == {
        n for n in single if not n.startswith("process_") and not n.endswith("_created")
    }


def test_multiprocess_dir_needs_the_variable_at_import(tmp_path, monkeypatch):
    # this process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR
    assert not values.ValueClass._multiprocess
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    with pytest.raises(ValueError, match="before prometheus_client is imported"):
        ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=str(tmp_path))
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))  # set too late: the values are local
    with pytest.raises(ValueError, match="before prometheus_client is imported"):
        ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=str(tmp_path / "missing"))
    assert os.listdir(tmp_path) == []


def test_multiprocess_dir_must_be_the_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv(MULTIPROC_ENV, str(other))
    with pytest.raises(ValueError, match="differs from"):
        ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=str(tmp_path))
    monkeypatch.delenv(MULTIPROC_ENV)
    with pytest.raises(ValueError, match="differs from"):
        ServerMetrics(MODEL, INFO, RANKS, multiprocess_dir=str(tmp_path))
    assert os.listdir(other) == []


def test_single_process_keeps_its_process_metrics_and_zero_gauges():
    m = ServerMetrics(MODEL, INFO, RANKS)
    text = m.render().decode()
    types = _type_lines(text)
    assert max(types.values()) == 1
    assert "process_cpu_seconds_total" in types
    s = _samples(text)
    for gauge in STEP_GAUGES:
        assert s[(P + gauge, ())] == 0.0  # present before any step, unlike multiprocess mode
    assert [labels for name, labels in s if name == P + "model_info"] == [
        tuple(sorted({k: str(v) for k, v in INFO.items()}.items()))
    ]
