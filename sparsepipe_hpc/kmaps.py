"""The kernel-map cache a SparseTensor carries (``x.kmaps``): which voxels a convolution connects.

    spec = ConvSpec(kernel_size=2, stride=2)
    down = serial_entry(x, spec, "down1")           # built once, cached in x.kmaps["down1"]
    down.out_coords, down.local_map(engine)         # the coarse voxels; the map an engine runs
    up = inverse_entry(y, "down1", kernel_size=2)   # the same entry, for the inverse convolution

Every tensor derived from one input shares one ``kmaps`` dict (spconv's ``indice_key``), so a
down-sampling map is built once and its inverse convolution runs it transposed. A spatially
distributed layer builds its entries through :meth:`sparsepipe_hpc.parallel.spatial.SpatialDomain.
entry` instead, with its split maps in :attr:`ConvEntry.extra`; this module is below both the
layers and the parallel code, so neither calls back into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from halo.kmap import KernelMap, kernel_map
from sparsepipe_hpc import mapstream
from sparsepipe_hpc.mapstream import coords_version
from sparsepipe_hpc.engine.base import Engine
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["ConvError", "ConvSpec", "ConvEntry", "cache_key", "cached_entry", "serial_entry",
           "inverse_entry"]


class ConvError(ValueError):
    """A convolution that cannot run on the tensor it was given."""


@dataclass(frozen=True)
class ConvSpec:
    """Geometry of a convolution (voxels at the input's stride)."""

    kernel_size: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    subm: bool = False

    def out_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        if self.subm:
            return shape
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation
        return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in shape)  # type: ignore

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """(kernel_size, stride, padding, dilation), the arguments of :mod:`halo.kmap`."""
        return self.kernel_size, self.stride, self.padding, self.dilation


@dataclass
class ConvEntry:
    """A cached kernel map and the voxel sets it connects (``in`` at stride ``in_stride``)."""

    spec: ConvSpec
    in_coords: torch.Tensor
    out_coords: torch.Tensor
    in_shape: tuple[int, int, int]
    out_shape: tuple[int, int, int]
    in_stride: int
    kmap: Optional[KernelMap] = None
    extra: object = None  # the distributed layer's plan and split maps
    batch_size: int = 1
    native: dict = field(default_factory=dict, repr=False)  # engine name -> its subm map or None
    # in_coords' version counter when built: a write in place since then makes the map stale
    in_version: Optional[int] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.in_version = coords_version(self.in_coords)

    def local_map(self, engine: Engine) -> Any:
        """The map a serial layer runs: for a submanifold convolution the engine's own
        (:meth:`Engine.subm_map`, built once per engine), else the KernelMap (built on first use
        when the engine has none)."""
        s = self.spec
        if s.subm:
            if engine.name not in self.native:
                self.native[engine.name] = engine.subm_map(self.in_coords, self.in_shape,
                                                           self.batch_size, s.kernel_size,
                                                           s.dilation)
            if self.native[engine.name] is not None:
                return self.native[engine.name]
        if self.kmap is None:
            self.kmap = kernel_map(self.in_coords, self.out_coords, *s.geometry)
        return self.kmap


def cache_key(spec: ConvSpec, stride: int, indice_key: Optional[str] = None) -> str:
    """The ``kmaps`` key of a convolution on a tensor at ``stride``: submanifold maps one per
    kernel, dilation and stride (a network has one voxel set per stride), a strided one its
    ``indice_key`` when it has one."""
    if spec.subm:
        return f"subm:k{spec.kernel_size}:d{spec.dilation}:s{stride}"
    return indice_key or (f"conv:k{spec.kernel_size}:s{spec.stride}:p{spec.padding}:"
                          f"d{spec.dilation}@{stride}")


