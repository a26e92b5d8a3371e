"""Prometheus exporter of the engine's plain stats objects (vLLM metric names, own prefix).

The engine never imports prometheus_client; it hands :class:`StepStats` and
:class:`RequestStats` to :class:`ServerMetrics`, which owns a private registry.

Token counters follow vLLM's meaning and agree exactly with the per-request histograms:
``prompt_tokens_total`` counts every prompt token of every engine request (prefix-cache hits
included, once per request whatever its preemptions; a request with ``n`` choices is ``n``
engine requests), ``generation_tokens_total`` every token delivered to a client. Both are
accounted per request by the front end (``server.generation.Generation``), so after any mix of
finished, stopped, length-capped, aborted, preempted and ``n > 1`` requests they equal the sums
of ``request_prompt_tokens`` and ``request_generation_tokens``. The tokens the engine computes
per step (prefill positions actually run, cache hits excluded) are ``iteration_tokens_total``.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)

from engine.core.stats import RequestStats, StepStats

PREFIX = "qwen_serve:"
#: latency buckets from 1 ms to 10 minutes: they fit CPU and GPU speeds alike
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
TOKEN_BUCKETS = (
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
)
# the engine request's finish reason (a tool-call turn ends its engine request with "stop")
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """All metrics of one server, labelled with ``model_name``.

    Args:
        model_name: the served model id.
        info: static facts for the info metric (model, dtype, block_size, num_kv_blocks,
            max_model_len, tensor_parallel_size).
        ranks: the engine's layout (``EngineLimits.ranks``): one sample per rank of
            ``rank_weight_bytes`` and ``rank_kv_cache_bytes``, labelled with the rank, its
            device and host (a single-device engine has rank 0).
    """

    def __init__(self, model_name: str, info: dict[str, str], ranks: tuple = ()):
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        labels = ["model_name"]
        self._label = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(**self._label)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(**self._label)

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(
                **self._label
            )

        self.running = gauge("num_requests_running", "Requests in the running queue.")
        self.waiting = gauge("num_requests_waiting", "Requests in the waiting queue.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.free_blocks = gauge("num_free_kv_blocks", "Free KV-cache blocks.")
        self.gpu_allocated = gauge(
            "gpu_memory_allocated_bytes", "CUDA memory allocated by tensors."
        )
        self.gpu_reserved = gauge(
            "gpu_memory_reserved_bytes", "CUDA memory reserved by the caching allocator."
        )
        self.gpu_total = gauge("gpu_memory_total_bytes", "Total memory of the CUDA device.")
        self.prompt_tokens = counter(
            "prompt_tokens",
            "Prompt tokens of the requests, prefix-cache hits included (vLLM's meaning).",
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated for clients.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recompute).")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(finished_reason=r, **self._label) for r in FINISH_REASONS}
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            LATENCY_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Arrival to first scheduling.", LATENCY_BUCKETS
        )
        self.req_prompt = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_gen = hist(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.iteration_tokens = hist(
            "iteration_tokens_total",
            "Tokens per engine step (prefill positions computed + tokens sampled).",
            TOKEN_BUCKETS,
        )
        rank_labels = labels + ["rank", "device", "host"]
        weights = Gauge(
            PREFIX + "rank_weight_bytes",
            "Bytes of model weights one tensor-parallel rank holds (its shards).",
            rank_labels,
            registry=reg,
        )
        kv = Gauge(
            PREFIX + "rank_kv_cache_bytes",
            "Bytes of the KV cache of one tensor-parallel rank (its KV heads).",
            rank_labels,
            registry=reg,
        )
        for r in ranks:
            where = {"rank": str(r.rank), "device": r.device, "host": r.host, **self._label}
            weights.labels(**where).set(r.weight_bytes)
            kv.labels(**where).set(r.kv_cache_bytes)
        Info(PREFIX + "model", "Served model and cache configuration.", registry=reg).info(
            {"model_name": model_name, **{k: str(v) for k, v in info.items()}}
        )

    def on_step(self, s: StepStats) -> None:
        """Record one engine step."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.free_blocks.set(s.num_free_blocks)
        self.gpu_allocated.set(s.gpu_memory_allocated)
        self.gpu_reserved.set(s.gpu_memory_reserved)
        self.gpu_total.set(s.gpu_memory_total)
        self.preemptions.inc(s.num_preemptions)
        self.prefix_queries.inc(s.prefix_queries)
        self.prefix_hits.inc(s.prefix_hits)
        if s.num_prompt_tokens + s.num_generation_tokens:
            self.iteration_tokens.observe(s.num_prompt_tokens + s.num_generation_tokens)

    def count_tokens(self, prompt: int, generation: int) -> None:
        """Account a request's prompt tokens (once per engine request) and the tokens it
        delivered (see the module docstring)."""
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self.generation_tokens.inc(generation)

    def on_request_finished(self, r: RequestStats, itls: list[float]) -> None:
        """Record one finished engine request and its inter-token gaps."""
        self.success.get(r.finish_reason, self.success["error"]).inc()
        self.e2e.observe(r.e2e_latency)
        self.req_prompt.observe(r.num_prompt_tokens)
        self.req_gen.observe(r.num_generation_tokens)
        if r.ttft is not None:
            self.ttft.observe(r.ttft)
        if r.queue_time is not None:
            self.queue_time.observe(r.queue_time)
        for gap in itls:
            self.itl.observe(gap)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
