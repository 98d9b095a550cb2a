"""NIXL backend: one-sided READ/WRITE through a NIXL agent and its UCX plugin.

Posting costs index lists, not registration. The arena is registered once, and viewed as
a list of `granule`-byte descriptors, prepared once for the local arena and once per peer
for the peer's arena (`prep_xfer_dlist`). A batch whose offsets and lengths are multiples
of the granule, at most two granules per range on average, becomes two index arrays
(`make_prepped_xfer`); NIXL merges consecutive indices back into one descriptor. Any other
batch gets descriptors built for that one transfer (`initialize_xfer`): one per range,
which is the cheaper post once ranges span more granules. Neither registers anything.
docs/dataplane.md has the measurements.

The agent starts no listener: metadata travels as bytes through `register`/`add_peer`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from nixl._api import nixl_agent, nixl_agent_config

from transfer.dataplane.arena_info import ArenaInfo
from transfer.dataplane.base import TransportBase
from transfer.dataplane.metadata import PeerInfo
from transfer.dataplane.nixl_descriptors import (
    MAX_PREPPED_DESCRIPTORS,
    auto_granule,
    descriptors,
    granule_descriptors,
    granule_indices,
    is_granule_option,
    serves_prepped,
)
from transfer.dataplane.nixl_setup import (
    NIXL_ERRORS,
    describe,
    progress_delay,
    quietly,
    try_release,
    ucx_tls,
)
from transfer.dataplane.ranges import RangeBatch
from transfer.dataplane.regions import RegionMap
from transfer.dataplane.types import DONE, PENDING, Notification, Op, TransferStatus
from transfer.errors import InvalidInput

PROGRESS_DELAY_US = 100  # NIXL's progress thread, when idle (see nixl_setup.progress_delay)


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


@dataclass
class _Xfer:
    handle: Any  # nixl_xfer_handle


class NixlTransport(TransportBase):
    """Options: `granule` ("auto", 0 to always build descriptors per transfer, or a power of
    two >= 4096 bytes); `num_threads` (UCX plugin threads, 0 = NIXL's default); `tls`
    (UCX_TLS while the UCX plugin starts, e.g. "tcp"); `net_devices` (UCX devices, e.g. "lo");
    `progress_delay_us` (how long NIXL's progress thread sleeps when idle, see
    `nixl_setup.progress_delay`)."""

    backend = "nixl"

    def __init__(
        self,
        agent_name: str,
        *,
        granule: int | str = "auto",
        num_threads: int = 0,
        tls: str | None = None,
        net_devices: str | None = None,
        progress_delay_us: int = PROGRESS_DELAY_US,
    ) -> None:
        super().__init__(agent_name)
        if not is_granule_option(granule):
            raise InvalidInput(
                f"granule: expected 'auto', 0 or a power of two >= 4096, got {granule!r}"
            )
        if not isinstance(num_threads, int) or num_threads < 0:
            raise InvalidInput(f"num_threads: expected an int >= 0, got {num_threads!r}")
        if not isinstance(progress_delay_us, int) or progress_delay_us < 0:
            raise InvalidInput(
                f"progress_delay_us: expected an int >= 0, got {progress_delay_us!r}"
            )
        init = {}
        for option, value in (("tls", tls), ("net_devices", net_devices)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInput(f"{option}: expected a non-empty string, got {value!r}")
        if net_devices:
            init["ucx_devices"] = net_devices
        if num_threads:
            init["num_threads"] = str(num_threads)
        if "NIXL_LOG_LEVEL" not in os.environ:
            logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
        config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
        with progress_delay(progress_delay_us):
            self._agent = nixl_agent(agent_name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise RuntimeError("nixl: the UCX plugin is missing from this NIXL installation")
        with ucx_tls(tls):  # NIXL passes no transport list to UCX; UCX reads UCX_TLS
            self._agent.create_backend("UCX", init)
        self._granule_option = granule
        self.granule = 0
        self._mem = "DRAM"
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        self._remote_dlists: dict[str, Any] = {}
        self._region_maps: dict[str, tuple[tuple, RegionMap | None]] = {}
        self._stuck: list[Any] = []  # handles NIXL could not cancel yet

    # -- hooks ------------------------------------------------------------------------

    def _register(self, arena: torch.Tensor, info: ArenaInfo) -> bytes:
        self._mem = _mem_type(info.device)
        self._reg_descs = self._agent.register_memory(
            [(info.address, info.nbytes, info.device_index, "")], self._mem
        )
        granule = self._granule_option
        self.granule = auto_granule(info.nbytes) if granule == "auto" else granule
        if self.granule and info.nbytes // self.granule > MAX_PREPPED_DESCRIPTORS * 4:
            raise InvalidInput(
                f"granule: {self.granule} cuts the {info.nbytes}-byte arena into too many "
                "descriptors; pick a larger granule"
            )
        if self.granule and info.nbytes >= self.granule:
            descs = granule_descriptors(info.address, info.nbytes, self.granule, info.device_index)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self._mem)
        return self._agent.get_agent_metadata()

    def _register_regions(self, regions: list[torch.Tensor], region_map: RegionMap) -> bytes:
        # Several regions: no prepared granule lists (they assume one span); every transfer
        # builds its descriptors from the region map.
        self._mem = _mem_type(regions[0].device.type)
        index = regions[0].device.index or 0
        self._reg_descs = self._agent.register_memory(
            [(r.address, r.nbytes, index, "") for r in region_map.regions], self._mem
        )
        self.granule = 0
        return self._agent.get_agent_metadata()

    def _add_peer(self, info: PeerInfo) -> None:
        name = self._agent.add_remote_agent(info.payload)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != info.name:
            self._agent.remove_remote_agent(name)
            raise InvalidInput(f"metadata: names agent {info.name!r} but carries {name!r}")

    def _remove_peer(self, peer: str) -> None:
        dlist = self._remote_dlists.pop(peer, None)
        if dlist is not None:
            quietly(dlist.release)
        quietly(self._agent.remove_remote_agent, peer)

    def _remote_dlist(self, peer: PeerInfo) -> Any:
        dlist = self._remote_dlists.get(peer.name)
        if dlist is None:
            descs = granule_descriptors(
                peer.base_address, peer.arena_bytes, self.granule, peer.device_index
            )
            dlist = self._agent.prep_xfer_dlist(peer.name, descs, _mem_type(peer.device))
            self._remote_dlists[peer.name] = dlist
        return dlist

    def _peer_regions(self, peer: PeerInfo) -> RegionMap | None:
        if not peer.regions:
            return None
        cached = self._region_maps.get(peer.name)
        if cached is None or cached[0] != peer.regions:
            cached = (peer.regions, peer.region_map())
            self._region_maps[peer.name] = cached
        return cached[1]

    def _prepped(self, peer: PeerInfo, ranges: RangeBatch) -> bool:
        """Whether the prepared lists serve this batch (`serves_prepped`)."""
        if self._local_dlist is None or peer.regions:
            return False
        assert self.arena is not None
        return serves_prepped(self.granule, self.arena.nbytes, peer.arena_bytes, ranges)

    def _make_xfer(self, op: Op, peer: PeerInfo, ranges: RangeBatch, notif: bytes) -> Any:
        assert self.arena is not None
        if self._prepped(peer, ranges):
            counts = ranges.nbytes // self.granule
            total = int(counts.sum())
            return self._agent.make_prepped_xfer(
                op.value,
                self._local_dlist,
                granule_indices(ranges.local, counts, total, self.granule),
                self._remote_dlist(peer),
                granule_indices(ranges.remote, counts, total, self.granule),
                notif,
            )
        arena = self.arena
        local_at = ranges.local
        if self.region_map is not None:
            local_at = self.region_map.addresses(ranges.local, ranges.nbytes, "ranges.local")
        remote_at = ranges.remote
        peer_regions = self._peer_regions(peer)
        if peer_regions is not None:
            remote_at = peer_regions.addresses(ranges.remote, ranges.nbytes, "ranges.remote")
        local = descriptors(arena.address, local_at, ranges.nbytes, arena.device_index)
        remote = descriptors(peer.base_address, remote_at, ranges.nbytes, peer.device_index)
        return self._agent.initialize_xfer(
            op.value,
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, _mem_type(peer.device)),
            peer.name,
            notif,
        )

    def _post(
        self, op: Op, peer: PeerInfo, ranges: RangeBatch, notif: bytes, deadline_s: float
    ) -> tuple[_Xfer | None, TransferStatus]:
        try:
            handle = self._make_xfer(op, peer, ranges, notif)
        except NIXL_ERRORS as exc:
            return None, TransferStatus.failure(f"could not create transfer: {describe(exc)}")
        xfer = _Xfer(handle)
        try:
            state = self._agent.transfer(handle)
        except NIXL_ERRORS as exc:
            self._discard(xfer)
            return None, TransferStatus.failure(f"could not post transfer: {describe(exc)}")
        if state == "ERR":
            self._discard(xfer)
            return None, TransferStatus.failure("NIXL refused to post the transfer")
        return xfer, PENDING

    def _check(self, record: _Xfer) -> TransferStatus:
        try:
            state = self._agent.check_xfer_state(record.handle)
        except NIXL_ERRORS as exc:
            return TransferStatus.failure(describe(exc))
        if state == "DONE":
            return DONE
        if state == "PROC":
            return PENDING
        return TransferStatus.failure("NIXL reported a transfer error")

    # NIXL cannot stop a one-sided operation in flight: releasing its handle would only hide
    # bytes that still land. So a stopped transfer keeps its handle until NIXL reports it
    # finished (DONE, or ERR once UCX sees the peer gone), and reads as unsettled till then.
    def _cancel(self, record: _Xfer) -> None:
        pass

    def _abandon(self, record: _Xfer) -> None:
        pass

    def _settled(self, record: _Xfer) -> bool:
        try:
            return self._agent.check_xfer_state(record.handle) != "PROC"
        except NIXL_ERRORS:
            return True

    def _discard(self, record: _Xfer | None) -> None:
        if record is None:
            return
        try:
            record.handle.release()
        except NIXL_ERRORS:
            self._stuck.append(record.handle)
        self._stuck = [h for h in self._stuck if not try_release(h)]

    def _notifications(self) -> list[Notification]:
        new = self._agent.get_new_notifs()
        return [Notification(str(peer), bytes(msg)) for peer, msgs in new.items() for msg in msgs]

    def _close(self) -> None:
        self._stuck = [h for h in self._stuck if not try_release(h)]
        for peer in list(self._remote_dlists):
            self._remote_dlists.pop(peer).release()
        for peer in self.peers:
            quietly(self._agent.remove_remote_agent, peer)
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg_descs is not None:
            quietly(self._agent.deregister_memory, self._reg_descs)
            self._reg_descs = None
        self.peers.clear()
        del self._agent
