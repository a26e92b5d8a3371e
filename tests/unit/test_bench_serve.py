"""bench/serve.py's client: SSE splitting across reads, vllm-style TTFT/ITL per chunk, work
split."""

from __future__ import annotations

import asyncio
import json

from bench import serve


def _chunk(delta: dict | None, finish=None, usage=None) -> bytes:
    body = {
        "id": "c",
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_sse_events_joins_an_event_cut_across_reads():
    data = _chunk({"content": "a"}) + _chunk({"content": "b"}) + b"data: [DONE]\n\n"
    cut = len(_chunk({"content": "a"})) + 7
    first, rest = serve.sse_events(b"", data[:cut])
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in first] == ["a"]
    second, rest = serve.sse_events(rest, data[cut:])
    assert json.loads(second[0])["choices"][0]["delta"]["content"] == "b" and second[1] == b"[DONE]"
    assert rest == b""


class _ScriptedClient:
    """Stands in for serve._Stream: yields byte reads, advancing a fake perf_counter per read."""

    def __init__(self, reads: list[tuple[float, bytes]], clock: list[float]):
        self.reads, self.clock = reads, clock

    async def post(self, url, body):
        for t, data in self.reads:
            self.clock[0] = t
            yield data


def test_one_request_times_chunks_as_vllm_bench_serve(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(serve.time, "perf_counter", lambda: clock[0])
    reads = [
        (
            0.010,
            _chunk({"role": "assistant", "content": ""}),
        ),  # sent before the engine ran: not TTFT
        (0.050, _chunk({"content": "Hel"})),  # first content: TTFT 50 ms
        (
            0.060,
            _chunk({"content": "lo"}) + _chunk({"content": " w"}),
        ),  # one read, two chunks: 10 ms, 0 ms
        (0.075, _chunk({"content": "orld"})),  # 15 ms
        (0.076, _chunk({}, finish="length")),  # the finish chunk is a chunk too: 1 ms
        (0.080, _chunk(None, usage={"completion_tokens": 5}) + b"data: [DONE]\n\n"),
    ]
    r = asyncio.run(serve.one_request(_ScriptedClient(reads, clock), "u", "m", "p", 5))
    assert r["ok"] and r["n_out"] == 5 and r["n_chunks"] == 5
    assert abs(r["ttft"] - 0.050) < 1e-9
    assert [round(x, 6) for x in r["itls"]] == [0.010, 0.0, 0.015, 0.001]
    assert abs(r["tpot"] - (0.076 - 0.050) / 4) < 1e-9
    assert abs(r["e2e"] - 0.080) < 1e-9


def test_one_request_without_content_fails():
    clock = [0.0]
    reads = [(0.01, _chunk({"role": "assistant", "content": ""}) + b"data: [DONE]\n\n")]
    r = asyncio.run(serve.one_request(_ScriptedClient(reads, clock), "u", "m", "p", 5))
    assert r == {"ok": False, "error": "no tokens"}


def test_split_shares():
    assert serve.split(64, 8) == [8] * 8
    assert serve.split(10, 4) == [3, 3, 2, 2]
    assert sum(serve.split(7, 3)) == 7
