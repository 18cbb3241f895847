"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, whatever failed.

Handlers registered here turn FastAPI's own failures (422 validation errors, malformed JSON,
unknown routes) into the same shape, so a client parses every error the same way.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.tokenizer import TokenizerError
from protocol.errors import EngineDeadError, RequestError, RequestFailedError
from protocol.sampling import SamplingError

log = logging.getLogger(__name__)

# OpenAI's error types, by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A failure the client is told about, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase.lower())
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_parameter")


def unsupported(param: str) -> ApiError:
    return ApiError(
        400, f"parameter {param!r} is not supported by tandem", param=param, code="unsupported"
    )


def as_api_error(err: Exception) -> ApiError:
    """The client-facing form of any failure during a request."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, SamplingError):
        return invalid(str(err), param=err.param)
    if isinstance(err, RequestError | TokenizerError):
        return invalid(str(err))
    if isinstance(err, RequestFailedError):  # this request alone; the server goes on
        return ApiError(500, f"the request failed: {err}", code="request_failed")
    if isinstance(err, EngineDeadError):
        return ApiError(503, f"no engine can serve the request: {err}", code="engine_unavailable")
    log.exception("request failed", exc_info=err)
    return ApiError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")


# What pydantic puts in an error's location besides field names: the member of a union it
# tried ("str", "literal['none','auto']", "function-after[...]", a model's class name) and
# "[key]" for a mapping's key. Clients want the field: `stop`, not `stop.str`.
_UNION_MEMBER = re.compile(r"^([a-z][a-z0-9_-]*\[.*\]|\[key\]|str|int|float|bool|none|[A-Z]\w*)$")


def param_path(location: tuple) -> list[str]:
    """The field a validation error is about, without pydantic's own steps: `messages.0.content`
    where pydantic says `body.messages.0.content.str`."""
    return [
        str(part)
        for part in location
        if part != "body" and (isinstance(part, int) or not _UNION_MEMBER.match(part))
    ]


def describe_validation(err: RequestValidationError, content_type: str = "") -> ApiError:
    """The first of pydantic's complaints as one 400 that names the parameter."""
    first = err.errors()[0]
    location = param_path(tuple(first.get("loc", ())))
    param = ".".join(location) or (first.get("ctx") or {}).get("param")
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    if first.get("type") in ("model_attributes_type", "dict_type") and not location:
        if not content_type.startswith("application/json"):
            return invalid(
                "the request body must be JSON sent with 'Content-Type: application/json' "
                f"(this one came as {content_type or 'no content type'!r})"
            )
        return invalid("the request body must be a JSON object")
    if first.get("type") == "extra_forbidden" and param is not None:
        return unsupported(param)
    message = first.get("msg", "invalid request")
    if first.get("type") == "missing" and param is not None:
        message = f"missing required parameter {param!r}"
    elif location and not message.startswith(location[-1]):
        message = f"{param}: {message}"
    return invalid(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    async def on_validation(request: Request, err: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "").lower()
        return describe_validation(err, content_type).response()

    async def on_http(request: Request, err: HTTPException) -> JSONResponse:
        message = err.detail if isinstance(err.detail, str) else HTTPStatus(err.status_code).phrase
        return ApiError(err.status_code, message, headers=err.headers).response()

    async def on_any(request: Request, err: Exception) -> JSONResponse:
        return as_api_error(err).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    # Expected failures get their own handlers, so they are answered inside the app: the
    # catch-all below runs in Starlette's outermost middleware, which re-raises after
    # answering, and uvicorn then logs a traceback and closes the connection.
    for expected in (
        RequestError,
        SamplingError,
        TokenizerError,
        EngineDeadError,
        RequestFailedError,
    ):
        app.add_exception_handler(expected, on_any)
    app.add_exception_handler(Exception, on_any)
