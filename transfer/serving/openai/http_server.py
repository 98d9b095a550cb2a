"""Run the HTTP app with uvicorn on a thread of the router process, beside its gRPC server."""

from __future__ import annotations

import threading
import time

import uvicorn

STARTUP_TIMEOUT_S = 30.0


class HttpServer:
    """uvicorn serving `app` on `host:port` (0 = any free port) until `stop`."""

    def __init__(self, app, host: str, port: int) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"the HTTP server could not listen on {host}:{port}")
            if time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:g}s")
            time.sleep(0.02)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1] if sockets else port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end open streams (their requests are cancelled), and join."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
