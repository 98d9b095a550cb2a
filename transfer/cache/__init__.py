"""Per-rank cache memory: the arena, its byte layout, and the block/slot pools.

`Arena` (torch) loads on first access, so planning code stays free of torch.
"""

from typing import TYPE_CHECKING

from transfer.cache.fragment import fragment
from transfer.cache.head_units import ConvOrder, KVOrder, KVUnit, LayoutOptions, SSMOrder, StateUnit
from transfer.cache.layout import LAYOUT_VERSION, Layout
from transfer.cache.pools import BlockPool, CacheFullError, CachePools, RequestCache, SlotPool

__all__ = [
    "LAYOUT_VERSION",
    "Arena",
    "BlockPool",
    "CacheFullError",
    "CachePools",
    "ConvOrder",
    "KVOrder",
    "KVUnit",
    "Layout",
    "LayoutOptions",
    "RequestCache",
    "SSMOrder",
    "SlotPool",
    "StateUnit",
    "fragment",
]

if TYPE_CHECKING:
    from transfer.cache.arena import Arena


def __getattr__(name: str):
    if name == "Arena":
        from transfer.cache.arena import Arena

        return Arena
    raise AttributeError(f"module 'transfer.cache' has no attribute {name!r}")