def cached_entry(x: SparseTensor, key: str, spec: ConvSpec,
                 build: Callable[[], ConvEntry]) -> ConvEntry:
    """``x.kmaps[key]`` for convolution ``spec``, made by ``build()`` when absent or stale.

    An entry serves the voxel set it was built for: ``x.coords`` itself (the tensor object the
    layers pass along, so the test reads nothing from a device), on the same grid (shape,
    stride, batch size). Under an automatic key
    (:func:`cache_key` without an indice_key) another voxel set at the same stride -- after a
    non-submanifold stride-1 convolution, or ``x.replace(coords=...)`` -- gets its own map, built
    in place of the old. Under an indice_key, which names one convolution's map, another
    geometry, or other voxels (compared by value where the tensors differ), is a ConvError, and so
    is ``x.coords`` written in place since a layer met it (its maps, and the check of its rows,
    were made for the old values): build a new SparseTensor from the new coordinates."""
    e: Optional[ConvEntry] = x.kmaps.get(key)
    if e is not None and e.in_coords is x.coords and coords_version(x.coords) != e.in_version:
        raise ConvError(f"the input's coords were written in place after a layer built kernel "
                        f"maps for them (kmaps {key!r}); a tensor's voxels are fixed once a layer "
                        f"has met it: make a new SparseTensor(coords, feats, spatial_shape, "
                        f"batch_size) from the new coordinates")
    automatic = key == cache_key(spec, x.stride)
    if e is not None and automatic and (e.in_coords is not x.coords or not _same_grid(e, x)):
        e = None  # an automatic key's entry for another voxel set or grid
    if e is None:
        e = x.kmaps[key] = build()
    elif not _same_grid(e, x):
        raise ConvError(f"indice_key {key!r} names a map built on a grid of shape {e.in_shape} "
                        f"at stride {e.in_stride} with batch size {e.batch_size}; this input has "
                        f"{x.spatial_shape}, {x.stride}, {x.batch_size}: give this layer its own "
                        f"indice_key")
    elif e.spec != spec:
        raise ConvError(f"indice_key {key!r} names a convolution of kernel_size "
                        f"{e.spec.kernel_size}, stride {e.spec.stride}, padding {e.spec.padding}, "
                        f"dilation {e.spec.dilation}; this layer has {spec.kernel_size}, "
                        f"{spec.stride}, {spec.padding}, {spec.dilation}: give it its own "
                        f"indice_key")
    elif not _same_voxels(e.in_coords, x.coords):
        raise ConvError(f"indice_key {key!r} names a map built for another voxel set "
                        f"({len(e.in_coords)} voxels; this input has {len(x.coords)}): give "
                        f"this layer its own indice_key")
    return e


def _same_grid(e: ConvEntry, x: SparseTensor) -> bool:
    """Whether ``e`` was built on ``x``'s grid: its shape (which bounds a strided layer's
    outputs), stride and batch size."""
    return (e.in_shape, e.in_stride, e.batch_size) == (tuple(x.spatial_shape), x.stride,
                                                       x.batch_size)


def _same_voxels(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two coords tensors hold the same rows: the same object, or equal (a device read
    where they are different tensors, which the layers' own chain never makes)."""
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def serial_entry(x: SparseTensor, spec: ConvSpec, key: str) -> ConvEntry:
    """The single-process entry of a (non-transposed) convolution ``spec`` on ``x``.

    A submanifold layer may run the engine's own map, so its KernelMap is built on first use
    (:meth:`ConvEntry.local_map`); a strided one's now, since its inverse and the pipeline read
    it."""
    def build() -> ConvEntry:
        out_shape = spec.out_shape(x.spatial_shape)
        out, km = (x.coords, None) if spec.subm else mapstream.strided_map(
            x.coords, *spec.geometry, out_shape, x.batch_size)
        return ConvEntry(spec, x.coords, out, x.spatial_shape, out_shape, x.stride, km,
                         batch_size=x.batch_size)

    return cached_entry(x, key, spec, build)


def inverse_entry(x: SparseTensor, indice_key: Optional[str], kernel_size: int) -> ConvEntry:
    """The entry of the strided convolution that an inverse convolution on ``x`` undoes (serial
    or distributed alike: the inverse only looks it up)."""
    if indice_key is None or indice_key not in x.kmaps:
        raise ConvError(f"SparseInverseConv3d(indice_key={indice_key!r}) needs the "
                        f"indice_key of an earlier SparseConv3d on this tensor; known keys: "
                        f"{sorted(k for k in x.kmaps if not k.startswith('subm'))}")
    e: ConvEntry = x.kmaps[indice_key]
    if e.spec.kernel_size != kernel_size or e.spec.subm or x.stride != e.in_stride * \
            e.spec.stride or not _same_voxels(e.out_coords, x.coords):
        raise ConvError(f"SparseInverseConv3d(kernel_size={kernel_size}) does not match "
                        f"the convolution {indice_key!r} (kernel_size={e.spec.kernel_size}, "
                        f"{len(e.out_coords)} outputs at stride {e.in_stride * e.spec.stride}; "
                        f"this input: {len(x.coords)} voxels at stride {x.stride})")
    return e
