"""launch under a real mpirun (Open MPI): the variables agree with MPI; ranks agree to stop."""

from __future__ import annotations

import os

import pytest
from mpi4py import MPI

import launch.run as launch_run
from launch.device import select_gpu, visible_gpu_count
from launch.env import detect, from_comm, ranks_sharing_cores, threads_per_rank


def test_open_mpi_variables_match_the_world(comm):
    p = detect()
    assert p.launcher == "openmpi"
    assert (p.rank, p.size) == (comm.rank, comm.size)
    local_ranks = comm.allgather(p.local_rank)
    assert sorted(local_ranks) == list(range(p.local_size))  # one node: a permutation
    assert p.local_size == comm.size


def test_shared_memory_split_matches_the_variables(comm):
    split = from_comm(comm)
    env = detect()
    assert (split.rank, split.size, split.local_size) == (env.rank, env.size, env.local_size)
    assert split.node_index == 0 and split.launcher == "mpi"
    assert sorted(comm.allgather(split.local_rank)) == list(range(comm.size))
    assert len(set(comm.allgather(split.node))) == 1


def test_detect_with_the_world_keeps_the_variables(comm):
    assert detect(comm).launcher == "openmpi"


def test_detect_with_a_smaller_communicator_splits_it(comm):
    half = comm.Split(comm.rank % 2, comm.rank)
    try:
        p = detect(half)
        assert (p.rank, p.size) == (half.rank, half.size)
        if half.size != comm.size:
            assert p.launcher == "mpi" and f"world size {comm.size}" in p.note
        else:
            assert p.launcher == "openmpi"
    finally:
        half.Free()


def test_threads_and_gpu(comm):
    p = detect()
    assert threads_per_rank(p) >= 1
    gpu = select_gpu(p)
    assert (gpu is None) == (visible_gpu_count() == 0)
    assert MPI.Is_initialized()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_ranks_bound_to_cores_of_their_own_do_not_divide_them(comm):
    """Ranks that see the same cores (no binding) divide them; ranks bound to cores of their own,
    as Open MPI binds 2 ranks by default, take all of theirs (threads_per_rank divided a bound
    rank's one-core mask by 2 before)."""
    mine = os.sched_getaffinity(0)
    cores = sorted(set().union(*map(set, comm.allgather(sorted(mine)))))
    own = cores[comm.rank % len(cores)]  # a core each, as far as there are cores
    try:
        os.sched_setaffinity(0, {cores[0]})
        assert ranks_sharing_cores(comm) == comm.size
        os.sched_setaffinity(0, {own})
        assert ranks_sharing_cores(comm) == sum(cores[r % len(cores)] == own
                                                for r in range(comm.size))
    finally:
        os.sched_setaffinity(0, mine)


def test_agree_to_stop_when_any_rank_got_the_signal(comm, monkeypatch):
    assert launch_run.agree_to_stop(comm) is False
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(launch_run, "_stop_signal", 15)
    assert launch_run.agree_to_stop(comm) is True
