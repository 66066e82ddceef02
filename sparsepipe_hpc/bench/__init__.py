"""Benchmarks: scripts that print figures and write JSON (``python -m sparsepipe_hpc.bench NAME``).

    mpirun -n 2 python -m sparsepipe_hpc.bench halo --json halo.json
    python -m sparsepipe_hpc.bench engine --json engine.json

Every figure that compares two things is a ratio of the two measured side by side in one run.
"""
