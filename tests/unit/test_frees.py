"""FreeQueue: jobs run off the caller's thread, in order; one failing stops none."""

from __future__ import annotations

import threading

from transfer.serving.engine.frees import FreeQueue


def test_jobs_run_in_order_off_the_callers_thread_and_survive_a_failure():
    frees = FreeQueue("test-frees")
    gate, ran, threads = threading.Event(), [], set()

    def job(k: int):
        def run():
            gate.wait(10)
            threads.add(threading.current_thread().name)
            if k == 2:
                raise RuntimeError("a free failed")
            ran.append(k)

        return run

    for k in range(5):
        frees.put(job(k))
    assert not frees.wait_idle(0.05)  # held at the gate: put never waits for a job
    gate.set()
    assert frees.wait_idle(10)
    assert ran == [0, 1, 3, 4] and threads == {"test-frees"}
    frees.put(job(5))
    frees.close()  # runs what was put first
    assert ran[-1] == 5


def test_a_key_stays_busy_until_its_jobs_have_run():
    frees = FreeQueue("test-frees-keys")
    gate = threading.Event()
    frees.put(lambda: gate.wait(10), key="a")
    frees.put(lambda: None, key="b")  # behind a's job
    frees.put(lambda: None, key="a")
    assert not frees.wait_for("a", 0.05) and not frees.wait_for("b", 0.05)
    assert frees.wait_for("never-put", 0)
    gate.set()
    assert frees.wait_for("a", 10) and frees.wait_for("b", 10)
    frees.put(lambda: 1 / 0, key="c")  # a failed job frees its key too
    assert frees.wait_for("c", 10)
    frees.close()
