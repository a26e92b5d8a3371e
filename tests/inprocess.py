"""The real app in this process, for tests that reach into the live engine (fault injection,
shutdown hooks): an httpx client over the ASGI transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from server.app import create_app
from server.context import ServerContext


@contextlib.asynccontextmanager
async def app_client(ctx: ServerContext, timeout: float = 60.0) -> AsyncIterator[httpx.AsyncClient]:
    """Start ``ctx``'s engine and yield a client of its app (base URL ``http://test``, requests
    time out after ``timeout`` seconds); the engine is shut down on exit, also on an error."""
    app = create_app(ctx)
    ctx.engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=timeout
        ) as client:
            yield client
    finally:
        await ctx.engine.shutdown()
