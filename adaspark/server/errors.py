"""Every error leaves the server as OpenAI's error object with a fitting HTTP status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from adaspark.server.schemas import RequestError

log = logging.getLogger("adaspark.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
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


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line and the offending field, from pydantic's list of validation errors."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
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
            message = ("no such route: see /v1/chat/completions, /v1/models, /health, /metrics, "
                       "/dashboard")
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so uvicorn logs the traceback once.
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
