"""Prefix-aware routing: the longest recorded prefix wins among instances within the load
skew, ties go to the least busy then to turn order, and the block size a ticket used is
recovered from its hashes."""

from __future__ import annotations

import random

import pytest

from transfer.cache.block_hashes import block_hashes
from transfer.serving.openai.prefix_routes import PrefixRoutes, learn_block_size

TARGETS = ["a", "b", "c"]


def hashes(seed: int, blocks: int, size: int = 4) -> tuple[bytes, ...]:
    rng = random.Random(seed)
    return block_hashes([rng.randrange(100) for _ in range(blocks * size)], size)


def test_without_hints_the_turn_order_stands():
    assert PrefixRoutes().order(TARGETS, hashes(1, 3)) == TARGETS


def test_the_longest_recorded_prefix_goes_first():
    routes, h = PrefixRoutes(), hashes(1, 4)
    routes.record("b", h[:2])
    routes.record("c", h[:3])
    assert routes.order(TARGETS, h) == ["c", "b", "a"]
    other = hashes(2, 4)  # another prompt: no hint
    assert routes.order(TARGETS, other) == TARGETS


def test_a_prefix_counts_only_from_the_first_block():
    routes, h = PrefixRoutes(), hashes(1, 4)
    routes.record("b", h[1:])  # never the chain's start: not a prefix it holds
    assert routes.order(TARGETS, h) == TARGETS


def test_ties_go_to_the_least_busy_and_a_busy_holder_yields():
    routes, h = PrefixRoutes(max_skew=2), hashes(1, 2)
    routes.started("a")
    assert routes.order(TARGETS, h) == ["b", "c", "a"]  # tie on prefix: load decides
    routes.record("a", h)
    assert routes.order(TARGETS, h)[0] == "a"  # one more in flight is within the skew
    routes.started("a")
    routes.started("a")  # 3 in flight against 0: past the skew
    assert routes.order(TARGETS, h) == ["b", "c", "a"]
    for _ in range(3):
        routes.finished("a")
    assert routes.order(TARGETS, h)[0] == "a"


def test_the_oldest_hashes_are_forgotten_past_capacity():
    routes = PrefixRoutes(capacity=4)
    first, second = hashes(1, 4), hashes(2, 4)
    routes.record("c", first)
    routes.record("b", second)
    assert routes.order(TARGETS, first) == TARGETS
    assert routes.order(TARGETS, second)[0] == "b"


@pytest.mark.parametrize("size", [1, 16, 64, 128, 256, 544])
@pytest.mark.parametrize("length", [1, 100, 700, 4096])
def test_the_block_size_is_recovered_from_a_tickets_hashes(size, length):
    prompt = [random.Random(length).randrange(512) for _ in range(length)]
    h = block_hashes(prompt, size)
    learned = learn_block_size(prompt, h, -(-length // size))
    assert learned == (size if h else 0)
