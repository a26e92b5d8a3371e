"""Where the time to first token goes outside the engine: one request at a time, timestamped.

Usage: ``python bench/frontend_latency.py [--requests 20] [--prompt-tokens 1024] [--max-tokens 1]
[-- server flags...]`` (e.g. ``-- --engine-mode process``). Runs the real server in this process
(the app, uvicorn configured as ``python -m server`` does, the embedded model unless
``--model`` is given) with timing probes patched around its stages, and a plain blocking HTTP
client (``http.client``) in a second process that sends streamed chat requests one after the
other. Every timestamp is ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for all
processes), so client, server and engine-process stamps compare directly.

Stages of one request (milliseconds, median and p90 over the measured requests):

- client send -> ASGI app called: the request crossing the socket and uvicorn's HTTP parsing
- ASGI -> handler: body read, routing, pydantic validation, the API-key dependency
- template, tokenize: ``render_prompt`` and ``ServerContext.encode_prompt``
- to engine core: sampling params, ``Generation``, limits check, the command handed to the core
- core wake-up: until the engine loop holds the command (thread inbox or process pipe)
- ENGINE: from the engine loop holding the command to the engine emitting the first token
  (scheduling, the model steps, output processing; large on the CPU: reported apart)
- back to the server: the step's outputs reaching the HTTP process's reader (pipe) ...
- ... and the event loop (``call_soon_threadsafe`` -> ``AsyncEngine._dispatch``)
- to SSE chunk: the request stream, detokenization, the chunk's JSON
- chunk written: Starlette/uvicorn handing the chunk to the socket
- client read: the chunk crossing the socket and the client parsing it

This is a measuring tool: the probes wrap functions from outside and change no behaviour.
"""

from __future__ import annotations

import argparse
import contextvars
import http.client
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.core.commands import AddRequest  # noqa: E402 - after the path insert

clock = time.perf_counter

#: API request id -> {stage label: perf_counter seconds} (first occurrence of each label)
EVENTS: dict[str, dict[str, float]] = {}
_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("trace", default=None)
_TRACE_FILE_ENV = "QWEN_SERVE_TRACE_FILE"


def _api_id(engine_request_id: str) -> str:
    """``chatcmpl-xxx-0`` (the engine request of choice 0) -> ``chatcmpl-xxx``."""
    return engine_request_id.rsplit("-", 1)[0]


def _mark(rid: str, label: str, t: float | None = None) -> None:
    EVENTS.setdefault(rid, {}).setdefault(label, clock() if t is None else t)


# ------------------------------------------------------------------ engine-loop probes
def _traced_engine_loop(run_engine_loop, trace_file: str | None = None):
    """Wrap ``run_engine_loop`` so that it stamps commands received, first-token steps and emits.

    With ``trace_file`` (the engine process), the stamps are written there as JSON when the loop
    ends; in a thread core they go straight into :data:`EVENTS`.
    """

    def traced(engine, next_commands, emit, log_interval=10.0):
        seen: set[str] = set()
        step = engine.step

        def next_cmds(timeout):
            commands = next_commands(timeout)
            t = clock()
            for c in commands:
                if isinstance(c, AddRequest):
                    _mark(_api_id(c.request_id), "engine_got", t)
            return commands

        def traced_step():
            t0 = clock()
            outputs, stats = step()
            t1 = clock()
            for o in outputs:
                if o.new_token_ids and o.request_id not in seen:
                    _mark(_api_id(o.request_id), "engine_step_start", t0)
                    _mark(_api_id(o.request_id), "engine_step_end", t1)
            return outputs, stats

        def traced_emit(outputs, stats):
            t = clock()
            for o in outputs:
                if o.new_token_ids and o.request_id not in seen:
                    seen.add(o.request_id)
                    _mark(_api_id(o.request_id), "engine_emitted", t)
            emit(outputs, stats)

        engine.step = traced_step
        try:
            return run_engine_loop(engine, next_cmds, traced_emit, log_interval)
        finally:
            engine.step = step
            if trace_file:
                Path(trace_file).write_text(json.dumps(EVENTS))

    return traced


def _traced_child_main(*args) -> None:
    """The engine process's entry point with the engine-loop probes installed."""
    import engine.frontend.process_core as ep

    ep.run_engine_loop = _traced_engine_loop(ep.run_engine_loop, os.environ[_TRACE_FILE_ENV])
    ep._child_main(*args)


