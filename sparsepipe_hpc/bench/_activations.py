"""Bytes of activations autograd keeps for backward, live and at their peak (one process).

    meter = SavedTensorMeter(exclude=model.parameters())
    with meter:                         # every tensor saved for backward in here is counted
        loss = model(x).feats.sum()     # meter.live_bytes grows with the saved activations
        loss.backward()                 # ... and falls as backward frees the graph
    meter.peak_bytes

What is counted: the storages of the tensors autograd saves for backward (``save_for_backward``
of custom Functions and every built-in op), each storage once however many ops save it, while
a graph that holds them is alive; parameters (``exclude``) are not activations and are left out.
This is the memory a pipeline schedule decides (GPipe keeps m micro-batches' graphs, 1F1B at most
S-s on stage s), measured exactly and without allocator noise, which RSS (allocator caching,
``ru_maxrss`` only grows) and tracemalloc (it does not see torch's allocations) cannot give. Not
counted: tensors a Function keeps as plain attributes (kernel maps), and buffers that are alive
but not saved (a stage's received inputs before their forward runs).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["SavedTensorMeter"]


def _key(t: torch.Tensor) -> tuple[int, int]:
    """(storage address, storage bytes): one entry per storage, shared by its views."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # layouts without a plain storage
        return id(t), t.numel() * t.element_size()


class _Held:
    """What the pack hook returns: holds the tensor, and releases its count when autograd drops
    the graph that saved it (CPython frees it at once: refcounting)."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: "SavedTensorMeter"):
        self.tensor, self.key, self.meter = tensor, key, meter
        meter._acquire(key)

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Counts saved-for-backward storages while active (a context manager; one block at a time)."""

    def __init__(self, exclude: Optional[Iterable[torch.Tensor]] = None):
        self._excluded = {_key(p)[0] for p in (exclude or ())}
        self._counts: dict[tuple[int, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks: Optional[Any] = None

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak_bytes = self.live_bytes

    def _acquire(self, key: tuple[int, int]) -> None:
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        if n == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: tuple[int, int]) -> None:
        n = self._counts.pop(key, 0) - 1
        if n > 0:
            self._counts[key] = n
        elif n == 0:
            self.live_bytes -= key[1]

    def _pack(self, t: torch.Tensor) -> Any:
        key = _key(t)
        if key[0] in self._excluded:
            return t
        return _Held(t, key, self)

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.tensor if isinstance(h, _Held) else h

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)
