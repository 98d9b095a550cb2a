"""Which slots hold a request's state, and which are being filled by a transfer.

Two shipped bugs (docs/bugs.md) live here:
- bug 4: a "new request" reset cleared a transferred state. Only a local prefill starts
  a slot from zeros; `mark_ready` after a transfer leaves the bytes alone.
- bug 6: a step overwrote a slot an in-flight transfer was filling. Every step checks
  that neither its slot nor any of its blocks is being filled.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable

from transfer.errors import WrongState
from transfer.locking import locked


class CacheFillingError(WrongState):
    """A step touched a slot or block that an in-flight transfer is still writing."""


class SlotPhase(str, enum.Enum):
    FREE = "free"  # holds nothing this engine may read
    FILLING = "filling"  # a transfer is writing it (and its blocks)
    READY = "ready"  # holds a request's state: prefilled here or transferred in


class SlotTable:
    """Phase of every slot and the blocks each filling slot covers. Thread-safe: a rank
    may start a transfer (`mark_filling`) beside the step its command loop runs."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.phases = [SlotPhase.FREE] * num_slots
        self.filling_blocks: dict[int, frozenset[int]] = {}
        self._lock = threading.RLock()

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")

    @locked
    def phase(self, slot: int) -> SlotPhase:
        self.check_slot(slot)
        return self.phases[slot]

    @locked
    def mark_filling(self, slot: int, block_ids: Iterable[int]) -> None:
        """A transfer starts writing `slot` and `block_ids`; steps on them now raise."""
        self._check_free(slot, "mark_filling")
        blocks = frozenset(block_ids)
        busy = self._busy_blocks(blocks, except_slot=slot)
        if busy:
            raise CacheFillingError(f"block_ids {sorted(busy)} are already being filled")
        self.phases[slot] = SlotPhase.FILLING
        self.filling_blocks[slot] = blocks

    @locked
    def mark_ready(self, slot: int) -> None:
        """The transfer into `slot` completed: decode may continue from its bytes as they are."""
        if self.phase(slot) is not SlotPhase.FILLING:
            raise ValueError(f"slot {slot} is {self.phases[slot].value}, not filling")
        self.phases[slot] = SlotPhase.READY
        del self.filling_blocks[slot]

    @locked
    def release(self, slot: int) -> None:
        """The request in `slot` is finished or aborted (a failed transfer too)."""
        self.check_slot(slot)
        self.phases[slot] = SlotPhase.FREE
        self.filling_blocks.pop(slot, None)

    @locked
    def check_prefill(self, slot: int, block_ids: Iterable[int]) -> None:
        """Check a local prefill may start `slot` from zeros, changing nothing."""
        self._check_not_filling(slot, block_ids)
        self._check_free(slot, "prefill")

    @locked
    def begin_prefill(self, slot: int, block_ids: Iterable[int]) -> None:
        """Check a local prefill may start `slot` from zeros; it becomes READY."""
        self.check_prefill(slot, block_ids)
        self.phases[slot] = SlotPhase.READY

    @locked
    def check_decode(self, slot: int, block_ids: Iterable[int]) -> None:
        """Check a decode step may read and extend `slot`; it must hold a state."""
        self._check_not_filling(slot, block_ids)
        if self.phases[slot] is not SlotPhase.READY:
            raise ValueError(
                f"slot {slot} holds no request state (free): prefill it here, or "
                "mark_filling / mark_ready around the transfer that fills it"
            )

    @locked
    def check_not_filling(self, slot: int) -> None:
        """Raise CacheFillingError while a transfer writes `slot`."""
        if self.phase(slot) is SlotPhase.FILLING:
            raise CacheFillingError(f"slot {slot} is being filled by a transfer")

    def _check_free(self, slot: int, action: str) -> None:
        self.check_not_filling(slot)
        if self.phases[slot] is not SlotPhase.FREE:
            raise ValueError(f"{action}: slot {slot} holds a live request; release it first")

    def _check_not_filling(self, slot: int, block_ids: Iterable[int]) -> None:
        self.check_not_filling(slot)
        busy = self._busy_blocks(frozenset(block_ids), except_slot=None)
        if busy:
            raise CacheFillingError(f"block_ids {sorted(busy)} are being filled by a transfer")

    def _busy_blocks(self, blocks: frozenset[int], except_slot: int | None) -> set[int]:
        busy: set[int] = set()
        for slot, filling in self.filling_blocks.items():
            if slot != except_slot:
                busy |= blocks & filling
        return busy
