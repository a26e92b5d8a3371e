"""Read the server's /metrics into a dict for assertions."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """Samples keyed by ``name`` or ``name{label=value,...}`` (labels sorted, model_name
    dropped)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            out[key] = s.value
    return out


def total_requests(m: dict[str, float]) -> float:
    """Finished requests over every finish reason."""
    return sum(v for k, v in m.items() if k.startswith("qwen_serve:request_success_total{"))


def num_kv_blocks(m: dict[str, float]) -> int:
    """Total KV blocks from the info metric's label."""
    for k in m:
        if k.startswith("qwen_serve:model_info{"):
            labels = dict(p.split("=", 1) for p in k[k.index("{") + 1 : -1].split(","))
            return int(labels["num_kv_blocks"])
    raise KeyError("qwen_serve:model_info not found")
