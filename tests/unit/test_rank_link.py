"""RankLink against a fake rank 0 on a socket pair: pipelined commands come back to their
own callers, whichever thread waits first; failures and a dead rank reach every waiter."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from transfer.errors import InvalidInput
from transfer.serving.ranks.rank_inbox import Inbox
from transfer.serving.ranks.rank_protocol import RankFailure, RankGroupDead, Stop
from transfer.serving.ranks.ranks import RankLink

TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Echo:
    value: int
    delay_s: float = 0.0
    fail: bool = False
    overtakes: bool = False


class FakeRank0:
    """Answers each command in the order received, tagged with its index as rank 0 does:
    [value * 10], or a failure. Records the values in the order they arrived."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.received: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            for index in itertools.count():
                command = self.conn.recv()
                if isinstance(command, Stop):
                    return
                self.received.append(command.value)
                time.sleep(command.delay_s)
                if command.fail:
                    answer = [RankFailure.of(0, InvalidInput(f"value {command.value}"))]
                else:
                    answer = [command.value * 10]
                self.conn.send((index, answer))
        except (EOFError, OSError):
            return
        finally:
            self.conn.close()


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    link = RankLink(Connection(ours.detach()), "fake")
    rank = FakeRank0(Connection(theirs.detach()))
    yield link, rank
    link.stop(wait_s=1.0)
    rank.thread.join(TIMEOUT_S)


def test_pipelined_commands_answer_their_own_callers_in_any_wait_order(pair):
    link, rank = pair
    pending = [link.submit(Echo(i, delay_s=0.01)) for i in range(5)]
    assert pending[3].result(TIMEOUT_S) == [30]  # waiting for a later one files the earlier
    assert [p.result(TIMEOUT_S) for p in (pending[4], pending[0], pending[2], pending[1])] == [
        [40], [0], [20], [10],
    ]  # fmt: skip
    assert rank.received == [0, 1, 2, 3, 4]


def test_threads_waiting_on_a_shared_link_each_get_their_answer(pair):
    link, _ = pair
    out: dict[int, list[int]] = {}

    def caller(base: int) -> None:
        out[base] = [link.call(Echo(base + i), TIMEOUT_S)[0] for i in range(20)]

    threads = [threading.Thread(target=caller, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    assert out == {100 * t: [10 * (100 * t + i) for i in range(20)] for t in range(4)}


def test_an_earlier_caller_is_not_held_behind_a_later_slow_command(pair):
    link, _ = pair
    first = link.submit(Echo(1, delay_s=0.05))
    slow = link.submit(Echo(2, delay_s=1.0))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(slow.result(TIMEOUT_S)))
    reader.start()  # this thread reads the connection for both
    time.sleep(0.02)
    began = time.monotonic()
    assert first.result(TIMEOUT_S) == [10]
    assert time.monotonic() - began < 0.8  # not after the slow one
    reader.join(TIMEOUT_S)
    assert got == [[20]]


def test_a_failed_command_raises_for_its_caller_only(pair):
    link, _ = pair
    bad, good = link.submit(Echo(1, fail=True)), link.submit(Echo(2))
    assert good.result(TIMEOUT_S) == [20]
    with pytest.raises(InvalidInput, match="value 1"):
        bad.result(TIMEOUT_S)


def test_a_dead_rank_fails_every_waiting_command():
    ours, theirs = socket.socketpair()
    link = RankLink(Connection(ours.detach()), "fake")
    pending = [link.submit(Echo(i)) for i in range(3)]
    theirs.close()  # rank 0 died without answering
    for p in pending:
        with pytest.raises(RankGroupDead, match="died"):
            p.result(TIMEOUT_S)
    with pytest.raises(RankGroupDead):
        link.submit(Echo(9))


def test_rank0_runs_commands_in_arrival_order_and_tags_answers():
    ours, theirs = socket.socketpair()
    control, rank0 = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(rank0)
    for value in range(5):
        control.send(Echo(value))
    order = [inbox.next() for _ in range(5)]
    assert [(i, c.value) for i, c in order] == [(v, v) for v in range(5)]
    control.close()
    index, command = inbox.next()  # the control process is gone
    assert (index, command) == (5, Stop())
    assert inbox.next() == (6, Stop())  # and stays gone
    rank0.close()


def test_rank0_runs_a_command_that_overtakes_before_those_waiting():
    """What arrived while a command ran is read before the next one is picked: one that
    overtakes goes first, the others keep their order, and each keeps its own index."""
    ours, theirs = socket.socketpair()
    control, rank0 = Connection(ours.detach()), Connection(theirs.detach())
    inbox = Inbox(rank0)
    for value in range(2):
        control.send(Echo(value))
    control.send(Echo(2, overtakes=True))
    control.send(Echo(3))
    control.send(Echo(4, overtakes=True))
    order = [inbox.next() for _ in range(5)]
    assert [(i, c.value) for i, c in order] == [(2, 2), (4, 4), (0, 0), (1, 1), (3, 3)]
    control.send(Echo(5))
    control.send(Echo(6, overtakes=True))
    control.close()
    assert [inbox.next()[0] for _ in range(3)] == [6, 5, 7]  # 7: the Stop for the EOF
    rank0.close()
