"""backend.locks.ModeLock: the colocation modes. Holders of one mode run together, a switch
runs once and only when the other mode's holders have left, waiting modes are not starved, a
failed switch leaves the mode unknown (the next holder switches again)."""

from __future__ import annotations

import threading
import time

import pytest

from floe.backend.locks import ModeLock


def test_same_mode_holders_overlap_and_switch_runs_once() -> None:
    switches: list[str] = []
    lock = ModeLock(switches.append)
    inside = threading.Barrier(3, timeout=5)

    def hold() -> None:
        with lock.hold("sample"):
            inside.wait()  # all three inside at once: no switch between them

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert switches == ["sample"] and lock.mode == "sample"


def test_other_mode_waits_for_holders_and_newcomers_wait_for_it() -> None:
    events: list[str] = []
    lock = ModeLock(lambda mode: events.append(f"switch:{mode}"))
    first_in = threading.Event()
    release_first = threading.Event()

    def sampler() -> None:
        with lock.hold("sample"):
            events.append("sample-1 in")
            first_in.set()
            release_first.wait(5)
            events.append("sample-1 out")

    def trainer() -> None:
        with lock.hold("train"):
            events.append("train in")

    def late_sampler() -> None:
        with lock.hold("sample"):
            events.append("sample-2 in")

    s1 = threading.Thread(target=sampler)
    s1.start()
    assert first_in.wait(5)
    t = threading.Thread(target=trainer)
    t.start()
    time.sleep(0.2)  # the trainer is waiting now
    s2 = threading.Thread(target=late_sampler)
    s2.start()
    time.sleep(0.2)
    assert "sample-2 in" not in events  # a waiting mode goes first: newcomers of the current one wait
    release_first.set()
    for th in (s1, t, s2):
        th.join(5)
    assert events == ["switch:sample", "sample-1 in", "sample-1 out", "switch:train", "train in",
                      "switch:sample", "sample-2 in"]


def test_a_failed_switch_leaves_the_mode_unknown_and_the_next_holder_switches_again() -> None:
    calls: list[str] = []

    def switch(mode: str) -> None:
        calls.append(mode)
        if len(calls) == 2:
            raise RuntimeError("wake failed")

    lock = ModeLock(switch)
    with lock.hold("train"):
        pass
    with pytest.raises(RuntimeError, match="wake failed"), lock.hold("sample"):
        pass
    assert lock.mode is None
    with lock.hold("sample"):
        assert lock.mode == "sample"
    assert calls == ["train", "sample", "sample"]
