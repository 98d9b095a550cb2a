"""Fault injection for tests (`PdxferConfig.test_hold_loads_file`, off by default): lets a
test stop decode's worker between a successful Acquire and the read, deterministically."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# The longest a hold file holds a step's loads (a test that died may leave it behind).
HOLD_MAX_S = 600.0


def hold_loads(hold: Path, request_ids: Sequence[str]) -> None:
    """Block while `hold` exists (at most HOLD_MAX_S), so these loads are not read meanwhile;
    `<hold>.held` names the held requests, so a test knows the worker got there."""
    if not hold.exists():
        return
    held = hold.with_name(hold.name + ".held")
    partial = held.with_name(held.name + ".part")
    partial.write_text("".join(f"{r}\n" for r in request_ids))
    partial.replace(held)  # whole, once it appears
    logger.warning(
        "pdxfer: holding the loads of %s while %s exists (test fault)", list(request_ids), hold
    )
    deadline = time.monotonic() + HOLD_MAX_S
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
