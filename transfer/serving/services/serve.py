"""`pdxfer serve prefill|decode|router`: one long-running process per instance.

A prefill or decode process starts its TP rank processes, then its gRPC control server
(health, reflection, optional token auth and TLS) and its Prometheus endpoint, prints
`PDXFER-READY {...}` on stdout, and serves until SIGINT/SIGTERM or until a rank dies.
With `--nnodes N`, node ranks > 0 run only their TP ranks, which follow the leader's.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
import time

from transfer.control.aio_server import serve_router
from transfer.control.client import ClientOptions
from transfer.control.metrics import WorkerMetrics, serve_metrics
from transfer.control.server import serve as serve_control
from transfer.net import free_port
from transfer.serving.addresses import join_address
from transfer.serving.child_process import ready_line
from transfer.serving.engine.serve_options import ANY_PORT, RouterBackend, ServeOptions
from transfer.serving.openai.http_front import api_key, http_front
from transfer.serving.openai.metrics import RouterMetrics
from transfer.serving.openai.router import Router
from transfer.serving.role import ServeRole
from transfer.serving.services.instance_config import instance_config
from transfer.serving.services.interfaces import advertised_host
from transfer.serving.services.serve_security import (
    auth_token,
    check_exposure,
    check_http_exposure,
    tls_configs,
)

logger = logging.getLogger("pdxfer.serve")


def _install_stop() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame):
        logger.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def serve(options: ServeOptions) -> int:
    """Run one instance until stopped; 0 on a clean stop, 1 when its ranks died."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {options.role} %(levelname)s %(message)s",
    )
    stop = _install_stop()
    token = auth_token(options)
    server_tls, client_tls = tls_configs(options)
    check_exposure(options, token, server_tls)
    if options.role is ServeRole.ROUTER and options.http_port is not None:
        check_http_exposure(options.host, api_key(options), options.insecure)
    if options.role is ServeRole.ROUTER and options.engine is RouterBackend.VLLM:
        from transfer.serving.openai.vllm_router import serve_vllm_router

        return serve_vllm_router(options, stop)
    if options.role is ServeRole.ROUTER:
        return _serve_router(options, token, server_tls, client_tls, stop)
    return _serve_worker(options, token, server_tls, client_tls, stop)


def _announce(role: str, server, metrics_server, http=None) -> None:
    port = metrics_server.port if metrics_server else 0
    print(ready_line(role, server.address, port, http.port if http else None), flush=True)
    logger.info("serving on %s (metrics port %s)", server.address, port or "off")


def _threads(options: ServeOptions) -> int:
    """gRPC handler threads (a streaming call holds one for its whole life), and the
    router's threads for its blocking calls."""
    return max(16, 2 * options.max_seqs + options.max_queue + 8)


def _metrics(options: ServeOptions, metrics):
    if not options.metrics_port:
        return None
    port = 0 if options.metrics_port == ANY_PORT else options.metrics_port
    return serve_metrics(metrics, host=options.host, port=port)


def _serve_router(
    options: ServeOptions, token, server_tls, client_tls, stop: threading.Event
) -> int:
    metrics = RouterMetrics()
    router = Router(
        options.prefill,
        options.decode,
        ClientOptions(token, client_tls),
        metrics,
        threads=_threads(options),
    )
    server = serve_router(
        join_address(options.host, options.port), router.agenerate, token=token, tls=server_tls
    )
    metrics_server = _metrics(options, metrics)
    try:
        http = http_front(options, router, metrics) if options.http_port is not None else None
    except BaseException:
        server.stop(grace=0)
        router.close()
        if metrics_server:
            metrics_server.stop()
        raise
    router.introduce()
    _announce(ServeRole.ROUTER, server, metrics_server, http)
    try:
        stop.wait()
    finally:
        server.set_serving(False)
        if http is not None:
            http.stop()
        server.stop(grace=2.0)
        router.close()
        if metrics_server:
            metrics_server.stop()
    return 0


