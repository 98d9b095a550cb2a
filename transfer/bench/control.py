"""`pdxfer bench control`: ticket round-trip latency and throughput over a loopback control server.

One round trip is what a decode instance spends on the control plane per
request: `Acquire` then `Release`, two unary RPCs, timed together from the
client. The prefill side (a separate process, as in a deployment) publishes
every ticket before the clock starts, so publishing is not timed.

Two phases: one client issuing round trips back to back (latency, unloaded),
then `--concurrency` clients, each with its own channel, splitting the
tickets (throughput, and latency under that load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time

from transfer.stats import percentile

WARMUP = 200
BLOCKS_PER_TICKET = 4
BLOCK_SIZE = 16


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "control",
        help="ticket round trip (Acquire + Release) over a loopback control server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tickets", type=int, default=2000, help="tickets per phase (default 2000)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="clients in the loaded phase (default 16)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.tickets < 1:
        raise ValueError(f"--tickets: must be >= 1, got {args.tickets}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency: must be >= 1, got {args.concurrency}")
    result = measure(args.tickets, args.concurrency)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        serial, loaded = result["serial"], result["loaded"]
        print("control-plane round trip (Acquire + Release), loopback, server in its own process")
        print(
            f"  serial     {args.tickets} tickets: p50 {serial['p50_ms']:.3f} ms  p99 {serial['p99_ms']:.3f} ms  "
            f"({serial['tickets_per_s']:.0f} tickets/s)"
        )
        print(
            f"  loaded x{args.concurrency:<3} {args.tickets} tickets: p50 {loaded['p50_ms']:.3f} ms  "
            f"p99 {loaded['p99_ms']:.3f} ms  {loaded['tickets_per_s']:.0f} tickets/s "
            f"({loaded['rpcs_per_s']:.0f} RPC/s)"
        )
        print(f"  tickets left live on the prefill side: {result['leaked']}")
    return 0


def measure(tickets: int, concurrency: int) -> dict:
    """Run both phases against a fresh server process; latencies in ms."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    names = (
        [f"w{i}" for i in range(WARMUP)]
        + [f"s{i}" for i in range(tickets)]
        + [f"c{i}" for i in range(tickets)]
    )
    server = ctx.Process(target=_serve_tickets, args=(child, names), daemon=True)
    server.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("control server process did not start within 120s")
        address, published = parent.recv()
        by_name = {t.request_id: t for t in published}
        _round_trips(address, [by_name[n] for n in names[:WARMUP]])
        start = time.perf_counter()
        serial = _round_trips(address, [by_name[f"s{i}"] for i in range(tickets)])
        serial_s = time.perf_counter() - start
        loaded, loaded_s = _loaded(address, [by_name[f"c{i}"] for i in range(tickets)], concurrency)
        parent.send("stop")
        leaked = parent.recv() if parent.poll(60) else -1
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
    return {
        "definition": "round trip = Acquire + Release unary RPCs on loopback, timed at the client",
        "tickets": tickets,
        "concurrency": concurrency,
        "serial": _summary(serial, serial_s),
        "loaded": _summary(loaded, loaded_s),
        "leaked": leaked,
    }


def _round_trips(address: str, tickets: list) -> list[float]:
    from transfer.control.client import TransferClient

    latencies = []
    with TransferClient(address, timeout_s=30) as client:
        client.wait_ready()
        for ticket in tickets:
            start = time.perf_counter()
            got = client.acquire(ticket.request_id, "bench-decode")
            client.release(ticket.request_id, "bench-decode", got.block_ids, got.slot_id)
            latencies.append((time.perf_counter() - start) * 1e3)
    return latencies


def _loaded(address: str, tickets: list, concurrency: int) -> tuple[list[float], float]:
    shares = [tickets[i::concurrency] for i in range(concurrency)]
    results: list[list[float]] = [[] for _ in shares]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(shares) + 1)

    def worker(i: int) -> None:
        from transfer.control.client import TransferClient

        try:
            with TransferClient(address, timeout_s=60) as client:
                client.wait_ready()
                barrier.wait(60)
                for ticket in shares[i]:
                    start = time.perf_counter()
                    got = client.acquire(ticket.request_id, f"bench-decode-{i}")
                    client.release(
                        ticket.request_id, f"bench-decode-{i}", got.block_ids, got.slot_id
                    )
                    results[i].append((time.perf_counter() - start) * 1e3)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(shares))]
    for t in threads:
        t.start()
    barrier.wait(120)
    start = time.perf_counter()
    for t in threads:
        t.join(600)
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return [x for r in results for x in r], elapsed


def _summary(latencies_ms: list[float], elapsed_s: float) -> dict:
    ordered = sorted(latencies_ms)
    return {
        "p50_ms": percentile(ordered, 50),
        "p99_ms": percentile(ordered, 99),
        "mean_ms": sum(ordered) / len(ordered),
        "tickets_per_s": len(ordered) / elapsed_s,
        "rpcs_per_s": 2 * len(ordered) / elapsed_s,
    }


def _serve_tickets(conn, names: list[str]) -> None:
    """The prefill process: publish every ticket, serve until told to stop, report what is still live."""
    from transfer.control import (
        ControlConfig,
        HandshakeReply,
        TicketStore,
        compat_hash,
        make_compat,
    )
    from transfer.control.server import serve

    config = ControlConfig(
        num_kv_blocks=4096,
        num_state_slots=len(names),
        block_size=BLOCK_SIZE,
        max_blocks_per_request=BLOCKS_PER_TICKET,
        lease_s=600.0,
    )
    store = TicketStore(config, lambda ticket, reason: None, instance_id="bench-prefill")
    compat = make_compat(geometry="bench", dtypes="bf16", block_size=BLOCK_SIZE, layout_version=1)
    server = serve(
        "127.0.0.1:0",
        store=store,
        identity=HandshakeReply("bench-prefill", compat, compat_hash(compat)),
    )
    store.address = server.address
    published = [
        store.publish(
            name,
            [(BLOCKS_PER_TICKET * i + k) % config.num_kv_blocks for k in range(BLOCKS_PER_TICKET)],
            i,
            BLOCKS_PER_TICKET * BLOCK_SIZE,
            first_token=i,
        )
        for i, name in enumerate(names)
    ]
    store.start()
    conn.send((server.address, published))
    conn.recv()
    server.stop(1)
    store.stop()
    conn.send(len(store))
