"""The router registers every prefill instance with every decode instance at start-up, so a
decode handshakes before the first ticket; a decode that is not up yet is retried."""

from __future__ import annotations

import threading

from transfer.control.server import serve
from transfer.net import free_port
from transfer.serving.openai import introductions
from transfer.serving.openai.router import Router

PREFILLS = ["127.0.0.1:1", "127.0.0.1:2"]  # never dialled: only their addresses travel


def _refuse(request):
    raise AssertionError("no request is decoded here")


def test_every_prefill_is_registered_with_a_decode_that_comes_up_late(monkeypatch):
    monkeypatch.setattr(introductions, "INTRODUCE_RETRY_S", 0.05)
    address = f"127.0.0.1:{free_port()}"
    router = Router(PREFILLS, [address])
    registered: list[str] = []
    all_in = threading.Event()

    def register(addresses: list[str]) -> None:
        registered.extend(addresses)
        if len(registered) >= len(PREFILLS):
            all_in.set()

    server = None
    try:
        introducing = router.introduce()  # the decode is not listening yet: retried
        server = serve(address, decode=_refuse, register_prefill=register)
        assert all_in.wait(30), registered
        introducing.join(30)
        assert not introducing.is_alive()
        assert sorted(registered) == PREFILLS
        # a request's first ticket from a registered prefill registers nothing again
        router._introductions.register(address, router._decode.order()[0][1], PREFILLS[0])
        assert sorted(registered) == PREFILLS
    finally:
        router.close()
        if server is not None:
            server.stop(0)
