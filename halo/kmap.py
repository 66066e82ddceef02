"""Kernel maps: which input voxel feeds which output voxel through which kernel offset.

    km = kernel_map(in_coords, out_coords, kernel_size=3, stride=1, padding=1, dilation=1)
    km.pairs(k)   # (in_rows, out_rows) of offset k, int64 [P_k] each

For output ``o`` and offset ``k = (kx, ky, kz)`` (flattened x-major, ``k = (kx*K + ky)*K + kz``,
spconv's weight order), the input is ``i = o * stride - padding + k * dilation``. A submanifold
3x3x3 convolution is ``stride=1, padding=1`` with ``out_coords = in_coords``::

    offset k=13 is the centre (0,0,0)      o-1   o   o+1     (one axis; i = o - 1 + kx)
                                            kx=0  kx=1 kx=2

Coordinates are int32 [N, 4] (batch, x, y, z) in global voxel indices, so maps built on different
ranks agree. Lookup sorts int64 keys and binary-searches them (``torch.searchsorted``): pure torch,
the same on CPU and GPU, deterministic.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

__all__ = ["KernelMap", "kernel_map", "kernel_offsets", "output_coords", "strided_map", "coord_keys",
           "decode_keys", "lookup", "value_counts", "true_at", "windows_tile", "MAX_EXTENT",
           "MAX_BATCH"]

_BITS = 18  # bits per spatial axis: coordinates in [-2**17, 2**17); batch index below 2**9
# What the keys are used for: grids of up to MAX_EXTENT voxels per axis, with room for a kernel's
# reach and padding past either face, and up to MAX_BATCH samples.
MAX_EXTENT = 1 << 16
MAX_BATCH = 1 << 8
_HALF = 1 << (_BITS - 1)
_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2])
_QUERY_BLOCK = 1 << 24  # kernel-map lookups per group of offsets (~0.5 GB of int64 work arrays)


def _triple(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (v, v, v) if isinstance(v, int) else tuple(int(a) for a in v)
    if len(t) != 3:
        raise ValueError(f"expected an int or 3 ints; got {v!r}")
    return t  # type: ignore[return-value]


def coord_keys(coords: torch.Tensor) -> torch.Tensor:
    """int64 [N] keys, ordered like (batch, x, y, z) lexicographically; coords int [N, 4]."""
    c = coords.long()
    key = c[:, 0]
    for a in range(1, 4):
        key = (key << _BITS) | (c[:, a] + _HALF)
    return key


def lookup(table_keys_sorted: torch.Tensor, order: torch.Tensor,
           query: torch.Tensor) -> torch.Tensor:
    """Rows of ``query`` keys in the table (sorted keys + permutation back to rows); -1 if absent."""
    if len(table_keys_sorted) == 0:
        return torch.full_like(query, -1)
    pos = torch.searchsorted(table_keys_sorted, query).clamp_(max=len(table_keys_sorted) - 1)
    found = table_keys_sorted[pos] == query
    return torch.where(found, order[pos], torch.full_like(pos, -1))


def value_counts(index: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n] on ``index``'s device: how often each of 0..n-1 occurs in ``index`` (int64, all
    in range). ``torch.bincount`` gives the same, but on CUDA it first reads the input's minimum
    and maximum back to the host: two device syncs."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index, torch.ones_like(index))


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, copied without synchronizing the device (a blocking
    host-to-device copy waits for the stream)."""
    return t.to(device, non_blocking=True)


def kernel_offsets(kernel_size: int | Sequence[int]) -> torch.Tensor:
    """int64 [K, 3] kernel offsets (kx, ky, kz) in spconv's weight order."""
    ks = _triple(kernel_size)
    return torch.tensor(list(itertools.product(*(range(k) for k in ks))), dtype=torch.int64)


