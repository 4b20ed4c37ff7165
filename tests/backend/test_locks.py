"""The sampler's shared/exclusive lock: shared holders together, exclusive alone, and a
waiting exclusive holder is not starved by later shared ones."""

from __future__ import annotations

import threading
import time

from floe.backend.locks import SharedLock


def test_shared_together_exclusive_waits_and_goes_before_later_shared():
    lock = SharedLock()
    events: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def first_reader():
        with lock.shared():
            events.append("reader1 in")
            first_in.set()
            release_first.wait(timeout=30)
            events.append("reader1 out")

    def writer():
        with lock.exclusive():
            events.append("writer in")
            time.sleep(0.05)
            events.append("writer out")

    def late_reader():
        with lock.shared():
            events.append("reader2 in")

    r1 = threading.Thread(target=first_reader)
    r1.start()
    assert first_in.wait(timeout=30)
    with lock.shared():  # a second shared holder gets in while the first holds it
        events.append("main shared")
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.1)  # the writer is now waiting for reader1
    r2 = threading.Thread(target=late_reader)
    r2.start()
    time.sleep(0.1)
    assert events == ["reader1 in", "main shared"]  # writer waits; the late reader waits behind it
    release_first.set()
    for t in (r1, w, r2):
        t.join(timeout=30)
    assert events == ["reader1 in", "main shared", "reader1 out", "writer in", "writer out", "reader2 in"]
