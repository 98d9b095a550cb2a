"""An instance that answered UNAVAILABLE is tried after the others until its mark lapses,
then in turn again (so a restarted instance gets requests back)."""

from __future__ import annotations

from transfer.serving.openai import instance_pool
from transfer.serving.openai.router import Router

DEAD, LIVE = "127.0.0.1:2", "127.0.0.1:3"


def _firsts(pool, calls: int = 4) -> set[str]:
    return {pool.up_first(pool.order())[0][0] for _ in range(calls)}


def test_a_down_instance_goes_last_until_its_mark_lapses(monkeypatch):
    # Nothing listens on these addresses; only the pool's ordering is exercised.
    router = Router(["127.0.0.1:1"], [DEAD, LIVE])
    try:
        pool = router._decode
        assert _firsts(pool) == {DEAD, LIVE}  # in turn
        pool.mark_down(DEAD)
        assert _firsts(pool) == {LIVE}
        assert [t for t, _ in pool.up_first(pool.order())] == [LIVE, DEAD]  # still tried
        monkeypatch.setattr(instance_pool, "DOWN_S", 0.0)
        pool.mark_down(DEAD)  # a mark that has already lapsed
        assert _firsts(pool) == {DEAD, LIVE}
    finally:
        router.close()
