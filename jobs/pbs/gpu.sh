#!/bin/bash
# sparsepipe_hpc on PBS Pro: {{nodes}} node(s) x {{gpus_per_node}} GPUs = {{ntasks}} MPI ranks, one per GPU,
# {{cpus_per_rank}} CPU cores (threads) per rank. Submit with: qsub <this file>
# Rendered by: {{command}}
#PBS -N {{job_name}}
#PBS -l select={{nodes}}:ncpus={{cpus_per_node}}:ngpus={{gpus_per_node}}:mpiprocs={{ranks_per_node}}:ompthreads={{cpus_per_rank}}
#PBS -l walltime={{time}}
#PBS -l place=scatter:excl
#PBS -j oe
{{account_directive}}
{{queue_directive}}
# Sites name the GPU resource differently (ngpus, gpus): see your site's qsub guide.

set -euo pipefail
cd "$PBS_O_WORKDIR"

# Python: load modules / activate the environment that has sparsepipe_hpc installed, e.g.
#   module load cuda; source "$HOME/venvs/sparsepipe/bin/activate"
PYTHON=${PYTHON:-python}

# Threads: each rank runs one compute pool on its {{cpus_per_rank}} cores.
export OMP_NUM_THREADS={{cpus_per_rank}}
export SPARSEPIPE_THREADS={{cpus_per_rank}}

# NCCL moves tensors between GPUs. Leave NCCL_IB_DISABLE unset: InfiniBand is used when present.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=ib0         # bootstrap interface across nodes (ib0, hsn0, eth0, ...)
# UCX carries Open MPI's messages between nodes on InfiniBand.
export UCX_WARN_UNUSED_ENV_VARS=n
# export UCX_NET_DEVICES=mlx5_0:1       # pin the NIC when a node has several

export PYTHONUNBUFFERED=1               # output reaches the log as it is printed
export PYTHONFAULTHANDLER=1             # a crash in C prints the Python stack

# The allocation must be the one asked for ({{nodes}} distinct hosts in PBS_NODEFILE).
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
if [ "$NODES" -ne {{nodes}} ]; then
    echo "PBS_NODEFILE lists $NODES hosts; this script was made for {{nodes}}" >&2
    exit 1
fi

# One GPU per rank: every rank sees its node's {{gpus_per_node}} GPUs and takes GPU (local rank mod
# {{gpus_per_node}}) (launch.device.select_gpu), which keeps NCCL's peer-to-peer paths between them.
# {{ranks_per_node}} ranks per node, each bound to {{cpus_per_rank}} cores. 'launch run' aborts all ranks on an exception;
# at the wall-time limit PBS sends SIGTERM, then SIGKILL kill_delay seconds later.
MPIEXEC=({{mpiexec}})

# Check the binding first (one line per rank: node, local rank, GPU, threads, cores).
"${MPIEXEC[@]}" "$PYTHON" -m launch info

"${MPIEXEC[@]}" "$PYTHON" -m launch run -m {{module}} {{trainer_args}}
