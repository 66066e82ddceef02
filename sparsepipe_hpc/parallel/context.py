"""ParallelContext: one rank's communicators and its share of the work, from a RankLayout.

    with ParallelContext(MPI.COMM_WORLD, RankLayout.from_world(4, grid=(2, 1, 1))) as ctx:
        x, y = ctx.distribute(batch_x, voxel_labels)   # this rank's voxels, context attached
        share = F.cross_entropy(model(x).feats, y, reduction="sum") / ctx.global_count(len(y))
        share.backward(); ctx.allreduce_gradients(model)    # = single-process gradients
        # or bucketed, started during backward: r = ctx.gradient_reducer(model) once, then per
        # step r.arm(); share.backward(); r.finish(); and r.close() at the end
    # leaving the block frees the communicators, transports and reducers (ctx.close())

Loss convention: each rank computes a *share* of the loss, and the shares of all ranks sum to the
single-process loss of the global batch. Gradients are then summed (not averaged) over every rank
that holds a copy of the parameters, which gives the single-process gradient exactly (up to float
rounding): spatial ranks hold disjoint voxels, replicas disjoint samples, and values every spatial
rank holds a copy of (pooled vectors) carry 1/spatial_size of the loss on each.

Communicators:
    spatial_comm  ranks of one replica and stage (the Cartesian grid); pooling, halo exchange
    stats_comm    every rank of this stage (spatial ranks x replicas); BatchNorm statistics,
                  loss normalization and gradient all-reduce
and, for the layers' reductions, ``spatial_group`` and ``stats_group``: each communicator with the
reducer of its device tensors (a :class:`~halo.transport.collectives.ReduceGroup`; its reducer is
None on CPU runs, where MPI reduces host tensors where they lie).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch

from halo.cuts import Cuts
from halo.transport.base import Reducer
from halo.transport.collectives import ReduceGroup, allgatherv, allreduce_, bcast_
from sparsepipe_hpc.parallel.failures import disagreement
from sparsepipe_hpc.parallel.gradients import (DEFAULT_BUCKET_BYTES, GradientReducer,
                                               check_same_parameters, gradient_anywhere)
from sparsepipe_hpc.parallel.layout import LayoutError, RankLayout
from sparsepipe_hpc.parallel.spatial import check_payloads
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["ParallelContext"]


class ParallelContext:
    """One rank's communicators, position and spatial group (collective to construct).

    cuts: ``"balanced"`` (voxel-count quantiles per batch) or ``"uniform"``; overlap: run the
    interior convolution while halos travel; transport: what moves halo rows (a Transport over
    the spatial grid's ranks, or a function making one from the grid's communicator; default
    mpi4py on host buffers, see :class:`SpatialGroup`); reducer: a function making the
    :class:`~halo.transport.base.Reducer` of device tensors over a communicator (called for the
    spatial, statistics and gradient communicators; None: MPI, through host copies for device
    tensors); force_spatial: run the distributed layers even on a 1x1x1 grid (benchmarks).
    :meth:`close` closes what the two functions returned (so they must return new objects); a
    Transport passed in as such is the caller's to close.
    """

    def __init__(self, comm: Any, layout: RankLayout, cuts: str = "balanced",
                 overlap: bool = True, transport: Any = None, force_spatial: bool = False,
                 reducer: Optional[Callable[[Any], Optional[Reducer]]] = None):
        # Collective: the ranks agree on the layout and options first (one allgather), so a
        # rank that differs or fails stops them all rather than leave them in comm.Split.
        differ = disagreement(comm, (repr(layout), cuts, overlap, bool(force_spatial)))
        if differ:
            raise LayoutError("the ranks must build ParallelContext with the same layout and "
                              f"options (layout, cuts, overlap, force_spatial); got {differ}")
        if layout.size != comm.Get_size():
            raise LayoutError(f"layout {layout} does not match the communicator's "
                              f"{comm.Get_size()} ranks")
        if cuts not in ("balanced", "uniform"):
            raise ValueError(f"cuts must be 'balanced' or 'uniform'; got {cuts!r}")
        self.world = comm
        self.layout = layout
        self.position = layout.position(comm.Get_rank())
        p = self.position
        self.spatial_comm = comm.Split(p.replica * layout.stages + p.stage, p.spatial)
        self.stats_comm = comm.Split(p.stage, comm.Get_rank())
        self.make_reducer = reducer
        self.spatial_group = self._reduce_group(self.spatial_comm)
        self.stats_group = self._reduce_group(self.stats_comm)
        self.cuts_mode = cuts
        self.overlap = overlap
        self.spatial: Any = None  # the current batch's SpatialDomain (bound copies only)
        self._one_box: list[Any] = []  # input_grid()'s grid without a group; copies share it
        self.group: Any = None
        if layout.spatial_size > 1 or force_spatial:
            from sparsepipe_hpc.parallel.spatial import SpatialGroup

            self.group = SpatialGroup(self.spatial_comm, layout.grid, transport=transport,
                                      overlap=overlap)

    def input_grid(self) -> Any:
        """The spatial group's :class:`~halo.grid.ProcessGrid`, or without one a 1x1x1 grid over
        this rank's spatial communicator (made on first use, freed by :meth:`close`): where
        :func:`~sparsepipe_hpc.parallel.input.read_distributed` reads. Collective the first
        time without a group."""
        self._check_open()
        if self.group is not None:
            return self.group.grid
        if not self._one_box:
            from halo.grid import ProcessGrid
            self._one_box.append(ProcessGrid(self.spatial_comm, (1, 1, 1)))
        return self._one_box[0]

    def _reduce_group(self, comm: Any) -> ReduceGroup:
        """``comm`` with a reducer from ``make_reducer`` (collective; none for one rank)."""
        many = comm.Get_size() > 1
        return ReduceGroup(comm, self.make_reducer(comm) if many and self.make_reducer else None)

    # --- who am I --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def replica(self) -> int:
        return self.position.replica

    @property
    def num_replicas(self) -> int:
        return self.layout.replicas

    @property
    def spatial_size(self) -> int:
        return self.layout.spatial_size

    # --- data ------------------------------------------------------------------------------------
    def distribute(self, x: SparseTensor, *payloads: torch.Tensor, align: int = 1,
                   cuts: Optional[Cuts] = None) -> tuple[Any, ...]:
        """This rank's part of a batch every spatial rank of the replica holds in full.

        Returns the local tensor (context attached) and each per-voxel payload [N, ...] (labels)
        restricted the same way. Without spatial parallelism the batch is returned whole.
        ``align``: interior cuts are multiples of it (level-0 voxels). Any value is exact; the
        model's ``total_stride`` is cheapest, since kernel-2 stride-2 layers then need no halo.
        ``cuts``: explicit cut positions (level-0 voxels, the same on every rank of the group)
        instead of the context's ``cuts`` mode.
        """
        self._check_open()
        if self.group is None:
            check_payloads(x, payloads)
            return (x.replace(context=self), *payloads)
        domain = self.group.decompose(x, align=align, balanced=self.cuts_mode == "balanced",
                                      cuts=cuts, payloads=payloads)  # checked on every rank
        bound = self.bind(domain)
        if domain.grid.size == 1:  # one box holds the whole (bounds-checked) batch: no copy
            return (x.replace(context=bound, kmaps={}), *payloads)
        # The rows found once (on a GPU, each boolean selection waits for the device).
        rows = domain.owned_rows(x.coords, stride=x.stride).nonzero().squeeze(1)
        local = x.replace(coords=x.coords.index_select(0, rows),
                          feats=x.feats.index_select(0, rows), context=bound, kmaps={})
        return (local, *(p.index_select(0, rows.to(p.device)) for p in payloads))

    def collect(self, local_coords: torch.Tensor, values: torch.Tensor,
                full_coords: torch.Tensor) -> torch.Tensor:
        """Per-voxel ``values [n_local, ...]`` of every spatial rank, in the rows of ``full_coords``.

        The inverse of :meth:`distribute` for results (predictions, logits): every rank of the
        spatial group gets ``[len(full_coords), ...]`` on ``values``' device (values' dtype, any
        dtype), e.g. to project predictions back to points with the batch's ``point_to_voxel``
        map. Collective over the spatial group (:func:`~halo.transport.collectives.allgatherv`,
        then one all-reduce of the verdict, so a ``full_coords`` that does not match on one rank
        raises on every rank).
        """
        self._check_open()
        from halo.kmap import coord_keys

        if self.group is None:  # one rank: its rows, checked and put in full_coords' order
            all_keys, all_vals = coord_keys(local_coords), values.detach()
        else:
            comm = self.spatial_comm
            all_keys = allgatherv(coord_keys(local_coords), comm)
            all_vals = allgatherv(values.detach(), comm)
        sorted_keys, order = torch.sort(all_keys)
        want = coord_keys(full_coords).to(all_keys.device)
        pos = torch.searchsorted(sorted_keys, want).clamp(max=max(len(order) - 1, 0))
        # The same count, each wanted voxel found, none twice: the same voxel set.
        bad = len(all_keys) != len(want) or not torch.equal(sorted_keys[pos], want) \
            or len(torch.unique(pos)) != len(pos)
        if self.group is not None:
            from mpi4py import MPI

            if self.spatial_comm.allreduce(int(bad), op=MPI.MAX) and not bad:
                raise ValueError("collect: another spatial rank's full_coords does not match the "
                                 "voxels the ranks hold; see its error (every rank must pass the "
                                 "same full_coords)")
        if bad:
            raise ValueError(f"collect: the spatial ranks hold {len(all_keys)} voxels but "
                             f"full_coords has {len(want)}, or different ones (or one twice)")
        return all_vals[order[pos].to(all_vals.device)]

    # --- end ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        from mpi4py import MPI

        if self.stats_comm == MPI.COMM_NULL:  # freed by close (bound copies share it)
            raise RuntimeError("ParallelContext used after close(); build a new one")

    def close(self) -> None:
        """Free this context's communicators and what its transports and reducers hold (CUDA
        IPC buffers, NCCL communicators). **Collective**, once every exchange and all-reduce
        has completed; closing again, or through a bound copy, does nothing more. Gradient
        reducers from :meth:`gradient_reducer` are closed by their own ``close``."""
        from mpi4py import MPI

        if self.group is not None:
            self.group.close()
        for grid in self._one_box:
            grid.free()
        for g in (self.spatial_group, self.stats_group):
            if g.reducer is not None:
                g.reducer.close()
        for comm in (self.spatial_comm, self.stats_comm):
            if comm != MPI.COMM_NULL:
                comm.Free()

    def __enter__(self) -> "ParallelContext":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        # Only after success: a collective close on an exception one rank alone raised would
        # wait for ranks that never come (the exception ends the job instead).
        if kind is None:
            self.close()

    def bind(self, spatial: Any) -> "ParallelContext":
        c = copy.copy(self)
        c.spatial = spatial
        return c

    # --- reductions ------------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce over the stage's ranks (replicas and spatial ranks)."""
        self._check_open()
        return allreduce_(t, self.stats_group, op)

    def global_count(self, n_local: int) -> int:
        """The sum of ``n_local`` over the stage's ranks (e.g. voxels in the global batch)."""
        self._check_open()
        counts = self.stats_comm.allgather(int(n_local))  # small: one int per rank
        if min(counts) < 0:  # every rank sees every count: all raise alike
            r = counts.index(min(counts))
            raise ValueError(f"global_count: a count must be >= 0; rank {r} of the stage gave "
                             f"{counts[r]}")
        return sum(counts)

    def allreduce_gradients(self, params: Sequence[torch.nn.Parameter] | torch.nn.Module) -> None:
        """Sum gradients over every rank holding these parameters, in one flat buffer per dtype
        (a parameter without a gradient on this rank counts as zeros and gets the sum; one that
        no rank gave a gradient, or a frozen one, keeps ``grad = None``, as in one process)."""
        self._check_open()
        if isinstance(params, torch.nn.Module):
            params = list(params.parameters())
        if self.stats_comm.Get_size() == 1:
            return
        params = list(params)
        check_same_parameters(params, self.stats_comm, "allreduce_gradients")
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p, had in zip(params, gradient_anywhere(params, self.stats_comm)):
            if had:
                groups.setdefault((p.dtype, p.device), []).append(p)
        for group in groups.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads]).contiguous()
            allreduce_(flat, self.stats_group)
            offset = 0
            for p, g in zip(group, grads):
                n = g.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n

    def gradient_reducer(self, params: Sequence[torch.nn.Parameter] | torch.nn.Module,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GradientReducer:
        """A :class:`GradientReducer` over the stage's ranks: :meth:`allreduce_gradients`'s sums,
        bucketed and started during the step's last backward (collective to construct)."""
        self._check_open()
        if isinstance(params, torch.nn.Module):
            params = list(params.parameters())
        return GradientReducer(params, self.stats_comm, bucket_bytes, reducer=self.make_reducer)

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's parameters and buffers."""
        self._check_open()
        if self.world.Get_size() == 1:
            return
        tensors = list(module.parameters()) + list(module.buffers())
        # Agreed first (one allgather of shapes): broadcasting into other shapes sends garbage.
        shapes = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        seen = self.world.allgather(shapes)
        if any(other != seen[0] for other in seen):
            r = next(r for r, other in enumerate(seen) if other != seen[0])
            raise LayoutError(f"broadcast_parameters: rank {r}'s module differs from rank 0's "
                              f"({len(seen[r])} tensors against {len(seen[0])}, or other shapes "
                              f"or dtypes); build the same model on every rank")
        for t in tensors:
            bcast_(t, self.world, root=0)
