"""OpenAI-shaped error bodies and the exception handlers that produce them."""

from __future__ import annotations

import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.frontend.async_engine import EngineUnavailable
from server.protocol import json_kind

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def rejected(exc, param: str) -> APIError:
    """A 400 for an engine ``RequestRejected``, with OpenAI's code for a too-long prompt."""
    code = "context_length_exceeded" if exc.reason == "too_long" else "invalid_value"
    return APIError(400, str(exc), param, code)


def body_parse_error(exc: BaseException | None) -> APIError:
    """The 400 for a request body that ``json.loads`` failed on with ``exc`` other than a
    ``JSONDecodeError``: bytes that are not UTF-8 (``UnicodeDecodeError``, code invalid_text),
    JSON nested deeper than the parser's recursion limit (``RecursionError``), an integer
    literal longer than Python converts (``ValueError``, more than
    ``sys.get_int_max_str_digits()`` digits), or another failure (all code json_invalid)."""
    if isinstance(exc, UnicodeError):
        return APIError(400, "the request body is not valid UTF-8 JSON", None, "invalid_text")
    if isinstance(exc, RecursionError):
        return APIError(400, "the request body's JSON is nested too deeply", None, "json_invalid")
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return APIError(
            400,
            "the request body's JSON has an integer literal too long to parse "
            f"(more than {sys.get_int_max_str_digits()} digits)",
            None,
            "json_invalid",
        )
    return APIError(400, "the request body could not be parsed as JSON", None, "json_invalid")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI returns it. Text that is
    not valid Unicode (a lone surrogate from the request, quoted in a message or a parameter
    path) is written as a backslash escape, so the body can always be encoded."""
    return {
        "error": {
            "message": _printable(message),
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": _printable(param),
            "code": _printable(code),
        }
    }


def _printable(text: str | None) -> str | None:
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop pydantic's union-branch tags ("str", "list[TextPart]", ...) but keep indices and names
    kept = [
        p
        for p in parts
        if not any(c in p for c in "[]")
        and p not in ("str", "int", "float", "bool", "function-after")
    ]
    return ".".join(kept) or None


def install_error_handlers(app: FastAPI) -> None:
    """Map validation errors to 400 (never FastAPI's 422) and every error to an OpenAI body."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param_of(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        code = first.get("type")
        if first.get("type") == "json_invalid":
            msg, param = "the request body is not valid JSON", None
        elif first.get("type") == "model_attributes_type" and param is None:
            code = "invalid_type"
            content_type = request.headers.get("content-type", "")
            if "json" in content_type.split(";")[0].lower():
                msg = f"the request body must be a JSON object, got {json_kind(first.get('input'))}"
            else:
                msg = (
                    "the request body must be a JSON object "
                    "(send it with Content-Type: application/json)"
                )
        elif first.get("type") == "extra_forbidden" and param and "." not in param:
            # OpenAI's wording; the field is never silently dropped (server.protocol)
            msg, code = f"Unrecognized request argument supplied: {param}", "unrecognized_argument"
        elif first.get("type") == "missing" and param is None:
            msg = "the request body is empty; send a JSON object"
        elif first.get("type") == "missing":
            msg = f"missing required parameter '{param}'"
        else:
            msg = msg.removeprefix("Value error, ")
            msg = f"invalid value for '{param}': {msg}" if param else msg
        return error_response(400, msg, param, code)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, exc: EngineUnavailable):
        # engine_unavailable, or server_shutting_down (ServerShuttingDown: a request that
        # arrived after the in-flight ones were ended)
        return error_response(503, str(exc), None, exc.code)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body json.loads failed on other than with a JSONDecodeError
            # (that one is a RequestValidationError): it raises this exception from the error
            err = body_parse_error(exc.__cause__ or exc.__context__)
            return error_response(err.status, err.message, err.param, err.code)
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
