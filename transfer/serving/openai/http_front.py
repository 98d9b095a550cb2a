"""The router's OpenAI-compatible HTTP front end (`--http-port`) and its API key."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transfer.serving.addresses import join_address
from transfer.serving.engine.serve_options import ServeOptions
from transfer.serving.openai.metrics import RouterMetrics
from transfer.serving.openai.router import Router

logger = logging.getLogger("pdxfer.serve")


def api_key(options: ServeOptions) -> str | None:
    """The HTTP API key: --api-key-file, else PDXFER_API_KEY, else none (no auth)."""
    if options.api_key_file:
        key = Path(options.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {options.api_key_file}: the file is empty")
        return key
    return os.environ.get("PDXFER_API_KEY", "").strip() or None


def http_front(options: ServeOptions, router: Router, metrics: RouterMetrics):
    """The OpenAI-compatible HTTP server over `router`; its /metrics is the router's."""
    from transfer.serving.openai.app import build_app
    from transfer.serving.openai.engine import RouterEngine
    from transfer.serving.openai.http_server import HttpServer
    from transfer.serving.openai.served import load_served_model

    model = load_served_model(
        options.model, name=options.served_model_name, max_model_len=options.max_model_len
    )
    key = api_key(options)
    app = build_app(RouterEngine(router), model, api_key=key, registry=metrics.registry)
    http = HttpServer(app, options.host, options.http_port)
    logger.info(
        "OpenAI API on http://%s/v1: model %r, context %d tokens, %s, %s",
        join_address(options.host, http.port),
        model.name,
        model.max_model_len,
        "text and token ids" if model.codec else "token ids only (no tokenizer.json)",
        "API key required" if key else "no API key",
    )
    return http
