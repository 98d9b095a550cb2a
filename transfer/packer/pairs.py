"""What every plan between two instances shares, computed once per pair of layouts.

A decode engine plans each request between the same few prefill and decode instances,
on the thread that admits it: validating the layouts and matching each decode rank's
units to prefill ranks (`copies.rank_copies`) would cost most of each plan.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from transfer.cache.layout import Layout
from transfer.packer.copies import RankCopies, rank_copies
from transfer.packer.request import validate_layouts

# Pairs held at once (decode engines talk to a few prefill instances), and request parts
# (layer groups x with/without state) held per pair.
MAX_PAIRS = 16
MAX_PARTS = 256


class InstancePair:
    """The layouts of a prefill and a decode instance, validated, and per part of a
    request (`layers`, `with_state`) what each decode rank reads (`copies.RankCopies`)."""

    def __init__(self, prefill: tuple[Layout, ...], decode: tuple[Layout, ...]) -> None:
        validate_layouts(prefill, decode)
        self.prefill, self.decode = prefill, decode
        self._copies: dict[tuple, tuple[RankCopies, ...]] = {}

    def rank_copies(
        self, layers: frozenset[int] | None, with_state: bool
    ) -> tuple[RankCopies, ...]:
        """Per decode rank, `copies.rank_copies(prefill, rank, layers, with_state)`."""
        key = (layers, bool(with_state))
        copies = self._copies.get(key)
        if copies is None:
            copies = tuple(rank_copies(self.prefill, d, layers, with_state) for d in self.decode)
            if len(self._copies) >= MAX_PARTS:
                self._copies.clear()  # more parts than any streaming config plans
            self._copies[key] = copies
        return copies


_pairs: dict[tuple, InstancePair] = {}
_lock = threading.Lock()


def instance_pair(prefill: Sequence[Layout], decode: Sequence[Layout]) -> InstancePair:
    """The `InstancePair` of these layouts; raises InvalidInput (nothing cached) when the
    packer cannot plan between them.

    Cached by the layouts' identity: hashing a Layout hashes its whole geometry, which
    for real models costs about what the cache saves. A cached pair holds its layouts,
    so their ids cannot name other objects while it is cached; equal layouts that are
    distinct objects get a pair of their own, with equal copies.
    """
    key = (tuple(map(id, prefill)), tuple(map(id, decode)))
    pair = _pairs.get(key)
    if pair is None:
        pair = InstancePair(tuple(prefill), tuple(decode))
        with _lock:  # evicting iterates the dict: no other thread may change it meanwhile
            while len(_pairs) >= MAX_PAIRS:
                del _pairs[next(iter(_pairs))]
            _pairs[key] = pair
    return pair


def clear_cache() -> None:
    """Forget every cached pair (tests compare cached plans with fresh ones)."""
    with _lock:
        _pairs.clear()
