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

With several API-server processes (``--api-server-count``) each process accounts its own
requests, counters and histograms alike, in prometheus_client's multiprocess files (one set per
process in ``multiprocess_dir``), and every process's ``/metrics`` renders the sum over all of
them (dead processes' files included). A request is accounted wholly by the one process that
served it, so the summed token counters still equal the summed histograms' ``_sum``: the
invariant holds per process and therefore for the aggregate, whichever process is scraped.
Only API server 0 receives the engine's step stats; the step gauges take the most recently set
value of any process (in effect API server 0's), the step counters and ``iteration_tokens_total``
are summed (the other processes add zero).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

from engine.core.stats import RequestStats, StepStats

PREFIX = "qwen_serve:"
#: the environment variable prometheus_client reads at import to choose its multiprocess values
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: multiprocess aggregation of every gauge: the value most recently set by any process, no pid
#: label (the step gauges are set by API server 0 alone, the rank gauges identically by all)
GAUGE_MODE = "mostrecent"
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


def check_multiprocess_dir(path: str) -> None:
    """Check that this process writes prometheus_client's multiprocess files into ``path``.

    prometheus_client chooses its value class once, at import: mmap files in
    ``$PROMETHEUS_MULTIPROC_DIR`` when the variable is set then, process-local floats otherwise.
    The launcher therefore sets the variable before it starts the API-server processes.

    Raises:
        ValueError: ``path`` is not a directory; prometheus_client was imported without
            ``PROMETHEUS_MULTIPROC_DIR`` (its metrics would be process-local); or the variable
            now names another directory (the files would go there, not to ``path``).
    """
    if not os.path.isdir(path):
        raise ValueError(f"metrics multiprocess_dir {path!r} is not a directory")
    env = os.environ.get(MULTIPROC_ENV)
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise ValueError(
            f"metrics multiprocess_dir {path!r} needs {MULTIPROC_ENV}={path} in the process "
            f"environment before prometheus_client is imported; this process imported it "
            f"without ({MULTIPROC_ENV}={env!r} now), so its metrics are process-local"
        )
    if env is None or os.path.realpath(env) != os.path.realpath(path):
        raise ValueError(
            f"metrics multiprocess_dir {path!r} differs from {MULTIPROC_ENV}={env!r}, where "
            f"prometheus_client writes this process's metric files"
        )


class ServerMetrics:
    """All metrics of one server, labelled with ``model_name``.

    Single-process (``multiprocess_dir`` None): a private registry holds every metric, the
    ``process_*`` metrics of this process (ProcessCollector) and the info metric.

    Multiprocess (``multiprocess_dir`` set, one ServerMetrics per API-server process): counter,
    histogram and gauge values live in prometheus_client's per-process mmap files in that
    directory, and :meth:`render` shows the aggregate of every process that ever wrote there,
    whichever process renders it. Counters and histograms are summed over the processes;
    gauges use ``multiprocess_mode="mostrecent"``: the value most recently *set* by any process,
    without a pid label. The step gauges are set only by the process that gets the engine's step
    stats (API server 0); until its first step they have no sample (a process that never set a
    gauge holds it with timestamp 0, which "mostrecent" never picks). The rank gauges are set
    identically by every process. The info metric, which the multiprocess collector does not
    support, stays in this process's registry (every process has the same one), so it is
    rendered exactly once. There are no ``process_*`` metrics: they describe one process (its
    CPU time, memory, file descriptors) and cannot be summed into one meaningful series (vLLM
    leaves them out too). A dead process's files keep counting (its requests happened), and no
    mode here is a ``live*`` one, so the launcher has nothing to clean up per exited process
    (``prometheus_client.multiprocess.mark_process_dead`` only deletes ``live*`` gauge files);
    it must, however, give a fresh, empty directory to each server run: stale files of an
    earlier run would be added to the sums.

    Args:
        model_name: the served model id.
        info: static facts for the info metric (model, dtype, block_size, num_kv_blocks,
            max_model_len, tensor_parallel_size).
        ranks: the engine's layout (``EngineLimits.ranks``): one sample per rank of
            ``rank_weight_bytes`` and ``rank_kv_cache_bytes``, labelled with the rank, its
            device and host (a single-device engine has rank 0).
        multiprocess_dir: the ``PROMETHEUS_MULTIPROC_DIR`` shared by the API-server processes
            (None: single-process).

    Raises:
        ValueError: ``multiprocess_dir`` given but this process does not write its metrics
            there (:func:`check_multiprocess_dir`).
    """

    def __init__(
        self,
        model_name: str,
        info: dict[str, str],
        ranks: tuple = (),
        multiprocess_dir: str | None = None,
    ):
        if multiprocess_dir is None:
            self.registry = reg = info_reg = CollectorRegistry()
            ProcessCollector(registry=reg)
        else:
            check_multiprocess_dir(multiprocess_dir)
            # the metrics' own registry only catches name clashes: their values are rendered
            # from the files (this process's among them) by the collector, so never from here
            reg = CollectorRegistry()
            self.registry = info_reg = CollectorRegistry()
            MultiProcessCollector(info_reg, path=multiprocess_dir)
        self.multiprocess_dir = multiprocess_dir
        labels = ["model_name"]
        self._label = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(
                PREFIX + name, doc, labels, registry=reg, multiprocess_mode=GAUGE_MODE
            ).labels(**self._label)

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
            multiprocess_mode=GAUGE_MODE,
        )
        kv = Gauge(
            PREFIX + "rank_kv_cache_bytes",
            "Bytes of the KV cache of one tensor-parallel rank (its KV heads).",
            rank_labels,
            registry=reg,
            multiprocess_mode=GAUGE_MODE,
        )
        for r in ranks:
            where = {"rank": str(r.rank), "device": r.device, "host": r.host, **self._label}
            weights.labels(**where).set(r.weight_bytes)
            kv.labels(**where).set(r.kv_cache_bytes)
        Info(PREFIX + "model", "Served model and cache configuration.", registry=info_reg).info(
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
        """The Prometheus text exposition: this process's metrics, or in multiprocess mode the
        aggregate over every API-server process and this process's info metric."""
        return generate_latest(self.registry)
