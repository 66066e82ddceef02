"""Stage-to-stage transfers: carries of sparse activations forward, their gradients back.

    comm = world.Dup()
    link = StageLink(StagedTransport(MPITransport(comm), dev), headers=MPITransport(comm),
                     device=torch.device("cuda"))     # or StageLink(MPITransport(comm)) on CPU
    pending = link.post_carry(peer, mb)              # early: the header receive is posted
    sent = link.send_carry(peer, mb, [skip, x])      # producer: non-blocking, keep until done
    carry = link.finish_carry(pending, context, kmaps)   # consumer: wait, rebuild SparseTensors
    g = link.post_grads(peer, mb, [x.feats])         # producer: receives of known size
    link.send_grads(peer, mb, [gx])                  # consumer: one message per float entry
    grads = link.finish_grads(g)

Messages (all raw bytes through a halo ``Transport``, so device transports serve stages too; the
headers, read by the host, through a host one):

* **activation** of micro-batch ``mb``: a fixed ``HEADER_BYTES`` uint8 header on tag
  ``tag(mb, ACT_HEADER)``: int64 length, then JSON describing each entry (sparse: voxel count N,
  channels C, feature dtype, spatial_shape, batch_size, stride, whether its features need a
  gradient; dense: shape and dtype) and the kernel-map entries to rebuild; then the payloads on
  ``tag(mb, ACT_DATA)``, in entry order: coords int32 [N, 4] and feats [N, C] per sparse entry, the
  tensor itself per dense entry (zero-byte payloads are not sent). Sizes differ every micro-batch,
  hence the header; its receive can be posted as early as the caller likes.
* **gradient** on ``tag(mb, GRAD)``: for every entry whose header said it needs a gradient, a
  tensor shaped like its features, in entry order. The producer knows those shapes, so it posts
  these receives when it sends the activation.

Kernel maps hold process-local objects and never travel. A strided convolution's map is what a
later inverse convolution (U-Net decoder, indice_key) needs, and it is rebuilt from coordinates
that do travel: the map's input voxels are exactly the coords of a carry entry in the message
(the skip a Down block keeps is its strided convolution's input), so the header names that entry
and the convolution's geometry, and the receiver builds the same map (``rebuild_entry``; under
spatial parallelism through the stage's own SpatialDomain, with its halo plan). Submanifold maps
are rebuilt lazily by the layers themselves. All received entries of one micro-batch share one
``kmaps`` dict, as the tensors of one input do in a single process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from halo.transport.base import Request, Transport
from sparsepipe_hpc.kmaps import ConvEntry, ConvSpec, serial_entry
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.tracing import span

__all__ = ["StageLink", "PendingCarry", "PendingGrads", "HEADER_BYTES", "tag", "rebuild_entry",
           "TransferError"]

HEADER_BYTES = 4096
ACT_HEADER, ACT_DATA, GRAD = 0, 1, 2
_TAG_BASE = 64
_TAG_UB = 32767  # the smallest MPI_TAG_UB the standard allows

Entry = Union[SparseTensor, torch.Tensor]


class TransferError(ValueError):
    """A carry that cannot be sent, or a message that does not match what was expected."""


def tag(mb: int, kind: int) -> int:
    """The MPI tag of message ``kind`` (ACT_HEADER, ACT_DATA, GRAD) of micro-batch ``mb``."""
    t = _TAG_BASE + 3 * mb + kind
    if t > _TAG_UB:
        raise TransferError(f"micro-batch {mb} needs tag {t}, above MPI's guaranteed upper bound "
                            f"{_TAG_UB}; use at most {(_TAG_UB - _TAG_BASE) // 3} micro-batches")
    return t


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in a stage message header")
    return dt


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def rebuild_entry(x_in: SparseTensor, key: str, kernel_size: int, stride: int, padding: int,
                  dilation: int) -> ConvEntry:
    """Build the strided convolution map ``key`` whose input voxels are ``x_in``'s coords.

    Stores it in ``x_in.kmaps[key]`` (and so in every tensor sharing that dict) exactly as the
    convolution itself would have: serial, or through ``x_in.context.spatial`` (collective over
    the spatial group when the geometry needs a halo plan: call it in the same order on every rank
    of the group).
    """
    spec = ConvSpec(kernel_size, stride, padding, dilation)
    spatial = x_in.context.spatial if x_in.context is not None else None
    if spatial is not None:
        return spatial.entry(x_in, spec, key)
    return serial_entry(x_in, spec, key)


@dataclass
class PendingCarry:
    peer: int
    mb: int
    header: torch.Tensor
    request: Request


@dataclass
class PendingGrads:
    peer: int
    mb: int
    buffers: list[Optional[torch.Tensor]]
    requests: list[Request] = field(default_factory=list)


class StageLink:
    """Carries and gradients between this rank and the ranks of other stages (``transport``'s
    communicator ranks). Messages between one pair of ranks match by tag, so the micro-batches
    of one edge may be in flight at once.

    ``transport`` moves the payloads (coordinates, features, gradients), received into tensors
    on ``device`` (default: the CPU); ``headers`` (default: ``transport``) moves the fixed-size
    headers, which the host reads: a host transport over the same ranks when the payloads are
    device tensors. The transport must match by (peer, tag) in posting order and never block a
    sender's start on its receiver (MPI's semantics; host-staged MPI and CUDA IPC keep them on
    a GPU)."""

    def __init__(self, transport: Transport, headers: Optional[Transport] = None,
                 device: Optional[torch.device] = None):
        self.transport = transport
        self.headers = headers if headers is not None else transport
        self.device = torch.device("cpu") if device is None else device

    # --- activations -----------------------------------------------------------------------------
    def send_carry(self, peer: int, mb: int, entries: Sequence[Entry]) -> list[Request]:
        """Start sending ``entries`` (SparseTensors or dense tensors) to ``peer``; non-blocking.

        The returned requests hold the buffers; wait for them before the step ends.
        """
        meta: dict[str, Any] = {"mb": mb, "entries": [], "kmaps": []}
        payload: list[torch.Tensor] = []
        coords_ids: dict[int, int] = {}
        for j, e in enumerate(entries):
            if isinstance(e, SparseTensor):
                feats = e.feats.detach().contiguous()
                meta["entries"].append({
                    "kind": "sparse", "n": int(feats.shape[0]), "c": int(feats.shape[1]),
                    "dtype": str(feats.dtype), "shape": list(e.spatial_shape),
                    "batch": e.batch_size, "stride": e.stride, "grad": _needs_grad(e.feats)})
                payload += [e.coords.contiguous(), feats]
                coords_ids.setdefault(id(e.coords), j)
            elif isinstance(e, torch.Tensor):
                meta["entries"].append({"kind": "dense", "shape": list(e.shape),
                                        "dtype": str(e.dtype), "grad": _needs_grad(e)})
                payload.append(e.detach().contiguous())
            else:
                raise TransferError(f"carry entry {j} is a {type(e).__name__}; stages send "
                                    f"SparseTensors and torch tensors only")
        seen = set()
        for e in entries:
            if not isinstance(e, SparseTensor):
                continue
            for key, ce in e.kmaps.items():
                if (key in seen or not isinstance(ce, ConvEntry) or ce.spec.subm
                        or id(ce.in_coords) not in coords_ids):
                    continue
                seen.add(key)
                s = ce.spec
                meta["kmaps"].append({"key": key, "entry": coords_ids[id(ce.in_coords)],
                                      "k": s.kernel_size, "s": s.stride, "p": s.padding,
                                      "d": s.dilation})
        text = json.dumps(meta).encode()
        if len(text) > HEADER_BYTES - 8:
            raise TransferError(f"a stage message header needs {len(text)} bytes but holds "
                                f"{HEADER_BYTES - 8}; fewer carry entries per stage boundary")
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.tensor([len(text)], dtype=torch.int64).view(torch.uint8)
        header[8:8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        reqs = [self.headers.start([(peer, header)], [], tag(mb, ACT_HEADER))]
        data = [(peer, t) for t in payload if t.numel()]
        reqs.append(self.transport.start(data, [], tag(mb, ACT_DATA)))
        return reqs

    def post_carry(self, peer: int, mb: int) -> PendingCarry:
        """Post the header receive of ``peer``'s carry for micro-batch ``mb``."""
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        return PendingCarry(peer, mb, header,
                            self.headers.start([], [(peer, header)], tag(mb, ACT_HEADER)))

    def finish_carry(self, pending: PendingCarry, context: Any = None,
                     kmaps: Optional[dict] = None) -> list[Entry]:
        """Wait for the carry, receive its payloads; SparseTensors get ``context`` and share
        ``kmaps`` (a new dict if None), with the strided maps the header names rebuilt."""
        # The peer may send this header only after receiving a payload of ours still held back
        # (a staged send whose copy was running): hand those on while waiting.
        polls = 0
        while self.transport.progress() and not pending.request.test():
            polls += 1
            time.sleep(0 if polls < 100 else 1e-4)  # yield to ranks sharing this core
        pending.request.wait()
        length = int(pending.header[:8].view(torch.int64)[0])
        meta = json.loads(bytes(pending.header[8:8 + length].tolist()).decode())
        if meta["mb"] != pending.mb:
            raise TransferError(f"expected micro-batch {pending.mb} from rank {pending.peer}, "
                                f"got {meta['mb']}")
        bufs: list[torch.Tensor] = []
        dev = self.device
        for e in meta["entries"]:
            if e["kind"] == "sparse":
                bufs += [torch.empty(e["n"], 4, dtype=torch.int32, device=dev),
                         torch.empty(e["n"], e["c"], dtype=_dtype(e["dtype"]), device=dev)]
            else:
                bufs.append(torch.empty(e["shape"], dtype=_dtype(e["dtype"]), device=dev))
        self.transport.start([], [(pending.peer, b) for b in bufs if b.numel()],
                             tag(pending.mb, ACT_DATA)).wait()
        kmaps = {} if kmaps is None else kmaps
        out: list[Entry] = []
        it = iter(bufs)
        for e in meta["entries"]:
            if e["kind"] == "sparse":
                coords, feats = next(it), next(it)
                out.append(SparseTensor(coords, feats, tuple(e["shape"]), e["batch"], e["stride"],
                                        kmaps=kmaps, context=context))
            else:
                out.append(next(it))
            if e["grad"]:
                feats = out[-1].feats if isinstance(out[-1], SparseTensor) else out[-1]
                feats.requires_grad_(True)
        for k in meta["kmaps"]:
            x_in = out[k["entry"]]
            if not isinstance(x_in, SparseTensor):
                raise TransferError(f"kernel map {k['key']!r} names carry entry {k['entry']}, "
                                    f"which is not sparse")
            with span(f"rebuild {k['key']}", "kmap"):  # compute, not waiting: the trace tells
                rebuild_entry(x_in, k["key"], k["k"], k["s"], k["p"], k["d"])
        return out

    # --- gradients -------------------------------------------------------------------------------
    def post_grads(self, peer: int, mb: int, entries: Sequence[Entry]) -> PendingGrads:
        """Post receives for the gradients of the ``entries`` this rank sent to ``peer``."""
        bufs: list[Optional[torch.Tensor]] = []
        for e in entries:
            t = e.feats if isinstance(e, SparseTensor) else e
            bufs.append(torch.empty(t.shape, dtype=t.dtype, device=t.device) if _needs_grad(t)
                        else None)
        live = [(peer, b) for b in bufs if b is not None and b.numel()]
        return PendingGrads(peer, mb, bufs, [self.transport.start([], live, tag(mb, GRAD))])

    def send_grads(self, peer: int, mb: int,
                   grads: Sequence[Optional[torch.Tensor]]) -> list[Request]:
        """Send the gradients of the entries received from ``peer`` (None: entry needs none)."""
        live = [(peer, g.detach().contiguous()) for g in grads if g is not None and g.numel()]
        return [self.transport.start(live, [], tag(mb, GRAD))]

    def finish_grads(self, pending: PendingGrads) -> list[Optional[torch.Tensor]]:
        for r in pending.requests:
            r.wait()
        return pending.buffers
