"""What `Transport.register` hands out and `add_peer` reads: one arena, one agent, as bytes.

An arena made of several regions (`Transport.register_regions`) also lists them,
`[virtual start, address, nbytes]` each (`transfer.dataplane.regions.RegionMap`).

Layout: magic, u32 length of a JSON header, the header, then the backend's own payload
(NIXL agent metadata, a UCX worker address). The bytes are opaque to everyone else.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

from transfer.dataplane.regions import RegionMap
from transfer.errors import InvalidInput

_MAGIC = b"PDXFDP1\0"
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class PeerInfo:
    """One registered arena of one agent."""

    backend: str
    name: str
    arena_bytes: int
    device: str  # "cpu" or "cuda"
    device_index: int
    base_address: int
    payload: bytes = b""
    regions: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(tuple(r) for r in self.regions))

    def region_map(self) -> RegionMap | None:
        """The peer's regions, or None for a single arena at `base_address`."""
        return RegionMap.from_list(list(self.regions)) if self.regions else None

    def encode(self) -> bytes:
        fields = asdict(self)
        del fields["payload"]
        header = json.dumps(fields, sort_keys=True).encode()
        return _MAGIC + _LENGTH.pack(len(header)) + header + self.payload

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        """Raise InvalidInput on anything that `encode` did not produce."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput(f"metadata: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        start = len(_MAGIC) + _LENGTH.size
        if len(data) < start or not data.startswith(_MAGIC):
            raise InvalidInput("metadata: not pdxfer dataplane metadata (bad magic)")
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        if start + length > len(data):
            raise InvalidInput("metadata: truncated header")
        try:
            fields = json.loads(data[start : start + length])
            info = cls(**fields, payload=data[start + length :])
            if info.regions:
                RegionMap.from_list(list(info.regions), "metadata.regions")
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"metadata: malformed header ({exc})") from None
        if info.arena_bytes <= 0 or info.base_address < 0 or info.device not in ("cpu", "cuda"):
            raise InvalidInput("metadata: arena fields out of range")
        return info