def _serve_worker(
    options: ServeOptions, token, server_tls, client_tls, stop: threading.Event
) -> int:
    from transfer.serving.engine.decode import DecodeWorker
    from transfer.serving.engine.instance import Instance
    from transfer.serving.engine.prefill import PrefillWorker
    from transfer.serving.ranks.rank_protocol import RankCommandError

    config = instance_config(options)
    try:
        instance = Instance(config)
    except RankCommandError as exc:  # bad input (a ValueError) still exits 2 with its message
        if isinstance(exc, ValueError):
            raise
        logger.error("the TP ranks failed to start: %s", exc)
        return 1
    if not config.is_leader:
        return _serve_follower(options, config, instance, token, server_tls, stop)
    metrics = WorkerMetrics()
    metrics.track_pools(
        kv_blocks_free=lambda: instance.free_kv_blocks,
        kv_blocks_total=lambda: instance.pools.blocks.num_total,
        state_slots_free=lambda: instance.pools.slots.num_free,
        state_slots_total=lambda: instance.pools.slots.num_total,
    )
    metrics.ranks_silent.set_function(lambda: len(instance.ranks.silent_ranks()))
    # Tickets and handshakes name this instance by its address, so pick the port first.
    port = options.port or free_port(options.host)
    address = join_address(advertised_host(options.host), port)
    # A boot id makes every process start a new instance: a peer that restarted at the same
    # address is told apart at the handshake, never mistaken for the one it replaced.
    instance_id = f"{options.instance_id or address}/{secrets.token_hex(4)}"
    bind = join_address(options.host, port)
    closers = []
    try:
        if options.role is ServeRole.PREFILL:
            worker = PrefillWorker(instance, instance_id, address, options.lease_seconds, metrics)
            server = serve_control(
                bind,
                store=worker.store,
                identity=worker.identity,
                stage=worker.stage,
                prefill=worker.prefill,
                token=token,
                tls=server_tls,
                max_workers=_threads(options),
            )
            worker.start()
        else:
            client_options = ClientOptions(token, client_tls)
            worker = DecodeWorker(
                instance, instance_id, client_options, metrics, known_prefill=options.prefill_peers
            )
            server = serve_control(
                bind,
                decode=worker.decode,
                decode_start=worker.start_decode,
                register_prefill=worker.register_prefill,
                token=token,
                tls=server_tls,
                max_workers=_threads(options),
            )
        closers.append(worker.close)
        metrics_server = _metrics(options, metrics)
        if metrics_server:
            closers.append(metrics_server.stop)
        _announce(options.role, server, metrics_server)
    except BaseException:
        for close in closers:
            close()
        instance.close()
        raise
    return _wait(stop, instance, server, closers)


def _report_silent(silent: list[int], before: list[int] | None, server) -> list[int]:
    """Log and publish (gRPC health RANKS_HEALTH) a change in the ranks missing their
    heartbeats. Slow is not dead: the instance keeps serving and waiting on them."""
    if silent != before:
        if silent:
            logger.warning("TP rank(s) %s missed their heartbeats: degraded (still serving)",
                           silent)  # fmt: skip
        elif before:
            logger.info("every TP rank beats again")
        if server is not None:
            server.set_ranks_beating(not silent)
    return silent


def _serve_follower(
    options: ServeOptions, config, instance, token, server_tls, stop: threading.Event
) -> int:
    """A node rank > 0 runs only its TP ranks, which follow the leader's; it still answers
    gRPC health and serves /metrics so that the same probes work on every pod."""
    logger.info("node %d of %d: serving TP ranks only", config.node_rank, config.nnodes)
    closers = []
    try:
        server = serve_control(
            join_address(options.host, options.port), token=token, tls=server_tls, health_only=True
        )
        metrics_server = _metrics(options, WorkerMetrics())
        if metrics_server:
            closers.append(metrics_server.stop)
        _announce(options.role, server, metrics_server)
    except BaseException:
        for close in closers:
            close()
        instance.close()
        raise
    return _wait(stop, instance, server=server, closers=closers)


def _wait(stop: threading.Event, instance, server, closers) -> int:
    code = 0
    silent: list[int] | None = None  # None: not published yet
    try:
        while not stop.wait(1.0):
            if not instance.ranks.alive:
                logger.error("a TP rank process died; stopping")
                code = 1
                break
            silent = _report_silent(instance.ranks.silent_ranks(), silent, server)
    finally:
        began = time.monotonic()
        if server is not None:
            server.set_serving(False)
            server.stop(grace=2.0)
        logger.info("server stopped after %.2fs", time.monotonic() - began)
        for close in closers:
            close()
        logger.info("workers closed after %.2fs", time.monotonic() - began)
        instance.close()
        logger.info("ranks stopped after %.2fs", time.monotonic() - began)
    return code
