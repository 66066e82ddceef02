#!/bin/bash
# sparsepipe_hpc on PBS Pro, CPU only: {{nodes}} node(s) x {{ranks_per_node}} ranks = {{ntasks}} MPI ranks,
# {{cpus_per_rank}} CPU cores (threads) per rank. Submit with: qsub <this file>
# Rendered by: {{command}}
#PBS -N {{job_name}}
#PBS -l select={{nodes}}:ncpus={{cpus_per_node}}:mpiprocs={{ranks_per_node}}:ompthreads={{cpus_per_rank}}
#PBS -l walltime={{time}}
#PBS -l place=scatter:excl
#PBS -j oe
{{account_directive}}
{{queue_directive}}

set -euo pipefail
cd "$PBS_O_WORKDIR"

# Python: load modules / activate the environment that has sparsepipe_hpc installed, e.g.
#   source "$HOME/venvs/sparsepipe/bin/activate"
PYTHON=${PYTHON:-python}

# Threads: each rank runs one compute pool on its {{cpus_per_rank}} cores.
export OMP_NUM_THREADS={{cpus_per_rank}}
export SPARSEPIPE_THREADS={{cpus_per_rank}}

export PYTHONUNBUFFERED=1               # output reaches the log as it is printed
export PYTHONFAULTHANDLER=1             # a crash in C prints the Python stack
# UCX carries Open MPI's messages between nodes on InfiniBand.
# export UCX_NET_DEVICES=mlx5_0:1       # pin the NIC when a node has several

# The allocation must be the one asked for ({{nodes}} distinct hosts in PBS_NODEFILE).
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
if [ "$NODES" -ne {{nodes}} ]; then
    echo "PBS_NODEFILE lists $NODES hosts; this script was made for {{nodes}}" >&2
    exit 1
fi

# {{ranks_per_node}} ranks per node, each bound to {{cpus_per_rank}} cores. 'launch run' aborts all ranks on an
# exception; at the wall-time limit PBS sends SIGTERM, then SIGKILL kill_delay seconds later.
MPIEXEC=({{mpiexec}})

# Check the binding first (one line per rank: node, local rank, threads, cores).
"${MPIEXEC[@]}" "$PYTHON" -m launch info

"${MPIEXEC[@]}" "$PYTHON" -m launch run -m {{module}} {{trainer_args}}
