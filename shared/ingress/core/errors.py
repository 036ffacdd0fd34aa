"""API errors, shaped the way each dialect's real API shapes them.

Code raises `ApiError(kind, message)`; the app's exception handler renders
it for the route's dialect: OpenAI `{"error": {message, type, param, code}}`,
Anthropic `{"type": "error", "error": {type, message}}`. The kind decides the
status, except overload: 503 for OpenAI, 529 for Anthropic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Dialect(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ErrorKind(StrEnum):
    """The Anthropic error types; OpenAI types are mapped from them."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    REQUEST_TOO_LARGE = "request_too_large"
    RATE_LIMIT = "rate_limit_error"
    API = "api_error"
    OVERLOADED = "overloaded_error"
    TIMEOUT = "timeout_error"


_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.PERMISSION: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.REQUEST_TOO_LARGE: 413,
    ErrorKind.RATE_LIMIT: 429,
    ErrorKind.API: 500,
    ErrorKind.TIMEOUT: 504,
}
_OVERLOADED_STATUS = {Dialect.OPENAI: 503, Dialect.ANTHROPIC: 529}

# OpenAI's `type` strings (what its SDK and clients read).
_OPENAI_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "invalid_request_error",
    ErrorKind.PERMISSION: "invalid_request_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",
    ErrorKind.REQUEST_TOO_LARGE: "invalid_request_error",
    ErrorKind.RATE_LIMIT: "rate_limit_exceeded",
    ErrorKind.API: "server_error",
    ErrorKind.OVERLOADED: "server_error",
    ErrorKind.TIMEOUT: "server_error",
}
_OPENAI_CODE = {
    ErrorKind.AUTHENTICATION: "invalid_api_key",
    ErrorKind.NOT_FOUND: "model_not_found",
    ErrorKind.RATE_LIMIT: "rate_limit_exceeded",
    ErrorKind.OVERLOADED: "overloaded",
    ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
}


@dataclass(slots=True)
class ApiError(Exception):
    """A request that ends in an error response; `retry_after_s` becomes a Retry-After header."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    def status(self, dialect: Dialect) -> int:
        if self.kind is ErrorKind.OVERLOADED:
            return _OVERLOADED_STATUS[dialect]
        return _STATUS[self.kind]

    def body(self, dialect: Dialect) -> dict[str, Any]:
        if dialect is Dialect.ANTHROPIC:
            return anthropic_error(self.kind, self.message)
        return openai_error(self.message, _OPENAI_TYPE[self.kind], self.param, self.code or _OPENAI_CODE.get(self.kind))

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, int(self.retry_after_s + 0.999)))}


def openai_error(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error(type: ErrorKind | str, message: str) -> dict[str, Any]:
    """The Anthropic error body: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": str(type), "message": message}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param)


def dialect_of(path: str) -> Dialect:
    """Which dialect a route speaks (errors and request-id header follow it)."""
    return Dialect.ANTHROPIC if path.startswith("/v1/messages") else Dialect.OPENAI
