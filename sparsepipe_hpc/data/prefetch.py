"""Read and voxelize the next training batch on a host thread while this step computes.

    ahead = Prefetcher(load)                # load(indices, epoch) -> batch: host work only
    batch = ahead.get(indices, epoch)       # the batch read ahead if it is this one, else now
    ahead.start(next_indices, next_epoch)   # read that one while the step runs
    ahead.close()                           # or: with Prefetcher(load) as ahead: ...

On a GPU the device runs a step's kernels while the host is free (it only waits where it reads a
result back), so without this the device idles while the host reads, augments and voxelizes the
next step's samples. One worker thread, one batch ahead. A batch is the same whichever thread
makes it (augmentation draws from per-sample generators seeded by (seed, epoch, sample), no shared
state), so runs with and without it agree bit for bit. An exception raised while reading is raised
by :meth:`Prefetcher.get` for the batch that needs it, as a read on the main thread would raise it;
a batch read for a step that never comes (the run stopped) is dropped. Never more than one read
at a time: ``get`` for another batch first lets the pending read finish, so a data set is never
read by two threads at once.

``load`` must not communicate: ranks would issue MPI calls from two threads in an order no other
rank shares. The trainer reads ahead only whole samples (``--input whole``), never the
distributed input, whose reading is collective.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

__all__ = ["Prefetcher"]

B = TypeVar("B")
Key = tuple[tuple[int, ...], Optional[int]]


class Prefetcher(Generic[B]):
    """One batch read ahead on a worker thread; see the module docstring."""

    def __init__(self, load: Callable[[list[int], Optional[int]], B]) -> None:
        self._load = load
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sparsepipe-prefetch")
        self._pending: Optional[tuple[Key, Future[B]]] = None
        self.hits = 0    # batches that came from the worker
        self.misses = 0  # batches read on the caller's thread

    @staticmethod
    def _key(indices: Sequence[int], epoch: Optional[int]) -> Key:
        return tuple(int(i) for i in indices), epoch

    def start(self, indices: Sequence[int], epoch: Optional[int]) -> None:
        """Begin reading the batch of ``indices`` (sample indices) for ``epoch`` on the worker,
        unless it is being read already; a pending read of another batch is dropped."""
        key = self._key(indices, epoch)
        if self._pending is not None and self._pending[0] == key:
            return
        self._drop_pending()
        if self._pool is None:
            raise RuntimeError("Prefetcher.start after close()")
        self._pending = (key, self._pool.submit(self._load, list(key[0]), epoch))

    def get(self, indices: Sequence[int], epoch: Optional[int]) -> B:
        """The batch of ``indices`` for ``epoch``: the one read ahead when it is this one (its
        read's exception, if any, is raised here), else read now on this thread."""
        key = self._key(indices, epoch)
        if self._pending is not None and self._pending[0] == key:
            _, future = self._pending
            self._pending = None
            self.hits += 1
            return future.result()
        self._drop_pending()
        self.misses += 1
        return self._load(list(key[0]), epoch)

    def _drop_pending(self) -> None:
        """Let a pending read finish and forget it (its batch or exception is not wanted)."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = None
            future.exception()  # waits; a read that failed for a step never taken raises nothing

    def close(self) -> None:
        """Wait for a pending read and stop the worker (idempotent)."""
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "Prefetcher[B]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
