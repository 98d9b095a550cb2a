"""`pdxfer serve prefill|decode|router`: one long-running process per instance.

A prefill or decode process starts its TP rank processes, then its gRPC control server
(health, reflection, optional token auth and TLS) and its Prometheus endpoint, prints
`PDXFER-READY {...}` on stdout, and serves until SIGINT/SIGTERM or until a rank dies.
With `--nnodes N`, node ranks > 0 run only their TP ranks, which follow the leader's.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from transfer.control.auth import TlsConfig, load_token
from transfer.control.client import ClientOptions
from transfer.control.metrics import WorkerMetrics, serve_metrics
from transfer.control.server import serve as serve_control
from transfer.net import free_port
from transfer.serving.procs import ready_line
from transfer.serving.router import Router, RouterMetrics, join_address
from transfer.units import parse_size

logger = logging.getLogger("pdxfer.serve")

SIOCGIFADDR = 0x8915


def auth_token(args: argparse.Namespace) -> str | None:
    """--auth-token-file (or PDXFER_AUTH_TOKEN_FILE), else PDXFER_AUTH_TOKEN, else none."""
    return load_token(args.auth_token_file)


def tls_configs(args: argparse.Namespace) -> tuple[TlsConfig | None, TlsConfig | None]:
    """(server TLS, client TLS for calls to other instances). The certificate doubles as
    the client certificate, so `--tls-ca` on every instance gives mutual TLS."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    server = (
        TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    )
    client = None
    if args.tls_cert or args.tls_ca:
        client = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca)
    return server, client


def interface_of(host: str) -> str | None:
    """The network interface holding IPv4 address `host` (for UCX_NET_DEVICES), or None."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        raise ValueError(f"--data-host: cannot resolve {host!r}") from None
    if ip.is_unspecified:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(ip):
                return name
    raise ValueError(f"--data-host: no local interface has address {ip}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_exposure(args: argparse.Namespace, token: str | None, tls) -> None:
    """Serving beyond this machine needs a token or mutual TLS: without either, anyone who
    reaches the port gets the arena's transport metadata and can drive the ranks. ValueError
    (exit 2) unless `--insecure`."""
    hosts = [args.host, getattr(args, "data_host", None) or args.host]
    exposed = [h for h in hosts if not is_loopback(h)]
    mutual = tls is not None and tls.ca is not None
    if exposed and not (token or mutual) and not getattr(args, "insecure", False):
        raise ValueError(
            f"--host {exposed[0]}: serving a non-loopback address needs --auth-token-file "
            "(or PDXFER_AUTH_TOKEN) or mutual TLS (--tls-cert/--tls-key/--tls-ca); "
            "--insecure serves it without"
        )


def advertised_host(host: str) -> str:
    """The host to put in tickets: the bind address, or this machine's address for 0.0.0.0."""
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def _install_stop() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame):
        logger.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def serve(args: argparse.Namespace) -> int:
    """Run one instance until stopped; 0 on a clean stop, 1 when its ranks died."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.role} %(levelname)s %(message)s",
    )
    stop = _install_stop()
    token = auth_token(args)
    server_tls, client_tls = tls_configs(args)
    check_exposure(args, token, server_tls)
    if args.role == "router":
        return _serve_router(args, token, server_tls, client_tls, stop)
    return _serve_worker(args, token, server_tls, client_tls, stop)


def _announce(role: str, server, metrics_server) -> None:
    port = metrics_server.port if metrics_server else 0
    print(ready_line(role, server.address, port), flush=True)
    logger.info("serving on %s (metrics port %s)", server.address, port or "off")


def _threads(args) -> int:
    """gRPC handler threads: a streaming call holds one for its whole life."""
    return max(16, 2 * args.max_seqs + getattr(args, "max_queue", 0) + 8)


def _metrics(args, metrics):
    if not args.metrics_port:
        return None
    return serve_metrics(metrics, host=args.host, port=args.metrics_port)


def _serve_router(args, token, server_tls, client_tls, stop: threading.Event) -> int:
    metrics = RouterMetrics()
    router = Router(args.prefill, args.decode, ClientOptions(token, client_tls), metrics)
    server = serve_control(
        join_address(args.host, args.port),
        generate=router.generate,
        token=token,
        tls=server_tls,
        max_workers=_threads(args),
    )
    metrics_server = _metrics(args, metrics)
    try:
        http = _http_front(args, router, metrics) if args.http_port is not None else None
    except BaseException:
        server.stop(grace=0)
        router.close()
        if metrics_server:
            metrics_server.stop()
        raise
    _announce("router", server, metrics_server)
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


def api_key(args: argparse.Namespace) -> str | None:
    """The HTTP API key: --api-key-file, else PDXFER_API_KEY, else none (no auth)."""
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the file is empty")
        return key
    return os.environ.get("PDXFER_API_KEY", "").strip() or None


def _http_front(args, router: Router, metrics: RouterMetrics):
    """The OpenAI-compatible HTTP server over `router`; its /metrics is the router's."""
    from transfer.serving.openai.app import build_app
    from transfer.serving.openai.engine import RouterEngine
    from transfer.serving.openai.http_server import HttpServer
    from transfer.serving.openai.served import load_served_model

    model = load_served_model(
        args.model, name=args.served_model_name, max_model_len=args.max_model_len
    )
    key = api_key(args)
    app = build_app(RouterEngine(router), model, api_key=key, registry=metrics.registry)
    http = HttpServer(app, args.host, args.http_port)
    logger.info(
        "OpenAI API on http://%s/v1: model %r, context %d tokens, %s, %s",
        join_address(args.host, http.port),
        model.name,
        model.max_model_len,
        "text and token ids" if model.codec else "token ids only (no tokenizer.json)",
        "API key required" if key else "no API key",
    )
    return http


