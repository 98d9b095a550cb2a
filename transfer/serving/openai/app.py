"""The OpenAI-compatible HTTP front end of the router (FastAPI on uvicorn, as vLLM uses).

It turns a request into token ids, streams `Engine.generate`'s tokens back as OpenAI
completions or chat completions (SSE when `stream`), and stops early on a stop string or
EOS. A client that disconnects, streaming or not, closes the token stream, which cancels
the request on the workers (the router aborts what it started). A stream is answered only
once its request is admitted, so a refusal is a 429, not a stream that ends in an error.
Text is length-checked before it is tokenized, and tokenized off the event loop.

This module wires the routes, API-key checks, error shapes and bounded bodies; the
endpoints are in `endpoints`, the per-request work in `handler`.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from transfer.serving.openai import endpoints
from transfer.serving.openai.handler import Handler, ServedModel
from transfer.serving.openai.metrics import HttpMetrics
from transfer.serving.openai.schema import ApiError
from transfer.serving.openai.streams import Engine

MAX_BODY_BYTES = 4 << 20  # far above any prompt the context allows; bounds what one call buffers
RETRY_AFTER_S = 1  # what a refused (429) client is told to wait


def build_app(
    engine: Engine,
    model: ServedModel,
    *,
    api_key: str | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The HTTP app over `engine`; `registry` gets the latency histograms and is served
    at /metrics (the router's own series live there too)."""
    registry = registry or CollectorRegistry()
    handler = Handler(engine, model, HttpMetrics(registry))
    app = FastAPI(title="pdxfer", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def errors_and_auth(request: Request, call_next):
        try:
            if api_key and request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    raise ApiError(401, "missing or wrong API key", type="authentication_error")
            return await call_next(request)
        except ApiError as exc:
            return _error_response(exc)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        # Unknown routes and wrong methods, in the OpenAI shape rather than {"detail": ...}.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, str(exc.detail), code=code)
        return _error_response(error)

    @app.get("/health")
    async def health():
        """503 when no prefill or no decode instance serves; 200 otherwise, with
        "degraded" naming instances that serve but have a TP rank missing heartbeats."""
        if not await asyncio.to_thread(engine.is_ready):
            return JSONResponse({"status": "unavailable"}, status_code=503)
        degraded = getattr(engine, "degraded", None)
        stalled = await asyncio.to_thread(degraded) if degraded is not None else []
        if stalled:
            return {"status": "degraded", "degraded": stalled}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    @app.get("/v1/models")
    async def models():
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": "pdxfer"}
        card["max_model_len"] = model.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await endpoints.completions(handler, request, await read_body(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await endpoints.chat(handler, request, await read_body(request))

    return app


async def read_body(request: Request):
    """The request's JSON body, refused (413) past MAX_BODY_BYTES before it is all read."""
    too_large = ApiError(
        413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    raw = bytearray()
    async for piece in request.stream():  # a chunked body has no length to check first
        raw += piece
        if len(raw) > MAX_BODY_BYTES:
            raise too_large
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None


def _error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