# ------------------------------------------------------------------ server probes
def install_engine_probes() -> None:
    """Probe the engine loop: of the thread core in this process (``core_client``), or of the
    engine process (its entry point, looked up when the process core starts: install before
    building it)."""
    import engine.frontend.core_client as cc
    import engine.frontend.process_core as ep

    cc.run_engine_loop = _traced_engine_loop(cc.run_engine_loop)
    ep._child_main = _traced_child_main


def install_probes(ctx) -> None:
    """Patch timing probes around the stages of the server (see the module docstring)."""
    from server import chat

    render = chat.render_prompt

    def render_prompt(tokenizer, req):
        rec = _CURRENT.get()
        rec["handler"] = clock()
        out = render(tokenizer, req)
        rec["rendered"] = clock()
        return out

    chat.render_prompt = render_prompt
    encode = ctx.encode_prompt

    def traced_encode(text, *args, **kwargs):
        ids = encode(text, *args, **kwargs)
        rec = _CURRENT.get()
        if rec is not None:
            rec.setdefault("tokenized", clock())
        return ids

    ctx.encode_prompt = traced_encode
    core = ctx.engine.core
    send = core.send

    def traced_send(command):
        send(command)
        rec = _CURRENT.get()
        if isinstance(command, AddRequest) and rec is not None:
            rec.setdefault("sent", clock())
            rec["rid"] = _api_id(command.request_id)

    core.send = traced_send
    engine = ctx.engine
    emit, dispatch = engine._emit, engine._dispatch

    def traced_emit(outputs, stats):  # the reader thread (process core) or the engine thread
        t = clock()
        for o in outputs:
            if o.new_token_ids:
                _mark(_api_id(o.request_id), "reader_got", t)
        emit(outputs, stats)

    def traced_dispatch(outputs, stats):  # on the event loop
        t = clock()
        for o in outputs:
            if o.new_token_ids:
                _mark(_api_id(o.request_id), "dispatched", t)
        dispatch(outputs, stats)

    engine._emit, engine._dispatch = traced_emit, traced_dispatch