def instance_config(args: argparse.Namespace):
    from transfer.presets import load_geometry
    from transfer.serving.instance import InstanceConfig

    if args.lease_seconds <= 0:
        raise ValueError(f"--lease-seconds must be > 0, got {args.lease_seconds}")
    return InstanceConfig(
        role=args.role,
        geometry=load_geometry(args.model),
        model=args.model,
        ssm_dtype=args.ssm_dtype,
        tp=args.tp,
        transport=args.transport,
        device=args.device,
        budget_bytes=parse_size(args.gpu_mem, "--gpu-mem"),
        max_seqs=args.max_seqs,
        max_queue=getattr(args, "max_queue", 32),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 2048),
        min_block_size=args.block_size,
        seed=args.seed,
        dump_dir=getattr(args, "dump_dir", None),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_addr=args.dist_addr,
        net_device=interface_of(args.data_host or args.host),
    )


def _serve_worker(args, token, server_tls, client_tls, stop: threading.Event) -> int:
    from transfer.serving.decode import DecodeWorker
    from transfer.serving.instance import Instance
    from transfer.serving.prefill import PrefillWorker
    from transfer.serving.rank_protocol import RankCommandError

    config = instance_config(args)
    try:
        instance = Instance(config)
    except RankCommandError as exc:  # bad input (a ValueError) still exits 2 with its message
        if isinstance(exc, ValueError):
            raise
        logger.error("the TP ranks failed to start: %s", exc)
        return 1
    if not config.is_leader:
        return _serve_follower(args, config, instance, token, server_tls, stop)
    metrics = WorkerMetrics()
    metrics.track_pools(
        kv_blocks_free=lambda: instance.pools.blocks.num_free,
        kv_blocks_total=lambda: instance.pools.blocks.num_total,
        state_slots_free=lambda: instance.pools.slots.num_free,
        state_slots_total=lambda: instance.pools.slots.num_total,
    )
    # Tickets and handshakes name this instance by its address, so pick the port first.
    port = args.port or free_port(args.host)
    address = join_address(advertised_host(args.host), port)
    # A boot id makes every process start a new instance: a peer that restarted at the same
    # address is told apart at the handshake, never mistaken for the one it replaced.
    instance_id = f"{args.instance_id or address}/{secrets.token_hex(4)}"
    bind = join_address(args.host, port)
    closers = []
    try:
        if args.role == "prefill":
            worker = PrefillWorker(instance, instance_id, address, args.lease_seconds, metrics)
            server = serve_control(
                bind,
                store=worker.store,
                identity=worker.identity,
                prefill=worker.prefill,
                token=token,
                tls=server_tls,
                max_workers=_threads(args),
            )
            worker.start()
        else:
            options = ClientOptions(token, client_tls)
            worker = DecodeWorker(
                instance, instance_id, options, metrics, known_prefill=args.prefill_peers
            )
            server = serve_control(
                bind,
                decode=worker.decode,
                register_prefill=worker.register_prefill,
                token=token,
                tls=server_tls,
                max_workers=_threads(args),
            )
        closers.append(worker.close)
        metrics_server = _metrics(args, metrics)
        if metrics_server:
            closers.append(metrics_server.stop)
        _announce(args.role, server, metrics_server)
    except BaseException:
        for close in closers:
            close()
        instance.close()
        raise
    return _wait(stop, instance, server, closers)


def _serve_follower(args, config, instance, token, server_tls, stop: threading.Event) -> int:
    """A node rank > 0 runs only its TP ranks, which follow the leader's; it still answers
    gRPC health and serves /metrics so that the same probes work on every pod."""
    logger.info("node %d of %d: serving TP ranks only", config.node_rank, config.nnodes)
    closers = []
    try:
        server = serve_control(
            join_address(args.host, args.port), token=token, tls=server_tls, health_only=True
        )
        metrics_server = _metrics(args, WorkerMetrics())
        if metrics_server:
            closers.append(metrics_server.stop)
        _announce(args.role, server, metrics_server)
    except BaseException:
        for close in closers:
            close()
        instance.close()
        raise
    return _wait(stop, instance, server=server, closers=closers)


def _wait(stop: threading.Event, instance, server, closers) -> int:
    code = 0
    try:
        while not stop.wait(1.0):
            if not instance.ranks.alive:
                logger.error("a TP rank process died; stopping")
                code = 1
                break
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
