"""CORS (--allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials): off by
default; when on, preflights are answered before the API key is asked for, the app's responses
(a 401 included) carry the headers for an allowed origin, none for another; the flags parse as
vLLM's JSON lists."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.__main__ import build_parser
from server.app import create_app
from server.context import CorsPolicy, ServerContext

KEY = "k3y"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization",
}


def _app(cors: CorsPolicy, api_key: str | None = KEY):
    """The real app over a context without an engine: the responses asked for here (preflights,
    401s, 404s) never reach one."""
    ctx = ServerContext(
        engine=None, tokenizer=None, model_name="m", metrics=None, api_key=api_key, cors=cors
    )
    return create_app(ctx)


def _send(app, method: str, path: str, headers: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, headers=headers)

    return asyncio.run(go())


def test_any_origin_preflight_passes_the_key_check_and_the_401_carries_the_headers():
    app = _app(CorsPolicy(allowed_origins=("*",)))
    origin = {"Origin": "https://page.example"}
    pre = _send(app, "OPTIONS", "/v1/chat/completions", {**origin, **PREFLIGHT})
    assert pre.status_code == 200, pre.text  # answered before the key is asked for
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = _send(app, "GET", "/v1/models", origin)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["access-control-allow-origin"] == "*"  # the page can read the error


def test_a_listed_origin_only_and_credentials():
    app = _app(CorsPolicy(("https://a.example",), ("POST",), ("authorization",), True))
    pre = _send(app, "OPTIONS", "/v1/completions", {"Origin": "https://a.example", **PREFLIGHT})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "https://a.example"
    assert pre.headers["access-control-allow-credentials"] == "true"
    other = _send(app, "OPTIONS", "/v1/completions", {"Origin": "https://b.example", **PREFLIGHT})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = _send(app, "GET", "/nothing", {"Origin": "https://b.example"})
    assert r.status_code == 404 and "access-control-allow-origin" not in r.headers


def test_the_default_sends_no_cors_headers():
    app = _app(CorsPolicy(), api_key=None)
    r = _send(app, "OPTIONS", "/v1/completions", {"Origin": "https://a.example", **PREFLIGHT})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_flags_and_environment_parse_json_lists(monkeypatch):
    args = build_parser().parse_args([])
    assert args.allowed_origins == [] and args.allowed_methods == ["*"]
    assert args.allowed_headers == ["*"] and args.allow_credentials is False
    args = build_parser().parse_args(["--allowed-origins", '["https://a.example"]'])
    assert args.allowed_origins == ["https://a.example"]
    monkeypatch.setenv("QWEN_SERVE_ALLOWED_METHODS", '["GET", "POST"]')
    monkeypatch.setenv("QWEN_SERVE_ALLOW_CREDENTIALS", "1")
    args = build_parser().parse_args([])
    assert args.allowed_methods == ["GET", "POST"] and args.allow_credentials is True
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--allowed-origins", bad])
    # credentials with any origin: Starlette would echo every origin back with credentials
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", '["*"]', "--allow-credentials"])
    args = build_parser().parse_args(["--allowed-origins", '["https://a.example"]'])
    assert args.allow_credentials is True  # from the environment, with a listed origin


def test_the_key_check_sees_the_path_the_router_sees():
    """Under a root path (``--root-path``-style mounting), ``/api/v1/models`` routes to
    ``/v1/models``: the key check must not let it through; a websocket to a protected path is
    refused before its handshake."""
    app = _app(CorsPolicy())

    async def call(scope):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent

    base = {"headers": [], "query_string": b"", "client": ("a", 1), "server": ("b", 2)}
    http = {**base, "type": "http", "method": "GET", "scheme": "http", "http_version": "1.1"}
    for root, path in (("/api", "/api/v1/models"), ("", "/v1/models"), ("/api", "/api/tokenize")):
        sent = asyncio.run(
            call({**http, "path": path, "raw_path": path.encode(), "root_path": root})
        )
        assert sent[0]["status"] == 401, (root, path)
    ws = {**base, "type": "websocket", "path": "/v1/x", "raw_path": b"/v1/x", "root_path": ""}
    assert asyncio.run(call(ws)) == [{"type": "websocket.close", "code": 1008}]
