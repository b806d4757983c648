"""What a request passes before any work: the API key, then the body's size, encoding and JSON.

`ApiKey` is an ASGI middleware: with a key set, every route but `/health` wants `Authorization:
Bearer KEY` and answers 401 with OpenAI's error body without it. `read_json` reads a body up to
`max_bytes` (413 past it, told by Content-Length before reading, else counted while reading), then
decodes it as UTF-8 and parses it as JSON, each failure a 400: malformed bodies cost nothing.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from fastforward.serving.schema import ApiError, error_body

OPEN_PATHS = ("/health",)  # for load balancers' probes, which carry no key


class ApiKey:
    """ASGI middleware: requests without the bearer key get a 401 (see the module docstring)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "a valid API key is required: send the header 'Authorization: Bearer KEY'"
                body = json.dumps(error_body(message, "invalid_request_error", code="invalid_api_key")).encode()
                headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes, more than this server's limit of {limit}")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body parsed as JSON, or an ApiError (413 too large; 400 not UTF-8, not JSON)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(declared, max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
