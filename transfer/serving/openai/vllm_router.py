"""`pdxfer serve router --engine vllm`: pdxfer's OpenAI front end over vLLM prefill and decode
servers (`transfer.serving.openai.vllm_backend`). There is no gRPC here: the HTTP port serves
the API, /health and /metrics, and the READY line names it."""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from transfer.serving.addresses import join_address
from transfer.serving.child_process import ready_line
from transfer.serving.engine.serve_options import ServeOptions
from transfer.serving.openai.http_front import api_key

logger = logging.getLogger("pdxfer.serve")


def serve_vllm_router(options: ServeOptions, stop: threading.Event) -> int:
    """Serve until `stop` is set; 0 on a clean stop."""
    from transfer.serving.openai.app import build_app
    from transfer.serving.openai.http_server import HttpServer
    from transfer.serving.openai.served import load_served_model
    from transfer.serving.openai.vllm_backend import VllmEngine

    if options.http_port is None:
        raise ValueError("--http-port: the router with --engine vllm serves the OpenAI API only")
    registry = CollectorRegistry()
    engine = VllmEngine(options.prefill, options.decode, registry)
    model = load_served_model(
        options.model, name=options.served_model_name, max_model_len=options.max_model_len
    )
    http = HttpServer(build_app(engine, model, api_key=api_key(options), registry=registry),
                      options.host, options.http_port)  # fmt: skip
    address = join_address(options.host, http.port)
    logger.info(
        "OpenAI API on http://%s/v1 over vLLM: model %r, prefill %s, decode %s",
        address, model.name, ", ".join(options.prefill), ", ".join(options.decode),
    )  # fmt: skip
    print(ready_line("router", address, http.port), flush=True)
    try:
        stop.wait()
    finally:
        http.stop()
    return 0
