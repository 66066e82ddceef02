"""halo: domain decomposition and halo exchange for sparse voxel sets over MPI."""
