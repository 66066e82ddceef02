"""Train a spatially distributed sparse U-Net from your own training loop (no trainer).

    mpirun -n 4 python examples/spatial_unet.py --grid 2,2,1 --steps 20

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
args = p.parse_args()
torch.set_num_threads(1)

comm = MPI.COMM_WORLD
grid = parse_grid(args.grid) or (comm.size, 1, 1)
ctx = ParallelContext(comm, RankLayout.from_world(comm.size, grid=grid))
net = SparseUNet(in_channels=3, num_classes=len(SEG_CLASSES), width=8, depth=3)
ctx.broadcast_parameters(net)
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
    logits = net(x).feats
    loss = F.cross_entropy(logits, y, reduction="sum") / ctx.global_count(len(y))
    opt.zero_grad()
    loss.backward()
    ctx.allreduce_gradients(net)
    opt.step()
    total = ctx.allreduce(loss.detach().clone())  # the global mean loss
    if ctx.is_root:
        print(f"step {step:3d}  loss {total.item():.4f}  ({x.num_voxels} of my voxels)", flush=True)

ctx.close()  # collective: frees the communicators (and a GPU run's IPC buffers or NCCL comms)
