"""Start sparsepipe_hpc on a laptop, one node or a cluster: who am I, which GPU, how many threads.

Usage::

    python -m launch info                                   # one line per rank
    mpirun -n 4 python -m launch run -m sparsepipe_hpc.train ...   # abort all ranks on an exception
    python -m launch job --scheduler slurm --nodes 4 --gpus-per-node 8 -- --epochs 10 > job.sh

    from launch import detect, threads_per_rank, select_gpu
    placement = detect()                                    # Placement(rank=.., size=.., ...)
    torch.set_num_threads(threads_per_rank(placement))
    gpu = select_gpu(placement)                             # None without CUDA

Modules: :mod:`launch.env` (who am I), :mod:`launch.device` (GPU binding), :mod:`launch.run` (safe
start), :mod:`launch.info` (the per-rank summary), :mod:`launch.jobs` (job scripts from ``jobs/``),
:mod:`launch.mpilib` (which MPI library, asked before ``MPI_Init``).
Importing the package imports neither MPI nor torch.
"""

from launch.device import bind_gpu, select_gpu
from launch.env import Placement, detect, threads_per_rank
from launch.errors import LaunchError

__all__ = ["Placement", "detect", "threads_per_rank", "select_gpu", "bind_gpu", "LaunchError"]