def traced_asgi(app):
    """ASGI wrapper: stamps the call, binds the request's record, stamps the first content chunk."""

    async def wrapper(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        rec = {"asgi": clock()}
        _CURRENT.set(rec)

        async def traced_send(message):
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            content = b'"content":"' in body and b'"content":""' not in body
            if content and "chunk_yielded" not in rec:
                rec["chunk_yielded"] = clock()
            await send(message)
            if content and "written" not in rec:
                rec["written"] = clock()

        try:
            await app(scope, receive, traced_send)
        finally:
            if "rid" in rec:
                EVENTS.setdefault(rec.pop("rid"), {}).update(rec)

    return wrapper


# ------------------------------------------------------------------ client (second process)
def _client(
    port: int, model: str, prompts: list[str], max_tokens: int, warmup: int, gap: float, results
) -> None:
    """Send streamed chat requests one at a time; put ``[(id, t_send, t_first_content), ...]``."""
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    out = []
    for i, prompt in enumerate(prompts):
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        time.sleep(gap)  # let the engine go idle (and torch's CPU threads stop spinning)
        t_send = clock()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        rid, t_first = None, None
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id")
            if t_first is None and any(
                ch.get("delta", {}).get("content") for ch in chunk.get("choices", [])
            ):
                t_first = clock()
        if i >= warmup and t_first is not None:
            out.append((rid, t_send, t_first))
    results.put(out)


# ------------------------------------------------------------------ report
#: (stage name, from label, to label)
STAGES = [
    ("client send -> ASGI app", "client_send", "asgi"),
    ("ASGI -> handler (body, routing, pydantic)", "asgi", "handler"),
    ("chat template", "handler", "rendered"),
    ("tokenize", "rendered", "tokenized"),
    ("params, Generation, command to core", "tokenized", "sent"),
    ("core wake-up (inbox or pipe)", "sent", "engine_got"),
    ("ENGINE: command held -> first token emitted", "engine_got", "engine_emitted"),
    ("  of which the first-token step", "engine_step_start", "engine_step_end"),
    (
        "emit -> server side (pipe and reader thread; 0 in a thread core)",
        "engine_emitted",
        "reader_got",
    ),
    ("reader -> event loop (_dispatch)", "reader_got", "dispatched"),
    ("dispatch -> SSE chunk (detokenize, JSON)", "dispatched", "chunk_yielded"),
    ("chunk written (Starlette, uvicorn)", "chunk_yielded", "written"),
    ("socket -> client parsed the chunk", "written", "client_first"),
    ("TTFT (client)", "client_send", "client_first"),
]


def report(records: list[dict]) -> dict:
    """Median / p90 per stage in ms, and the TTFT without the engine part."""
    rows = {}
    for name, a, b in STAGES:
        xs = sorted(1e3 * (r[b] - r[a]) for r in records if a in r and b in r)
        if xs:
            rows[name] = {
                "median": statistics.median(xs),
                "p90": xs[int(0.9 * (len(xs) - 1))],
                "n": len(xs),
            }
    outside = sorted(
        1e3 * ((r["client_first"] - r["client_send"]) - (r["engine_emitted"] - r["engine_got"]))
        for r in records
        if {"client_first", "engine_emitted", "engine_got"} <= r.keys()
    )
    if outside:
        rows["TTFT minus ENGINE"] = {
            "median": statistics.median(outside),
            "p90": outside[int(0.9 * (len(outside) - 1))],
            "n": len(outside),
        }
    print("\n| stage | median ms | p90 ms |\n|---|---|---|")
    for name, v in rows.items():
        print(f"| {name} | {v['median']:.3f} | {v['p90']:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="measured requests")
    ap.add_argument("--warmup", type=int, default=3, help="requests sent first and not measured")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=1,
        help="1: no decode step runs while the first chunk is handled",
    )
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between requests")
    ap.add_argument(
        "--tokenizers-encode",
        action="store_true",
        help=(
            "encode prompts with tokenizers instead of the server's PromptEncoder (for comparison)"
        ),
    )
    ap.add_argument("--json", default=None, help="write the per-request stamps and the table here")
    ap.add_argument(
        "server_args", nargs=argparse.REMAINDER, help="after --: flags of python -m server"
    )
    args = ap.parse_args()
    assert "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation, (
        "stamps must share one clock"
    )

    import logging

    from bench.serve import make_prompts
    from server.__main__ import build_parser
    from server.app import create_app
    from server.factory import build_context
    from server.http_server import make_server

    flags = [a for a in args.server_args if a != "--"]
    sargs = build_parser().parse_args(["--port", str(args.port), "--log-level", "warning", *flags])
    logging.basicConfig(level=logging.WARNING)
    trace_file = f"/tmp/qwen-serve-trace-{os.getpid()}.json"
    os.environ[_TRACE_FILE_ENV] = trace_file
    install_engine_probes()
    ctx = build_context(sargs)
    if args.tokenizers_encode:
        ctx.encoder = None
    install_probes(ctx)
    server = make_server(traced_asgi(create_app(ctx)), sargs)

    mpc = mp.get_context("spawn")
    results = mpc.Queue()
    prompts = make_prompts(str(ctx.tokenizer.path), args.warmup + args.requests, args.prompt_tokens)
    client = mpc.Process(
        target=_client,
        args=(args.port, ctx.model_name, prompts, args.max_tokens, args.warmup, args.gap, results),
    )
    client.start()
    got: list = []

    def stop_when_done():
        got.extend(results.get())
        server.should_exit = True

    threading.Thread(target=stop_when_done, daemon=True).start()
    server.run()
    client.join(30)
    if os.path.exists(trace_file):  # the engine process's stamps
        for rid, marks in json.loads(Path(trace_file).read_text()).items():
            for k, v in marks.items():
                _mark(rid, k, v)
        os.unlink(trace_file)
    records = []
    for rid, t_send, t_first in got:
        r = dict(EVENTS.get(rid, {}), client_send=t_send, client_first=t_first)
        records.append(r)
    encoder = ctx.encoder.backend if ctx.encoder is not None else "tokenizers"
    print(
        f"engine mode: {ctx.engine.core.__class__.__name__}, prompt encoder: {encoder}, "
        f"{len(records)} requests, "
        f"prompt ~{args.prompt_tokens} tokens, server flags: {' '.join(flags) or '(defaults)'}"
    )
    rows = report(records)
    if args.json:
        Path(args.json).write_text(json.dumps({"stages": rows, "records": records}, indent=1))


if __name__ == "__main__":
    main()
