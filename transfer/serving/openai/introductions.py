"""Which prefill instances each decode instance has been told about. A decode dials only the
prefill addresses it was given (docs/workers.md), so the router vouches for every prefill
instance with every decode instance at start-up (`introduce`, in the background, so each
decode handshakes before the first ticket comes instead of inside that request's transfer),
and for a request's own prefill before its first decode there (`register`)."""

from __future__ import annotations

import logging
import threading
import time

from transfer.control.client import DecodeClient
from transfer.control.errors import ControlError
from transfer.serving.openai.instance_pool import InstancePool

logger = logging.getLogger(__name__)

# `introduce` retries a decode instance that did not take its prefill list this often, for
# this long (it may still be starting); later, a request's first ticket registers its prefill.
INTRODUCE_RETRY_S = 0.5
INTRODUCE_FOR_S = 120.0


class Introductions:
    """(decode target, prefill address) pairs registered, so each is sent once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered: set[tuple[str, str]] = set()
        self._closed = threading.Event()

    def known(self, target: str, prefill_address: str) -> bool:
        with self._lock:
            return (target, prefill_address) in self._registered

    def register(self, target: str, client: DecodeClient, prefill_address: str) -> None:
        """Vouch for `prefill_address` with the decode instance `target` (blocking; once)."""
        if self.known(target, prefill_address):
            return
        client.register_prefill([prefill_address])
        with self._lock:
            self._registered.add((target, prefill_address))

    def forget(self, target: str, prefill_address: str) -> None:
        """`target` failed a request: it may have restarted and forgotten, so register again."""
        with self._lock:
            self._registered.discard((target, prefill_address))

    def introduce(self, prefills: InstancePool, decodes: InstancePool) -> threading.Thread:
        """Register every prefill instance with every decode instance, on a thread of its
        own, retrying a decode that is not up yet for INTRODUCE_FOR_S."""
        thread = threading.Thread(
            target=self._introduce, args=(prefills, decodes), name="router-introduce", daemon=True
        )
        thread.start()
        return thread

    def _introduce(self, prefills: InstancePool, decodes: InstancePool) -> None:
        deadline = time.monotonic() + INTRODUCE_FOR_S
        addresses = [target for target, _ in prefills.order()]
        pending = dict(decodes.order())
        while pending and not self._closed.is_set():
            for target, client in list(pending.items()):
                try:
                    for address in addresses:
                        self.register(target, client, address)
                    del pending[target]
                except ControlError as exc:
                    if time.monotonic() > deadline:
                        logger.info("decode %s took no prefill list (%s)", target, exc)
                        del pending[target]
            self._closed.wait(INTRODUCE_RETRY_S)

    def close(self) -> None:
        """Stop introducing."""
        self._closed.set()
