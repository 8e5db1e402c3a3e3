"""Every error leaves the server as OpenAI's error object with a fitting HTTP status.

A bug (any exception no handler expects) is answered 500 with a fixed message and a request id;
what went wrong goes to the server's log under that id, never to the client. A request body over
the cap is answered 413 whether its size is declared (Content-Length) or it streams in chunks.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adaspark.server.schemas import ErrorResponse, RequestError

log = logging.getLogger("adaspark.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}

# what each status means here, for the OpenAPI document (error_responses)
_MEANINGS = {
    400: "The request is malformed or asks for what the server cannot honour; `param` names "
         "the field.",
    401: "Missing or wrong API key (code invalid_api_key).",
    413: "The request body is over the server's cap.",
    429: "The server's request queue is full; retry later.",
    500: "The model failed to load, or an internal error (its request id is in the message).",
    503: "The model is still loading; retry shortly.",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for these statuses: each with the error object's schema."""
    return {status: {"model": ErrorResponse, "description": _MEANINGS[status]}
            for status in statuses}


def internal_error(exc: BaseException, where: str) -> tuple[str, dict[str, Any]]:
    """Log a bug with a new request id; (that id, the fixed error body that names it)."""
    request_id = f"req_{uuid.uuid4().hex[:16]}"
    log.error("internal error, request %s (%s)", request_id, where, exc_info=exc)
    message = f"internal server error (request {request_id}); the server's log has the details"
    return request_id, error_body(500, message)


def too_large(limit: int) -> JSONResponse:
    return error_response(413, f"request body over {limit >> 20} MiB")


class BodyTooLarge(Exception):
    """Raised from `receive` once a streamed request body passes the cap."""


class BodyLimitMiddleware:
    """An ASGI middleware that answers 413 to a request body over `limit` bytes: at once when
    Content-Length declares it, or as soon as a chunked body's bytes pass it, before the route
    has buffered more than one chunk over the cap."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(self.limit)(scope, receive, send)
            return
        received, started = 0, False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge()
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:  # a route that answers before reading its body: nothing left to say
                return
            await too_large(self.limit)(scope, receive, send)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line and the offending field, from pydantic's list of validation errors."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        # the parser's reason: a syntax error's place, or "recursion limit exceeded"
        reason = str(first.get("ctx", {}).get("error", "")).strip()
        return "the request body is not valid JSON" + (f": {reason}" if reason else ""), None
    if not where:
        return "the request body must be a JSON object", None
    # pydantic names a failed member of a union by its type ("messages.0.content.str"): the
    # client wants the field, so keep the path up to the first type name.
    path = []
    for part in where:
        if part in {"str", "list[TextPart]", "list[str]", "int", "float", "bool"}:
            break
        path.append(part)
    param = ".".join(path)
    return f"{param}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, exc.message, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = ("no such route: see /v1/chat/completions, /v1/completions, /v1/models, "
                       "/health, /metrics, /dashboard")
        return error_response(exc.status_code, message)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        # nobody reads this answer; it keeps a client that leaves mid-body from logging as a bug
        log.info("client left before its request body arrived (%s %s)", request.method,
                 request.url.path)
        return error_response(400, "the client disconnected before sending its request body")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so uvicorn logs the traceback too.
        request_id, body = internal_error(exc, f"{request.method} {request.url.path}")
        return JSONResponse(body, status_code=500, headers={"x-request-id": request_id})
