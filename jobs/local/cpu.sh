#!/bin/bash
# sparsepipe_hpc on one machine, CPU only (a laptop, a workstation, one node without a scheduler):
# {{ntasks}} MPI ranks. Run with: bash <this file>   (NRANKS=2 bash <this file> for another count)
# Rendered by: {{command}}
set -euo pipefail

# Python: activate the environment that has sparsepipe_hpc installed, or set PYTHON.
PYTHON=${PYTHON:-python}
NRANKS=${NRANKS:-{{ntasks}}}

# One machine: 'launch info' and 'launch run' make Open MPI talk over shared memory only and skip
# probing the network at start-up (OMPI_MCA_pml=ob1, OMPI_MCA_btl=self,sm on Open MPI 5 and
# self,vader on 3.x/4.x, chosen from the library's version; export them yourself to override).

# Threads per rank: {{cpus_per_rank}} ('auto': this machine's cores / ranks, at least 1).
THREADS={{cpus_per_rank}}
if [ "$THREADS" = auto ]; then
    THREADS=$(( $(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN) / NRANKS ))
    if [ "$THREADS" -lt 1 ]; then THREADS=1; fi
fi
export OMP_NUM_THREADS=$THREADS
export SPARSEPIPE_THREADS=$THREADS

export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1

# More ranks than cores is allowed (--oversubscribe): slower, but fine for tests and debugging.
# 'launch run' aborts all ranks on an exception.
MPIRUN=({{mpirun}})
{{mpirun_root}}

# Check the binding first (one line per rank: local rank, threads, cores).
"${MPIRUN[@]}" "$PYTHON" -m launch info

"${MPIRUN[@]}" "$PYTHON" -m launch run -m {{module}} {{trainer_args}}
