"""Where a request's time to first token goes, hop by hop, across the router, the prefill
instance and the decode instance.

Off unless the environment names a directory in `TRACE_DIR_ENV` when a process starts. Then
each process appends one line per `mark`, "<unix seconds> <point> <request id>", to
`<dir>/<pid>.trace`, and `read_traces` joins the files by request id. The points compare
across processes only on one clock: processes on one host (`pdxfer bench serve --trace`
runs them so), or hosts whose clocks are synchronised far below the hops measured.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from pathlib import Path

TRACE_DIR_ENV = "PDXFER_TRACE_DIR"


class TracePoint(enum.Enum):
    """The points of a request's path to its first token, in the order they are passed.
    Decode runs two chains side by side, the Acquire and (for a whole ticket) the READs, and
    releases the ticket once both are done; so the READs may start before ACQUIRE_RECEIVED
    and land before or after ACQUIRE_ANSWERED. With layer-wise streaming the READs start
    after ACQUIRE_ANSWERED and before PREFILL_DONE."""

    ROUTER_RECEIVED = "router_received"  # the router took the request
    PREFILL_RECEIVED = "prefill_received"  # a prefill instance's handler took it
    PREFILL_DONE = "prefill_done"  # its last chunk ran: the whole cache is written
    PREFILL_ANSWERED = "prefill_answered"  # the handler returns its ticket
    ROUTER_PREFILL_ANSWERED = "router_prefill_answered"  # the router has the ticket
    DECODE_ARRIVED = "decode_arrived"  # a decode instance's engine has the request
    ACQUIRE_RECEIVED = "acquire_received"  # prefill took decode's Acquire
    TRANSFER_STARTED = "transfer_started"  # the READs went to decode's ranks
    TRANSFER_DONE = "transfer_done"  # every READ landed
    ACQUIRE_ANSWERED = "acquire_answered"  # decode has the Acquire's answer
    RELEASE_RECEIVED = "release_received"  # prefill took decode's Release
    FIRST_TOKEN = "first_token"  # decode emits token 0
    ROUTER_TOKEN_READ = "router_token_read"  # the router's reader took token 0 off the call
    ROUTER_FIRST_TOKEN = "router_first_token"  # the router hands token 0 to its caller


_BY_VALUE = {point.value: point for point in TracePoint}


class _Sink:
    """This process's trace file, opened at its first line."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / f"{os.getpid()}.trace"
        self._lock = threading.Lock()
        self._file = None

    def write(self, line: str) -> None:
        with self._lock:
            if self._file is None:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._path.open("a", buffering=1)  # a line is whole once written
            self._file.write(line)


_sink: _Sink | None = None


def enable(directory: str | os.PathLike | None) -> None:
    """Trace this process into `directory` (None: stop). Done at import from the
    environment; tests call it directly."""
    global _sink
    _sink = _Sink(Path(directory)) if directory else None


def enabled() -> bool:
    """Whether `mark` writes (so a caller can skip finding what to mark)."""
    return _sink is not None


def mark(point: TracePoint, request_id: str) -> None:
    """`request_id` passes `point` now (a no-op unless tracing is on)."""
    sink = _sink
    if sink is not None:
        sink.write(f"{time.time():.6f} {point.value} {request_id}\n")


def read_traces(directory: str | os.PathLike) -> dict[str, dict[TracePoint, float]]:
    """request id -> point -> unix seconds, from every process's file under `directory`. A
    point passed twice (a retried request) keeps its first time; lines that do not parse (a
    process killed mid-line) are skipped."""
    traces: dict[str, dict[TracePoint, float]] = {}
    for path in sorted(Path(directory).glob("*.trace")):
        for line in path.read_text().splitlines():
            fields = line.split(" ", 2)
            if len(fields) != 3 or fields[1] not in _BY_VALUE:
                continue
            try:
                at = float(fields[0])
            except ValueError:
                continue
            points = traces.setdefault(fields[2], {})
            point = _BY_VALUE[fields[1]]
            points[point] = min(at, points.get(point, at))
    return traces


enable(os.environ.get(TRACE_DIR_ENV))
