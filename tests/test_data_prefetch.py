"""Prefetcher: the next batch read on a worker thread, the same batch as a read on the caller's."""

from __future__ import annotations

import threading
import time

import pytest

from sparsepipe_hpc.data.prefetch import Prefetcher


class Reads:
    """A load that records its thread, fails where told, and checks it never runs twice at once."""

    def __init__(self, fail=(), delay=0.0):
        self.fail, self.delay = set(fail), delay
        self.threads: list[tuple[tuple[int, ...], str]] = []
        self._busy = threading.Lock()

    def __call__(self, indices, epoch):
        assert self._busy.acquire(blocking=False), "two reads at once"
        try:
            time.sleep(self.delay)
            self.threads.append((tuple(indices), threading.current_thread().name))
            if tuple(indices) in self.fail:
                raise ValueError(f"bad sample in {indices}")
            return ("batch", tuple(indices), epoch)
        finally:
            self._busy.release()


def test_the_batch_read_ahead_is_the_one_asked_for():
    load = Reads(delay=0.01)
    with Prefetcher(load) as ahead:
        assert ahead.get([0, 1], 0) == ("batch", (0, 1), 0)  # nothing ahead: read here
        ahead.start([2, 3], 0)
        assert ahead.get([2, 3], 0) == ("batch", (2, 3), 0)
        ahead.start([4, 5], 1)
        ahead.start([4, 5], 1)  # already on its way: not read twice
        assert ahead.get([4, 5], 1) == ("batch", (4, 5), 1)
        assert (ahead.hits, ahead.misses) == (2, 1)
    main = threading.current_thread().name
    assert [(i, t == main) for i, t in load.threads] == [((0, 1), True), ((2, 3), False),
                                                         ((4, 5), False)]


def test_another_batch_waits_for_the_pending_read_then_reads_here():
    load = Reads(delay=0.05)  # the pending read is still running when get() asks for another
    with Prefetcher(load) as ahead:
        ahead.start([7], 0)
        assert ahead.get([8], 0) == ("batch", (8,), 0)  # Reads asserts no overlap
        assert ahead.get([7], 0) == ("batch", (7,), 0)  # dropped: read again, here
        ahead.start([9], 0)
        assert ahead.get([9], 1) == ("batch", (9,), 1)  # another epoch is another batch
    assert [i for i, _ in load.threads] == [(7,), (8,), (7,), (9,), (9,)]


def test_a_failed_read_raises_for_the_step_that_needs_it_only():
    load = Reads(fail=[(3,)])
    with Prefetcher(load) as ahead:
        ahead.start([3], 0)
        with pytest.raises(ValueError, match=r"bad sample in \[3\]"):
            ahead.get([3], 0)
        ahead.start([3], 0)
        assert ahead.get([4], 0) == ("batch", (4,), 0)  # the failed read was not wanted


def test_close_waits_and_is_final():
    load = Reads(delay=0.05)
    ahead = Prefetcher(load)
    ahead.start([1], 0)
    ahead.close()
    assert load.threads and load.threads[0][0] == (1,)  # close let the read finish
    ahead.close()
    with pytest.raises(RuntimeError, match="after close"):
        ahead.start([2], 0)
