"""Strided layers' kernel maps built on a side CUDA stream, so that their one host read does not
drain the compute stream.

    y = net(x)                       # on by default on CUDA
    with mapstream.aside(False):     # maps on the compute stream: the same maps, rows, results
        y = net(x)

A strided layer's map (:func:`halo.kmap.strided_map`) reads one small tensor back to the host: the
number of outputs, which sizes them. On the compute stream that read waits for every convolution
queued before it; the GPU then idles while the host finishes the map and queues the next layers
(three times in a depth-4 U-Net step)::

    compute  | conv conv conv |  idle: host builds the map  | conv ...     (inline)
    compute  | conv conv conv conv conv ...                               (aside)
    side           | map ... read | rest of map |    -> event: compute waits for it

Aside, the map's kernels run on a high-priority side stream that waits only for the coordinates
it reads, so the host read waits for the map's own kernels while the queued convolutions run on;
the compute stream then waits for the finished map through an event, never the host. A tensor's
coordinates are ready on the side stream from an event recorded when a layer first met the tensor
(:func:`note`, before anything of this forward pass was queued) or when a map built aside made
them; coordinates with neither make the side stream wait for everything queued, which is
today's cost: a pipeline stage's received coordinates (their maps are rebuilt on arrival), a
distributed layer whose outputs needed an ownership test (itself a device read). Memory crossing
streams is marked with ``record_stream`` for torch's caching allocator; the side stream keeps a
pool of its own there (the maps' scratch memory is cached apart from the compute stream's).

CUDA only and for maps built without communication (one rank, or a box whose strided layer needs
no halo); elsewhere :func:`strided_map` is :func:`halo.kmap.strided_map`. On by default since an
H200 timed it (``bench gpu``, issue 10's scene, paired per round against maps on the compute
stream): the U-Net step's median ratio 1.000 (fp16) and 0.963 (fp32), the 1x1x1 distributed
model's 0.991 and 0.983, at the same memory; ``bench gpu`` keeps timing the ``inline`` variant.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from halo import kmap
from halo.kmap import KernelMap

__all__ = ["ASIDE", "aside", "note", "strided_map", "coords_version"]

ASIDE = True  # build strided maps on the side stream (CUDA); see the module docstring

# coords tensor -> (the event after which it is ready to read, its version counter then).
_ready: WeakIdKeyDictionary = WeakIdKeyDictionary()
_streams: dict[int, torch.cuda.Stream] = {}


@contextlib.contextmanager
def aside(on: bool = True) -> Iterator[None]:
    """Within the block, strided maps on CUDA are (``on``) or are not built on the side stream."""
    global ASIDE
    saved, ASIDE = ASIDE, on
    try:
        yield
    finally:
        ASIDE = saved


def _active(coords: torch.Tensor) -> bool:
    return ASIDE and coords.is_cuda


def note(coords: torch.Tensor) -> None:
    """Record that ``coords`` is ready as of now on the current stream: a layer calls this when it
    first meets a tensor (its ``kmaps`` still empty), before it queues any work on it. Called
    again for the same coordinates (a new tensor made on them), the record is renewed, or dropped
    where it cannot be made (aside off, or a CUDA graph being captured). The layers refuse
    coordinates written in place after they built a map on them (:func:`~.kmaps.cached_entry`),
    but a strided layer meeting them first does not check: so the record keeps their version
    counter, and coordinates written since make the side stream wait for everything queued."""
    if not coords.is_cuda:
        return
    if ASIDE and not torch.cuda.is_current_stream_capturing():
        _ready[coords] = (torch.cuda.current_stream(coords.device).record_event(),
                          coords_version(coords))
    else:
        _ready.pop(coords, None)


def coords_version(coords: torch.Tensor) -> Optional[int]:
    """``coords``' version counter (torch counts its writes in place); None for an inference
    tensor, which has none."""
    try:
        return int(coords._version)
    except RuntimeError:
        return None


def _side(device: torch.device) -> torch.cuda.Stream:
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _streams:
        # The highest priority torch offers (it maps a value past its range to the nearest end;
        # the compute and transport streams have priority 0): a free SM takes the map's small
        # kernels first.
        _streams[index] = torch.cuda.Stream(index, priority=-64)
    return _streams[index]


def strided_map(in_coords: torch.Tensor, kernel_size: int | Sequence[int],
                stride: int | Sequence[int], padding: int | Sequence[int],
                dilation: int | Sequence[int], out_shape: Sequence[int],
                batch_size: Optional[int] = None) -> tuple[torch.Tensor, KernelMap]:
    """:func:`halo.kmap.strided_map` (same arguments, same result), built on the side stream where
    :data:`ASIDE` is on and ``in_coords`` is on a CUDA device; the current stream waits for it
    through an event before any work queued after this call."""
    geometry = (kernel_size, stride, padding, dilation, out_shape, batch_size)
    if not _active(in_coords):
        return kmap.strided_map(in_coords, *geometry)
    compute = torch.cuda.current_stream(in_coords.device)
    side = _side(in_coords.device)
    ready = _ready.get(in_coords)
    if ready is None or ready[1] is None or ready[1] != coords_version(in_coords):
        side.wait_stream(compute)  # whatever is queued may be what writes them
    else:
        side.wait_event(ready[0])
    # The caching allocator frees a block for reuse on the stream that allocated it: keep each
    # block that the other stream reads until that stream's queued work is done (before the
    # build: should it raise, its queued kernels may still read the coordinates).
    in_coords.record_stream(side)
    with torch.cuda.stream(side):
        out, km = kmap.strided_map(in_coords, *geometry)
        done = side.record_event()
    compute.wait_event(done)
    for t in (out, km.in_rows, km.out_rows, km._offsets):
        if t is not None:
            t.record_stream(compute)
    _ready[out] = (done, coords_version(out))
    return out, km
