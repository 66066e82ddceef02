"""Train a spatially distributed sparse U-Net from your own training loop (no trainer).

    mpirun -n 4 python examples/spatial_unet.py --grid 2,2,1 --steps 20
    mpirun -n 2 python examples/spatial_unet.py --device cuda --transport ipc   # GPUs

On GPUs each rank takes the GPU of its local rank (``launch.device.bind_gpu``), and device tensors
move between ranks through the transport named (``staged``: device -> pinned host -> MPI, any
MPI; ``ipc``: CUDA IPC between the ranks of a node; ``nccl``: one GPU per rank); BatchNorm
statistics and gradients are all-reduced by its reducer, on the GPU's streams.

Every rank builds the same room (the same seed), keeps the voxels of its box, and the U-Net's
convolutions exchange halos with the neighbouring boxes. The loss each rank computes is its share
of the global loss; after ``allreduce_gradients`` every rank holds the single-process gradient.

An exception on one rank would leave the others waiting in their next collective for ever, so the
script first installs ``abort_on_exception``: the traceback is printed with the rank and the whole
job ends (``mpirun -n 4 python -m launch run examples/spatial_unet.py ...`` does the same).
"""

import argparse

from launch.run import abort_on_exception

abort_on_exception()  # before anything can fail: an exception on any rank ends the whole job

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from sparsepipe_hpc import SparseTensor, voxelize
from sparsepipe_hpc.data.synth import SEG_CLASSES, make_room
from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.parallel import ParallelContext, RankLayout, parse_grid

p = argparse.ArgumentParser()
p.add_argument("--grid", default=None, help="spatial grid per replica, e.g. 2,2,1")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
p.add_argument("--transport", choices=("staged", "ipc", "nccl"),
               help="with --device cuda: what moves device tensors between ranks (default staged)")
args = p.parse_args()
if args.transport and args.device != "cuda":
    p.error(f"--transport {args.transport} moves device tensors: pass --device cuda too")
torch.set_num_threads(1)

comm = MPI.COMM_WORLD
grid = parse_grid(args.grid) or (comm.size, 1, 1)
layout = RankLayout.from_world(comm.size, grid=grid)
if args.device == "cuda":
    from halo.transport.nccl import nccl_available
    from halo.transport.select import choose_transport, make_reducer, make_transport
    from halo.transport.streams import CudaDevice
    from launch.device import bind_gpu, ranks_per_gpu
    from launch.env import detect
    from sparsepipe_hpc.train.transport import check_mpi_threads

    gpu = bind_gpu(detect())  # this local rank's GPU, made current
    if gpu is None:  # an exception, so abort_on_exception ends every rank
        raise RuntimeError("--device cuda: this rank sees no CUDA device")
    device = torch.device("cuda", gpu)
    # Errors naming the remedy, on every rank: nccl where ranks share a GPU; an MPI that
    # autograd's CUDA thread may not call (it runs the backward's halo and BatchNorm traffic).
    name = choose_transport(args.transport or "staged", "cuda", nccl=nccl_available(),
                            shared_gpu=ranks_per_gpu(comm, gpu) > 1)
    check_mpi_threads(comm)
    streams = CudaDevice(device)  # the compute stream and the communication streams
    ctx = ParallelContext(comm, layout,
                          transport=lambda c: make_transport(name, c, streams),
                          reducer=lambda c: make_reducer(name, c, streams))
else:
    device = torch.device("cpu")
    ctx = ParallelContext(comm, layout)
net = SparseUNet(in_channels=3, num_classes=len(SEG_CLASSES), width=8, depth=3)
ctx.broadcast_parameters(net)
net.to(device)
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
shape, voxel = (112, 112, 64), 0.05  # a fixed global grid: 5.6 m x 5.6 m x 3.2 m from the origin

for step in range(args.steps):
    # Replica r trains on room r + replicas * step; the spatial ranks of a replica share it.
    seed = ctx.replica + ctx.num_replicas * step
    xyz, rgb, label = make_room(np.random.default_rng(seed))
    vox = voxelize(xyz + 0.5, rgb / 255.0, voxel, origin=(0, 0, 0), spatial_shape=shape,
                   labels=label, num_classes=len(SEG_CLASSES), clip=True)
    batch = SparseTensor.from_voxels([vox], shape)
    x, y = ctx.distribute(batch, vox.labels, align=net.total_stride)  # my box's voxels
    x, y = x.to(device), y.to(device)
    logits = net(x).feats
    loss = F.cross_entropy(logits, y, reduction="sum") / ctx.global_count(len(y))
    opt.zero_grad()
    loss.backward()
    ctx.allreduce_gradients(net)
    opt.step()
    total = ctx.allreduce(loss.detach().clone())  # the global mean loss
    if ctx.is_root:
        print(f"step {step:3d}  loss {total.item():.4f}  ({x.num_voxels} of my voxels)", flush=True)

ctx.close()  # collective: frees the communicators, and a GPU run's IPC buffers or NCCL comms
