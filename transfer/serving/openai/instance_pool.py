"""The router's view of one role's instances: the addresses it was given, re-resolved now
and then (a Service name stands for its pods), a client per instance, taken in turn, and
those that went away recently tried last. Plus the health questions asked across a pool."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from transfer.control.errors import ControlError
from transfer.control.server import RANKS_HEALTH
from transfer.serving.addresses import resolve
from transfer.serving.openai.prefix_routes import PrefixRoutes
from transfer.serving.role import ServeRole

# An instance that answered UNAVAILABLE (gone, or restarting) is tried after the others for
# this long; then it is tried in turn again, so one that came back gets requests again.
DOWN_S = 5.0

Targets = list[tuple[str, Any]]  # (target HOST:PORT, its client)


class InstancePool:
    """The instances behind a list of addresses (re-resolved every `refresh_s`), round robin.
    `factory(target, original_address)` makes a target's client, once."""

    def __init__(
        self,
        addresses: Sequence[str],
        factory: Callable[[str, str], Any],
        refresh_s: float = 10.0,
    ) -> None:
        self._addresses = list(addresses)
        self._factory = factory
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._targets: list[tuple[str, str]] = []  # (target, original address)
        self._resolved_at = -float("inf")
        self._turn = itertools.count()
        self._down_until: dict[str, float] = {}

    def order(self) -> Targets:
        """Every instance once, starting at the next one in turn."""
        with self._lock:
            if time.monotonic() - self._resolved_at > self._refresh_s:
                self._targets = [(t, a) for a in self._addresses for t in resolve(a)]
                self._resolved_at = time.monotonic()
            targets = list(self._targets)
            start = next(self._turn) % len(targets) if targets else 0
            ordered = targets[start:] + targets[:start]
            out = []
            for target, original in ordered:
                if target not in self._clients:
                    self._clients[target] = self._factory(target, original)
                out.append((target, self._clients[target]))
            return out

    def mark_down(self, target: str) -> None:
        """`target` answered UNAVAILABLE: try it after the others for DOWN_S."""
        with self._lock:
            self._down_until[target] = time.monotonic() + DOWN_S

    def up_first(self, targets: Targets) -> Targets:
        """`targets` with those marked down recently moved last (stable otherwise)."""
        now = time.monotonic()
        with self._lock:
            down = {t for t, until in self._down_until.items() if until > now}
        return sorted(targets, key=lambda pair: pair[0] in down)

    def forget(self) -> None:
        """Re-resolve on the next call (after a failure, pods may have moved)."""
        with self._lock:
            self._resolved_at = -float("inf")

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def by_prefix(targets: Targets, routes: PrefixRoutes, hashes: Sequence[bytes]) -> Targets:
    """`targets` (in turn order) reordered by `routes` for a prompt's block `hashes`."""
    clients = dict(targets)
    return [(t, clients[t]) for t in routes.order([t for t, _ in targets], hashes)]


def any_serving(pool: InstancePool) -> bool:
    """Whether an instance of `pool` answers health SERVING (its clients have `health`)."""
    for _, client in pool.order():
        try:
            if client.health() == "SERVING":
                return True
        except ControlError:
            continue
    return False


def stalled(pools: dict[ServeRole, InstancePool]) -> list[str]:
    """The instances ("ROLE HOST:PORT", over `pools` by role) whose ranks' health says
    NOT_SERVING: a TP rank misses its heartbeats. Unreachable ones are not this check's."""
    found = []
    for role, pool in pools.items():
        for target, client in pool.order():
            try:
                if client.health(RANKS_HEALTH) == "NOT_SERVING":
                    found.append(f"{role.value} {target}")
            except ControlError:
                continue
    return sorted(found)
