"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Handlers installed on the FastAPI app turn ``ApiError``, unknown routes and anything
unexpected into that body, so no client ever sees an HTML page or a bare 500. A client that
hangs up is not an error: it is logged in one INFO line, without a traceback.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

# Serve's logger in a replica: its lines go to the replica's log file, INFO included. The
# ingress logs through it too.
logger = logging.getLogger("ray.serve")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        # json.dumps's ASCII escapes: a message that quotes the client's text stays
        # encodable even when that text holds an unpaired surrogate (JSONResponse writes UTF-8).
        return Response(json.dumps(self.body()), status_code=self.status, headers=headers,
                        media_type="application/json")


class _CancelledReceiveIsDisconnect:
    """ASGI middleware. When a client hangs up, Serve cancels the request and its ``receive``
    raises ``TaskCancelledError``; this hands the app ASGI's own ``http.disconnect`` instead,
    which Starlette treats as the expected event it is (a streaming response stops, a body
    being read raises ``ClientDisconnect``) rather than as an unhandled error."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def receive_or_disconnect() -> dict:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


def install_handlers(app: FastAPI) -> None:
    app.add_middleware(_CancelledReceiveIsDisconnect)

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, _: ClientDisconnect) -> Response:
        logger.info("client disconnected while sending its request to %s", request.url.path)
        return ApiError(400, "the client disconnected", code="client_disconnected").response()  # never read

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail), code=f"http_{exc.status_code}").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, str(exc), code="invalid_request").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
