"""The UCX backend's wire protocol: tags, request and ack messages, framed range streams.

ucxx offers tagged messages, not one-sided RMA, so the side that owns the arena serves:
a READ request makes it send the asked ranges; a WRITE request makes it receive them.

Tags (64 bit): kind in the top byte, a random 56-bit transfer id below.
- REQUEST: to the server's worker; carries op, ranges, notif and the reply address.
- DATA:    the ranges, as `tag_send_multi` streams of at most MULTI_CHUNK frames.
- ACK:     to the requester: ok, or the reason the server refused.

`tag_send_multi` sends ucxx `Header` messages (100 frame sizes each) before the frames.
The receiver posts its own receives, headers into scratch rows and frames straight into
their destination ranges, then checks the headers against the sizes it expected.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from transfer.errors import InvalidInput

KIND_SHIFT = 56
KIND_MASK = 0xFF << KIND_SHIFT
REQUEST_TAG = 1 << KIND_SHIFT
_DATA = 2 << KIND_SHIFT
_ACK = 3 << KIND_SHIFT

OP_READ = 1  # the server sends its ranges
OP_WRITE = 2  # the server receives into its ranges

MULTI_CHUNK = 1000  # frames per tag_send_multi call: its cost grows faster than linearly
HEADER_FRAMES = 100  # ucxx::HeaderFramesSize
HEADER_BYTES = 1 + 8 + HEADER_FRAMES * (4 + 8)  # bool next, size_t nframes, int[], size_t[]
HEADER_SLOT = 2048
ACK_BYTES = 512

_REQUEST = struct.Struct("<4sBBHIIQqd")
_ACK_HEAD = struct.Struct("<4sBxxxI")


def new_transfer_id() -> int:
    return int.from_bytes(os.urandom(7), "little")


def data_tag(transfer_id: int) -> int:
    return _DATA | transfer_id


def ack_tag(transfer_id: int) -> int:
    return _ACK | transfer_id


@dataclass(frozen=True, eq=False)
class Request:
    op: int
    transfer_id: int
    requester: str
    reply_address: bytes
    notif: bytes
    offsets: np.ndarray  # int64 [n], into the server's arena
    nbytes: np.ndarray  # int64 [n]
    deadline_s: float


def encode_request(request: Request) -> np.ndarray:
    name = request.requester.encode()
    head = _REQUEST.pack(
        b"PDXU",
        1,
        request.op,
        len(name),
        len(request.reply_address),
        len(request.notif),
        request.transfer_id,
        len(request.offsets),
        request.deadline_s,
    )
    text = head + name + request.reply_address + request.notif
    text += b"\0" * (-len(text) % 8)
    columns = np.concatenate([request.offsets, request.nbytes]).astype("<i8")
    return np.frombuffer(text + columns.tobytes(), dtype=np.uint8).copy()


def decode_request(buffer: np.ndarray) -> Request:
    """Raise InvalidInput on a message `encode_request` did not make."""
    data = buffer.tobytes()
    if len(data) < _REQUEST.size:
        raise InvalidInput("request: truncated")
    magic, version, op, name_len, addr_len, notif_len, tid, n, deadline = _REQUEST.unpack_from(data)
    if magic != b"PDXU" or version != 1 or op not in (OP_READ, OP_WRITE) or n <= 0:
        raise InvalidInput("request: bad header")
    pos = _REQUEST.size
    name = data[pos : pos + name_len]
    address = data[pos + name_len : pos + name_len + addr_len]
    notif = data[pos + name_len + addr_len : pos + name_len + addr_len + notif_len]
    pos += name_len + addr_len + notif_len
    pos += -pos % 8
    if len(data) != pos + 16 * n:
        raise InvalidInput("request: length does not match its range count")
    columns = np.frombuffer(data, dtype="<i8", offset=pos).astype(np.int64)
    return Request(
        op, tid, name.decode(errors="replace"), address, notif, columns[:n], columns[n:], deadline
    )


def encode_ack(reason: str = "") -> np.ndarray:
    text = reason.encode()[: ACK_BYTES - _ACK_HEAD.size]
    message = _ACK_HEAD.pack(b"PDXA", 0 if reason else 1, len(text)) + text
    return np.frombuffer(message, dtype=np.uint8).copy()


def decode_ack(buffer: np.ndarray) -> str | None:
    """None for ok, else the server's reason."""
    magic, ok, length = _ACK_HEAD.unpack_from(buffer.tobytes())
    if magic != b"PDXA":
        return "malformed acknowledgement"
    if ok:
        return None
    return bytes(buffer[_ACK_HEAD.size : _ACK_HEAD.size + length]).decode(errors="replace")


def chunks(count: int) -> list[tuple[int, int]]:
    """[start, stop) of each tag_send_multi call for `count` frames."""
    return [(i, min(i + MULTI_CHUNK, count)) for i in range(0, count, MULTI_CHUNK)]


def header_rows(count: int) -> int:
    return sum(-(-(stop - start) // HEADER_FRAMES) for start, stop in chunks(count))


def check_headers(rows: np.ndarray, nbytes: np.ndarray) -> str:
    """Compare received ucxx headers (uint8 [header_rows, HEADER_SLOT]) with the sizes the
    receiver expected; return "" when they agree, else what differs."""
    row = 0
    for start, stop in chunks(len(nbytes)):
        for first in range(start, stop, HEADER_FRAMES):
            last = min(first + HEADER_FRAMES, stop)
            header = rows[row]
            row += 1
            more = bool(header[0])
            frames = int(header[1:9].view("<u8")[0])
            sizes = header[9 + 4 * HEADER_FRAMES : HEADER_BYTES].view("<u8")[:frames]
            if more != (last < stop) or frames != last - first:
                return f"ucxx frame header {row - 1}: {frames} frames, expected {last - first}"
            if not np.array_equal(sizes.astype(np.int64), nbytes[first:last]):
                return f"ucxx frame header {row - 1}: frame sizes differ from the request"
    return ""
