"""Errors in OpenAI's (and vLLM's) JSON shape, so that clients' SDKs parse the router's own
refusals exactly as they parse an engine's.

Every client mistake must end here with a 4xx; a 500 from the router means a router bug.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

# vLLM names the error type after the HTTP status class (ErrorResponse in its protocol).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RouterError(Exception):
    """An error the router answers itself, before or instead of forwarding."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_type(status: int) -> str:
    return _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with code = the HTTP status."""
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, param)).encode(),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str) -> bytes:
    """The frames that end a stream that failed after its first byte (vLLM does the same)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
