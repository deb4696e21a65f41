"""OpenAI's error body, and handlers so every failure leaves the server in that shape.

`{"error": {"message", "type", "param", "code"}}`. Client mistakes are 4xx with
type `invalid_request_error`; pydantic's 422 becomes a 400 as OpenAI and vLLM answer.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

log = logging.getLogger("kvserve.server")


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of every error answer (OpenAI's shape), for the OpenAPI document."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: the error statuses it can answer, with their body.
    400 stands for every client mistake (pydantic's 422 is answered as 400)."""
    words = {400: "invalid request", 404: "unknown model or route", 499: "client left",
             503: "engine not running"}
    return {s: {"model": ErrorBody, "description": words.get(s, "error")} for s in statuses}


def error_body(err: APIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, worded for a person; `param` is the field's path."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error')}")
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    # A union field fails once per member type; name the members instead of the first one.
    members = [e["loc"][-1] for e in errors if _field_path(e.get("loc", ())) == loc
               and e.get("loc") and _is_type_tag(e["loc"][-1])]
    if len(members) > 1:
        msg = f"should be one of: {', '.join(map(str, members))}"
    elif first.get("type") == "missing":
        msg = "this field is required"
    else:
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is not None and first.get("type") != "missing":
        got = first.get("input")
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
        msg = f"{msg} (got {shown[:80]})"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _field_path(loc: tuple | list) -> list[str]:
    """The loc without 'body' and without pydantic's union member tags ('str', 'list[int]')."""
    return [str(part) for part in loc if part != "body" and not _is_type_tag(part)]


def _is_type_tag(part: object) -> bool:
    # Field names here are snake_case; member tags are builtin types, generics or classes.
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list", "dict", "none"}
        or "[" in part or part[:1].isupper())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        # Unknown routes and wrong methods: same shape as every other error.
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(APIError(exc.status_code, str(exc.detail), code=code)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
