#!/bin/bash
# sparsepipe_hpc on SLURM, CPU only: {{nodes}} node(s) x {{ranks_per_node}} ranks = {{ntasks}} MPI ranks,
# {{cpus_per_rank}} CPU cores (threads) per rank. Submit with: sbatch <this file>
# Rendered by: {{command}}
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks={{ntasks}}
#SBATCH --ntasks-per-node={{ranks_per_node}}
#SBATCH --cpus-per-task={{cpus_per_rank}}
#SBATCH --time={{time}}
#SBATCH --signal=TERM@{{signal_lead}}
#SBATCH --output={{job_name}}-%j.out
{{account_directive}}
{{queue_directive}}

set -euo pipefail

# Python: load modules / activate the environment that has sparsepipe_hpc installed, e.g.
#   source "$HOME/venvs/sparsepipe/bin/activate"
PYTHON=${PYTHON:-python}

# Threads: each rank runs one compute pool on the cores SLURM gives its task.
export OMP_NUM_THREADS={{cpus_per_rank}}
export SPARSEPIPE_THREADS={{cpus_per_rank}}
# srun stopped inheriting sbatch's --cpus-per-task in Slurm 22.05: say it again.
export SRUN_CPUS_PER_TASK={{cpus_per_rank}}

# UCX carries Open MPI's messages between nodes on InfiniBand.
export UCX_WARN_UNUSED_ENV_VARS=n
# export UCX_NET_DEVICES=mlx5_0:1       # pin the NIC when a node has several

export PYTHONUNBUFFERED=1               # output reaches the log as it is printed
export PYTHONFAULTHANDLER=1             # a crash in C prints the Python stack

# --kill-on-bad-exit ends the step when a rank fails; 'launch run' aborts all ranks on an exception.
# srun must start the MPI mpi4py uses: if 'launch info' below stops with "MPI gives this one a
# world of 1", add the PMI plugin it needs (--mpi=pmix for Open MPI 5; 'srun --mpi=list').
# SIGTERM arrives {{signal_lead}} s before the time limit: the trainer writes a last checkpoint.
SRUN=(srun --ntasks={{ntasks}} --ntasks-per-node={{ranks_per_node}} --cpus-per-task={{cpus_per_rank}}
      --cpu-bind=cores --kill-on-bad-exit=1)

# Check the binding first (one line per rank: node, local rank, threads, cores).
"${SRUN[@]}" "$PYTHON" -m launch info

"${SRUN[@]}" "$PYTHON" -m launch run -m {{module}} {{trainer_args}}