@dataclass
class KernelMap:
    """Pairs (input row, output row) grouped by kernel offset (CSR by offset).

    in_rows, out_rows: int64 [P]; ptr: int64 [K + 1] with offset k's pairs at ptr[k]:ptr[k+1]
    (a CPU tensor). n_in, n_out: row counts of the input and output tensors the rows index.
    """

    in_rows: torch.Tensor
    out_rows: torch.Tensor
    ptr: torch.Tensor
    n_in: int
    n_out: int
    _spconv: Optional[tuple] = field(default=None, repr=False, compare=False)
    _transposed: Optional["KernelMap"] = field(default=None, repr=False, compare=False)
    _bounds: Optional[list[int]] = field(default=None, repr=False, compare=False)
    # engine.spconv_igemm's tables (an object with a ``transposed()``: the transpose's tables).
    _igemm: Optional[Any] = field(default=None, repr=False, compare=False)
    # Each pair's offset [P] (any integer dtype) where the builder had it: strided_map's sort
    # leaves it, so pair_offsets needs no repeat_interleave (a slow kernel on CUDA).
    _offsets: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def num_offsets(self) -> int:
        return len(self.ptr) - 1

    @property
    def bounds(self) -> list[int]:
        """``ptr`` as Python ints, read once (each ``int()`` of an element is a torch op: a
        U-Net step read ~200 of them)."""
        if self._bounds is None:
            self._bounds = self.ptr.tolist()
        return self._bounds

    @property
    def num_pairs(self) -> int:
        return self.bounds[-1]

    def pair_offsets(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """int64 [P]: each pair's kernel offset, on ``device`` (default: the rows'), built
        without waiting for the device."""
        dev = self.in_rows.device if device is None else device
        if self._offsets is not None:
            return self._offsets.to(dev, torch.int64)
        return torch.repeat_interleave(torch.arange(self.num_offsets, device=dev),
                                       _on(self.ptr, dev).diff(), output_size=self.num_pairs)

    def pairs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.bounds[k], self.bounds[k + 1]
        return self.in_rows[a:b], self.out_rows[a:b]

    def transpose(self) -> "KernelMap":
        """The map of the transposed (inverse) convolution: inputs and outputs swap roles."""
        if self._transposed is None:  # kept, so its spconv layout is built once too
            t = KernelMap(self.out_rows, self.in_rows, self.ptr, self.n_out, self.n_in,
                          _offsets=self._offsets)
            if self._spconv is not None:  # the same table, its two rows swapped
                pairs, counts = self._spconv
                t._spconv = (pairs.flip(0), counts)
            if self._igemm is not None:
                t._igemm = self._igemm.transposed()
            self._transposed = t
        return self._transposed

    def select(self, keep: torch.Tensor, n_in: Optional[int] = None,
               in_rows: Optional[torch.Tensor] = None) -> "KernelMap":
        """The pairs where ``keep [P]`` is true, optionally with input rows renumbered.

        Per-offset counts come from one segment sum and one copy to the host (no sync per offset).
        """
        dev = keep.device
        offset_of_pair = self.pair_offsets(dev)
        counts = torch.zeros(self.num_offsets, dtype=torch.int64, device=dev)
        counts.index_add_(0, offset_of_pair, keep.long())
        ptr = torch.zeros(self.num_offsets + 1, dtype=torch.int64)
        ptr[1:] = torch.cumsum(counts.cpu(), 0)
        rows = self.in_rows[keep] if in_rows is None else in_rows[keep]
        return KernelMap(rows, self.out_rows[keep], ptr,
                         self.n_in if n_in is None else n_in, self.n_out)

    def spconv_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """spconv's layout: pairs int32 [2, K, L] (0: input rows, 1: output rows) on the rows'
        device, counts int32 [K] on the host, where spconv reads them (it copies device counts
        back at every call: a device sync per convolution)."""
        if self._spconv is None:
            counts = (self.ptr[1:] - self.ptr[:-1]).to(torch.int32)
            width = max(int(counts.max()) if len(counts) else 0, 1)
            dev = self.in_rows.device
            pairs = torch.full((2, self.num_offsets, width), -1, dtype=torch.int32, device=dev)
            k = self.pair_offsets()
            pos = torch.arange(self.num_pairs, device=dev) - _on(self.ptr, dev)[k]
            pairs[0, k, pos] = self.in_rows.int()
            pairs[1, k, pos] = self.out_rows.int()
            self._spconv = (pairs, counts.contiguous())
        return self._spconv


def kernel_map(in_coords: torch.Tensor, out_coords: torch.Tensor,
               kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0,
               dilation: int | Sequence[int] = 1, *,
               offsets_per_pass: Optional[int] = None) -> KernelMap:
    """All (input, output, offset) triples with ``in = out * stride - padding + offset * dilation``.

    in_coords int [N_in, 4], out_coords int [N_out, 4]: global voxel indices at the input's and the
    output's stride respectively; rows need not be sorted. ``offsets_per_pass``: kernel offsets
    looked up together (default: all that fit a work-array budget on a GPU, one on the CPU); the
    map is the same for any value. A kernel equal to its stride takes one lookup per input instead.
    """
    if windows_tile(kernel_size, stride, dilation):
        return _window_map(in_coords, out_coords, _triple(stride), _triple(padding))
    s, p, d = (_on(torch.tensor(_triple(v), dtype=torch.int64), out_coords.device)
               for v in (stride, padding, dilation))
    offsets = _on(kernel_offsets(kernel_size), out_coords.device)
    keys = coord_keys(in_coords)
    sorted_keys, order = torch.sort(keys)
    out = out_coords.long()
    base = out[:, 1:] * s - p
    n_out, n_k = len(out), len(offsets)
    # On a GPU, every offset's queries at once ([k, N] keys, offset-major so hits come out CSR by
    # offset), in groups bounding the work arrays: one host sync per group (its per-offset hit
    # counts), not one per offset. On the CPU,
    # where a sync costs nothing, one offset at a time measured 1.5x faster (cache-sized arrays).
    group = offsets_per_pass or (max(1, _QUERY_BLOCK // max(n_out, 1)) if out.is_cuda else 1)
    in_rows, out_rows, counts = [], [], []
    for g0 in range(0, n_k, group):
        off = offsets[g0:g0 + group]
        q = base[None] + (off * d)[:, None]                           # [g, N, 3]
        qk = coord_keys(torch.cat([out[None, :, :1].expand(len(off), -1, -1), q], 2)
                        .reshape(-1, 4)).view(len(off), n_out)
        rows = lookup(sorted_keys, order, qk.reshape(-1))
        hit = rows >= 0
        n_hit = hit.view(len(off), n_out).sum(1).cpu()  # the group's one host sync
        counts.append(n_hit)
        # Hits in (offset, output) order; their count known, finding them needs no more syncs.
        flat = true_at(hit, int(n_hit.sum()))
        in_rows.append(rows[flat])
        out_rows.append(flat % n_out)
    ptr = torch.zeros(n_k + 1, dtype=torch.int64)
    if counts:
        ptr[1:] = torch.cumsum(torch.cat(counts), 0)
    empty = torch.zeros(0, dtype=torch.int64, device=out.device)
    return KernelMap(torch.cat(in_rows) if in_rows else empty,
                     torch.cat(out_rows) if out_rows else empty, ptr, len(in_coords),
                     len(out_coords))


def true_at(mask: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: where the 1-D ``mask`` is true, ``count`` being known, so without the device
    sync of ``nonzero`` (``nonzero_static``: on CUDA since torch 2.6)."""
    if count == 0:  # nonzero_static failed on empty CUDA inputs before torch 2.9
        return torch.zeros(0, dtype=torch.int64, device=mask.device)
    if mask.is_cuda and _TORCH < (2, 6):
        return mask.nonzero().squeeze(1)
    return torch.nonzero_static(mask, size=count).squeeze(1)


def windows_tile(kernel_size: int | Sequence[int], stride: int | Sequence[int],
                 dilation: int | Sequence[int]) -> bool:
    """Kernel equal to stride, no dilation (a U-Net's k2s2): the windows tile the grid, so every
    input lies in exactly one output's window, at one offset."""
    return _triple(kernel_size) == _triple(stride) and _triple(dilation) == (1, 1, 1)


def _window(c: torch.Tensor, s: tuple[int, int, int], p: tuple[int, int, int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """For tiling windows: each input's output ``o = floor((i + p) / s)`` int64 [N, 3] and its
    flat offset ``k`` int64 [N] (``i + p - o * s`` in spconv's order); ``c`` int64 [N, 4]."""
    sp = [_on(torch.tensor(v, dtype=torch.int64), c.device) for v in (s, p)]
    shifted = c[:, 1:] + sp[1]
    o = torch.div(shifted, sp[0], rounding_mode="floor")
    off = shifted - o * sp[0]
    return o, (off[:, 0] * s[1] + off[:, 1]) * s[2] + off[:, 2]


def _window_map(in_coords: torch.Tensor, out_coords: torch.Tensor, s: tuple[int, int, int],
                p: tuple[int, int, int]) -> KernelMap:
    """:func:`kernel_map` for tiling windows: one lookup per input (of its output) instead of one
    per output and offset; pairs in the same order (by offset, then output row)."""
    c = in_coords.long()
    o, k = _window(c, s, p)
    sorted_keys, order = torch.sort(coord_keys(out_coords))
    rows = lookup(sorted_keys, order, coord_keys(torch.cat([c[:, :1], o], 1)))
    hit = rows >= 0
    n_k = s[0] * s[1] * s[2]
    # Each offset's hits counted (misses in an extra bin) and read in one copy: the one host
    # sync; their total then finds the hits without another.
    counts = value_counts(torch.where(hit, k, n_k), n_k + 1)[:n_k].cpu()
    in_rows = true_at(hit, int(counts.sum()))
    out_rows, k = rows[in_rows], k[in_rows]
    # An output has at most one input per offset: (offset, output row) orders the pairs fully.
    perm = torch.argsort(k * len(out_coords) + out_rows)
    ptr = torch.zeros(n_k + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    return KernelMap(in_rows[perm], out_rows[perm], ptr, len(in_coords), len(out_coords))


def output_coords(in_coords: torch.Tensor, kernel_size: int | Sequence[int],
                  stride: int | Sequence[int], padding: int | Sequence[int],
                  dilation: int | Sequence[int], out_shape: Sequence[int], *,
                  offsets_per_pass: Optional[int] = None) -> torch.Tensor:
    """Active outputs of a strided (non-submanifold) convolution: int32 [M, 4], sorted by key.

    An output ``o`` in ``[0, out_shape)`` is active when some input reaches it, i.e.
    ``o = (i + padding - offset * dilation) / stride`` is integral for an input ``i``.
    ``offsets_per_pass``: as in :func:`kernel_map`; the result is the same for any value.
    """
    dev = in_coords.device
    shape = _on(torch.tensor(list(out_shape), dtype=torch.int64), dev)
    c = in_coords.long()
    if windows_tile(kernel_size, stride, dilation):
        o, _ = _window(c, _triple(stride), _triple(padding))
        ok = ((o >= 0) & (o < shape)).all(1)
        return decode_keys(torch.unique(coord_keys(torch.cat([c[:, :1], o], 1)[ok])))
    s, p, d = (_on(torch.tensor(_triple(v), dtype=torch.int64), dev)
               for v in (stride, padding, dilation))
    offsets = _on(kernel_offsets(kernel_size), dev)
    # Offsets in groups, as in kernel_map: on a GPU one boolean selection (one host sync) per
    # group bounded by _QUERY_BLOCK, not one per offset; on the CPU one offset at a time.
    group = offsets_per_pass or (max(1, _QUERY_BLOCK // max(len(c), 1)) if c.is_cuda else 1)
    cands = []
    for g0 in range(0, len(offsets), group):
        off = offsets[g0:g0 + group]
        num = c[None, :, 1:] + p - (off * d)[:, None]                     # [g, N, 3]
        o = torch.div(num, s, rounding_mode="floor")
        ok = ((o * s == num) & (o >= 0) & (o < shape)).all(2)             # [g, N]
        cands.append(torch.cat([c[None, :, :1].expand(len(off), -1, -1)[ok], o[ok]], 1))
    if not cands:
        return torch.zeros(0, 4, dtype=torch.int32, device=in_coords.device)
    allc = torch.cat(cands)
    keys = torch.unique(coord_keys(allc))
    return decode_keys(keys)


def strided_map(in_coords: torch.Tensor, kernel_size: int | Sequence[int],
                stride: int | Sequence[int], padding: int | Sequence[int],
                dilation: int | Sequence[int], out_shape: Sequence[int],
                batch_size: Optional[int] = None) -> tuple[torch.Tensor, KernelMap]:
    """``(out, kernel_map(in_coords, out, ...))`` with ``out = output_coords(in_coords, ...)``,
    equal to those two calls.

    Where windows tile the grid (kernel = stride, a U-Net's k2s2) it takes one pass: the sort
    that finds the active outputs also gives each input its output row, so there is no lookup,
    and a GPU waits once (the outputs' and the per-offset counts together) instead of six times.
    ``batch_size`` (read where windows tile): the batch indices must lie in ``[0, batch_size)``
    (ValueError otherwise), and where ``batch_size x out_shape`` voxels number under 2**31 that
    pass sorts int32 keys (``((b X + x) Y + y) Z + z``, in :func:`coord_keys`' order): half the
    radix passes of int64 ones on a GPU, 2-3x faster on a CPU.
    """
    if not windows_tile(kernel_size, stride, dilation):
        out = output_coords(in_coords, kernel_size, stride, padding, dilation, out_shape)
        return out, kernel_map(in_coords, out, kernel_size, stride, padding, dilation)
    s = _triple(stride)
    dev = in_coords.device
    c = in_coords.long()
    o, k = _window(c, s, _triple(padding))
    shape = _on(torch.tensor(list(out_shape), dtype=torch.int64), dev)
    ok = ((o >= 0) & (o < shape)).all(1)
    n_k = s[0] * s[1] * s[2]
    narrow = batch_size is not None and batch_size * math.prod(out_shape) < 2**31
    # Inputs whose output lies outside the grid take key -1, below every voxel's (keys are >= 0),
    # so they come first among the outputs and are dropped, and offset n_k, past every real
    # offset, so their pairs sort last (beyond bounds[n_k] below).
    if narrow:
        nx, ny, nz = (int(v) for v in out_shape)
        lin = ((c[:, 0] * nx + o[:, 0]) * ny + o[:, 1]) * nz + o[:, 2]
        keys = torch.where(ok, lin, torch.full_like(lin, -1)).int()
    else:
        keys = torch.where(ok, coord_keys(torch.cat([c[:, :1], o], 1)), torch.full_like(k, -1))
    k = torch.where(ok, k, torch.full_like(k, n_k))
    # Inputs sorted by their output's key are grouped by output, in output order: a new key
    # starts a new output row.
    sorted_keys, by_output = torch.sort(keys)
    first = torch.ones_like(sorted_keys, dtype=torch.bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    # An output has at most one input per offset, so a stable sort by offset of the inputs in
    # output order gives the pairs by (offset, output row); the dropped ones (offset n_k) last.
    # Its keys fit a byte (for strides up to 6): a radix sort of one pass, where sorting
    # (offset, row) as int64 took eight. The sorted offsets give each offset's pairs by binary
    # search (no histogram of atomic adds into n_k bins).
    small = torch.uint8 if n_k < 255 else torch.int32
    offsets, by_offset = torch.sort(k[by_output].to(small), stable=True)
    bounds = torch.searchsorted(offsets, torch.arange(n_k + 1, dtype=small, device=dev))
    # Where each offset's pairs start, the count of distinct keys and of batch indices out of
    # range, in one copy: the one host sync.
    read = [bounds, first.sum().view(1)]
    if batch_size is not None:
        read.append(((c[:, 0] < 0) | (c[:, 0] >= batch_size)).sum().view(1))
    host = torch.cat(read).cpu()
    n_pairs, n_keys = int(host[n_k]), int(host[n_k + 1])
    if batch_size is not None and int(host[n_k + 2]):
        raise ValueError(f"strided_map: {int(host[n_k + 2])} of {len(c)} input rows have a batch "
                         f"index outside [0, batch_size={batch_size})")
    dropped = 1 if n_pairs < len(c) else 0  # the slot of key -1
    # Each output's coordinates are those of the first input sorted to it (no decoding of keys).
    heads = by_output[true_at(first, n_keys)[dropped:]]
    out = torch.cat([c[heads, :1], o[heads]], 1).int()
    row = torch.cumsum(first, 0) - (1 + dropped)  # -1 for the dropped inputs (key -1, first)
    by_offset = by_offset[:n_pairs]
    in_rows = by_output[by_offset]
    ptr = host[:n_k + 1].clone()  # offset j's pairs from its start bounds[j] to bounds[j + 1]
    return out, KernelMap(in_rows, row[by_offset], ptr, len(c), len(out),
                          _offsets=offsets[:n_pairs])


def key_batch(keys: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the batch index of each :func:`coord_keys` key (no [N, 4] decode)."""
    return keys >> (3 * _BITS)


def decode_keys(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`coord_keys`: int32 [N, 4]."""
    mask = (1 << _BITS) - 1
    cols = [keys >> (3 * _BITS)]
    for a in (2, 1, 0):
        cols.append(((keys >> (a * _BITS)) & mask) - _HALF)
    return torch.stack(cols, 1).int()
