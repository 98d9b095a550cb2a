"""A client's close on the way out never waits on grpc for longer than it was given."""

from __future__ import annotations

import threading

from transfer.control.client import DecodeClient, RouterClient


class _BlockingChannel:
    """A channel whose close blocks until released (grpc/grpc#20026's deadlock)."""

    def __init__(self, real) -> None:
        self.real = real
        self.release = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()

    def close(self) -> None:
        self.started.set()
        self.release.wait(30)
        self.real.close()
        self.finished.set()


def test_a_bounded_close_returns_while_the_channel_close_still_blocks():
    for client in (RouterClient("127.0.0.1:1"), DecodeClient("127.0.0.1:1")):
        channel = client._channel = _BlockingChannel(client._channel)
        client.close(wait_s=0.05)
        assert not channel.finished.is_set()  # an unbounded close returns only after it
        assert channel.started.wait(5)
        channel.release.set()
        assert channel.finished.wait(5)


def test_an_unbounded_close_waits_for_the_channel():
    client = RouterClient("127.0.0.1:1")
    channel = client._channel = _BlockingChannel(client._channel)
    channel.release.set()
    client.close()
    assert channel.finished.is_set()
