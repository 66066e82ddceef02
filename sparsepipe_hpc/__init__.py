"""sparsepipe_hpc: spatially parallel, pipelined training of sparse 3D CNNs on point clouds.

    from sparsepipe_hpc import SparseTensor, voxelize
    vox = voxelize(points, feats, voxel_size=0.05, origin=(0, 0, 0), spatial_shape=(128, 128, 64))
    x = SparseTensor.from_voxels([vox], (128, 128, 64))
"""

from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.voxelize import Voxels, voxelize

__all__ = ["SparseTensor", "Voxels", "voxelize"]
__version__ = "0.1.0"
