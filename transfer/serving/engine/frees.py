"""Frees that run on a thread of their own, one after another, so that whoever frees a
request does not wait for the ranks.

Freeing a prefill instance's request takes a rank command, which waits behind the prefill
step the ranks are running: 60 ms p50 and 180 ms p90 at C=32 on a 2-core box
(docs/benchmarks.md, "Release without waiting for the ranks"). A decode instance's
Release call waited that long before its request's first token.

A job put under a request id keeps that id busy until it has run: a request sent again
under the same id (the router retries a failed one) waits for it (`wait_for`), since its
blocks and slot are still the old request's until then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

_STOP = object()


class FreeQueue:
    """Runs each `put` job on one thread, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._keys: Counter[str] = Counter()  # request id -> its jobs not yet run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None], key: str | None = None) -> None:
        """Queue `job`; `key` (a request id) stays busy for `wait_for` until it has run."""
        with self._cond:
            self._pending += 1
            if key is not None:
                self._keys[key] += 1
        self._jobs.put((job, key))

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every job put so far has run, waiting up to `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """Whether every job put under `key` so far has run, waiting up to `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: key not in self._keys, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Run the jobs already put, then stop."""
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not _STOP:
            job, key = item
            try:
                job()
            except Exception:  # noqa: BLE001 - one failed free must not stop the others
                logger.exception("a free failed")
            with self._cond:
                self._pending -= 1
                if key is not None:
                    self._keys[key] -= 1
                    if not self._keys[key]:
                        del self._keys[key]
                self._cond.notify_all()
