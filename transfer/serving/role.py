"""What a `pdxfer serve` process is, and which end of a transfer a rank's cache is on."""

from __future__ import annotations

from enum import StrEnum


class ServeRole(StrEnum):
    """A serve process's job. A StrEnum: flags, logs and dump paths use its value."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


# The roles that run TP ranks and hold a cache (an instance), in transfer order.
INSTANCE_ROLES = (ServeRole.PREFILL, ServeRole.DECODE)
