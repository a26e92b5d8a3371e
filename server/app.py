"""FastAPI application: routes, CORS, API-key check, body-size limit, lifespan of the engine
loop."""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from server.chat import ChatCompletions
from server.completions import Completions
from server.context import ServerContext
from server.errors import error_response, install_error_handlers
from server.generation import EngineError, engine_api_error
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.tokenize import Tokenization


class BodySizeLimit:
    """ASGI middleware: POST bodies larger than ``max_bytes`` get 413 before any parsing; a
    body within the limit is read whole here, and its size in bytes is left for the handlers in
    the request's state (``request.state.body_bytes``: a large one renders its chat template
    off the event loop, :func:`server.chat.render_prompt_async`)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        messages = []
        if not too_big:
            size = 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return  # the client went away (or was dropped for a slow body): no reply
                messages.append(msg)
                if msg["type"] != "http.request":
                    break
                size += len(msg.get("body", b""))
                if size > self.max_bytes:
                    too_big = True
                    break
                if not msg.get("more_body", False):
                    break
        if too_big:
            resp = error_response(
                413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large"
            )
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["body_bytes"] = size

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        return await self.app(scope, replay, send)


def route_path(scope) -> str:
    """The path the router matches: ``scope["path"]`` without the ``root_path`` prefix the
    server was mounted under (ASGI; Starlette routes on this, so a check of the raw path would
    miss ``/api/v1/...`` served under ``--root-path /api``)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


class APIKeyCheck:
    """ASGI middleware: the bearer key of the protected routes (``/v1/...``, ``/tokenize``,
    ``/detokenize``, and ``/metrics`` with ``protect_metrics``), checked from the headers before
    anything reads or parses the body, so a request without the key gets 401
    ``invalid_api_key`` whatever its body holds (as vLLM's authentication middleware; FastAPI
    dependencies run only after the typed body validated). The key is compared in constant
    time (``hmac.compare_digest``). CORS preflights (``OPTIONS``) carry no credentials and pass.
    """

    def __init__(self, app, api_key: str, protect_metrics: bool):
        self.app, self.key = app, api_key.encode()
        self.protect_metrics = protect_metrics

    def _protected(self, scope) -> bool:
        path = route_path(scope)
        return (
            path.startswith("/v1/")
            or path in ("/v1", "/tokenize", "/detokenize")
            or (self.protect_metrics and path == "/metrics")
        )

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or not self._protected(scope)
        ):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # refused before the handshake (HTTP 403)
            await send({"type": "websocket.close", "code": 1008})
            return
        resp = error_response(
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
        )
        await resp(scope, receive, send)


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that calls ``on_close`` however it ends: finished, failed, or
    cancelled because the client went away (also before the first chunk was sent)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _until_disconnect(raw: Request, coro):
    """Run ``coro``; if the client disconnects first, cancel it (its finally blocks abort the
    engine requests) and return None."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    return None


def create_app(ctx: ServerContext):
    """Build the ASGI application over a ready :class:`ServerContext` (the engine loop starts
    with the app): the FastAPI app inside the body-size limit, the API-key check and CORS
    where configured (so the returned object is not always the FastAPI app itself)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.shutdown()

    app = FastAPI(title="qwen-serve", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.state.ctx = ctx
    chat = ChatCompletions(ctx)
    completions = Completions(ctx)
    tokenization = Tokenization(ctx)

    async def stream_response(gen_iter, aborts) -> StreamingResponse:
        return AbortingStreamingResponse(
            gen_iter,
            aborts,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        gen = await chat.start(req, getattr(raw.state, "body_bytes", 0))
        if req.stream:
            return await stream_response(chat.stream(req, gen), gen.abort)
        try:
            resp = await _until_disconnect(raw, chat.complete(req, gen))
        except EngineError as exc:
            raise engine_api_error(exc) from None
        finally:
            gen.abort()
        return resp if resp is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, raw: Request):
        gens, rid = await completions.start(req)

        def abort_all():
            for g in gens:
                g.abort()

        if req.stream:
            return await stream_response(completions.stream(req, gens, rid), abort_all)
        try:
            resp = await _until_disconnect(raw, completions.complete(req, gens, rid))
        except EngineError as exc:
            raise engine_api_error(exc) from None
        finally:
            abort_all()
        return resp if resp is not None else Response(status_code=499)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.model_name, root=ctx.model_name, max_model_len=ctx.max_model_len)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        ctx.check_model(model_id)  # 404 model_not_found for another id
        return model_card()

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await tokenization.tokenize(raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await tokenization.detokenize(raw)

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
    @app.get("/health")
    async def health():
        if not ctx.engine.is_running:
            return error_response(503, "engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    outer = BodySizeLimit(app, ctx.max_body_bytes) if ctx.max_body_bytes else app
    if ctx.api_key is not None:  # before the body: none is read for a request without the key
        outer = APIKeyCheck(outer, ctx.api_key, ctx.protect_metrics)
    cors = ctx.cors
    if cors.allowed_origins:  # outermost: preflights answered, errors (401 too) carry the headers
        outer = CORSMiddleware(
            outer,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    return outer
