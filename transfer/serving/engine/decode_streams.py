"""What a decode request's consumer gets from the engine: its events, straight onto its
`out` queue or gathered per sink and handed over once per step, and the end of its stream
(END, or the error that ended it) once its ticket is ended and its cache is back. Engine
thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from transfer.serving.engine.request import END, DecodePhase, Request

if TYPE_CHECKING:
    from transfer.serving.engine.decode_engine import DecodeEngine

logger = logging.getLogger(__name__)


class DecodeStreams:
    """The decode engine's requests as their consumers see them."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.finishing: list[Request] = []  # ended; its stream ends once its cache is back
        self._outgoing: dict[object, list] = {}  # sink -> this step's items for it

    def emit(self, request: Request, item) -> None:
        """Hand `item` (a TokenEvent, END or an exception) to the request's consumer."""
        if request.sink is None:
            request.out.put(item)
        else:
            tagged = (request.sink_tag, None if item is END else item)
            self._outgoing.setdefault(request.sink, []).append(tagged)

    def flush(self) -> None:
        """Hand each sink the items gathered for it, in one call."""
        outgoing, self._outgoing = self._outgoing, {}
        for sink, items in outgoing.items():
            try:
                sink(items)
            except Exception:  # noqa: BLE001 - one consumer's bug must not stop the engine
                logger.exception("decode engine: a sink failed")

    def finish(self, request: Request, error: BaseException | None) -> None:
        """End `request`: abort its ticket if still open, give its cache back; its stream
        ends (with `error`, if any) once both are done."""
        if request in self.finishing:
            return
        if error is not None and request.error is None:
            request.error = error
        self.finishing.append(request)
        self.engine.setup.end_ticket(request)
        self.engine.cache.release(request)

    def deliver_finished(self) -> None:
        """End the stream of each finishing request whose ticket and cache are done."""
        engine = self.engine
        for request in list(self.finishing):
            back = (
                request.phase in (DecodePhase.DONE, DecodePhase.HELD) and request.released.is_set()
            )
            if not back or engine.setup.busy(request):
                continue
            self.finishing.remove(request)
            if request in engine.active:
                engine.active.remove(request)
            self.emit(request, request.error if request.error is not None else END)
