"""Errors as the OpenAI API reports them: a status code and ``{"error": {...}}``.

Anything the frontend refuses or fails raises an :class:`APIError`; the app turns it
into a JSON response (or, once a stream has started, into an SSE error event). The
``type`` strings are those of the OpenAI API, so its clients raise the matching
exception (``BadRequestError`` for 400, ``NotFoundError`` for 404, ...).
"""

from __future__ import annotations

import math
from typing import Any

from runtime.rpc import ErrorCode, GenerateError


class APIError(Exception):
    status_code = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str] | None:
        return None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(APIError):
    """A request refused as the client sent it: OpenAI's ``invalid_request_error``,
    under the status that says why (each subclass sets its own)."""

    status_code = 400
    type = "invalid_request_error"


class BadRequest(InvalidRequest):
    status_code = 400


class ModelNotFound(InvalidRequest):
    status_code = 404

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class RouteNotFound(InvalidRequest):
    status_code = 404


class MethodNotAllowed(InvalidRequest):
    status_code = 405


class PayloadTooLarge(InvalidRequest):
    status_code = 413


class Overloaded(APIError):
    """429: the pool is saturated; the client should retry after ``retry_after_s``
    (sent as ``Retry-After``, which the OpenAI clients honour)."""

    status_code = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(math.ceil(self.retry_after_s), 1))}


class ServiceUnavailable(APIError):
    status_code = 503
    type = "service_unavailable"


class GatewayTimeout(APIError):
    status_code = 504
    type = "timeout"


class InternalError(APIError):
    status_code = 500
    type = "server_error"


def from_worker_error(e: GenerateError) -> APIError:
    """The API error a failed Generate stream means to the client."""
    if e.code is ErrorCode.INVALID_ARGUMENT:
        return BadRequest(e.message)
    if e.code is ErrorCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"the decode workers are full; try again later ({e.message})")
    if e.code in (ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED):
        return ServiceUnavailable(
            f"no decode worker could serve the request ({e.code.value}: {e.message})",
            code=e.code.value,
        )
    if e.code is ErrorCode.DEADLINE_EXCEEDED:
        return GatewayTimeout("the request timed out", code="timeout")
    return InternalError(f"the decode worker failed: {e.message}", code=e.code.value)
