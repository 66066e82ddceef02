"""--transport in the trainer under real mpirun: auto is mpi on the CPU and the start-up line
names it; a device transport on a CPU run is the same ConfigError on every rank, and so are
the CUDA-only rules that need no GPU to check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from sparsepipe_hpc.train.config import ConfigError, parse_config
from sparsepipe_hpc.train.loop import Trainer


@pytest.fixture(scope="module")
def shared(shared_data) -> Path:
    return shared_data(scenes=dict(train=4, val=2, seed=1, objects=(2, 3), points=(800, 1200)))


def argv(shared: Path, *extra: str) -> list[str]:
    return ["--task", "seg", "--data", str(shared / "scenes"), "--out", str(shared / "run"),
            "--width", "4", "--depth", "2", "--steps", "1", "--voxel-size", "0.25",
            # one sample per rank: the global batch must split evenly at every world size
            "--batch-size", str(MPI.COMM_WORLD.size), "--no-progress", *extra]


def test_auto_is_mpi_on_cpu_and_is_printed(comm, shared):
    said: list[str] = []
    t = Trainer(parse_config(argv(shared)), comm, log=said.append)
    assert t.transport == "mpi"
    t.run()
    if comm.rank == 0:
        assert any("transport mpi" in s for s in said), said


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["nccl", "ipc", "staged"])
def test_device_transport_without_cuda_is_a_config_error_on_every_rank(comm, shared, name):
    with pytest.raises(ConfigError, match=f"--transport {name} moves CUDA device tensors"):
        parse_config(argv(shared, "--transport", name, "--device", "cpu"))
    cfg = parse_config(argv(shared, "--transport", name))  # --device auto: known at start-up
    with pytest.raises(ConfigError, match=f"--transport {name} moves CUDA device tensors"):
        Trainer(cfg, comm, log=None)


def test_cuda_checks_that_need_no_gpu_are_config_errors_on_every_rank(comm, shared,
                                                                     monkeypatch):
    """On a CUDA device (resolved, not touched): --transport mpi cannot move a grid's halos or
    a pipeline's carries (device tensors), but serves data parallelism (its collectives stage
    through the host); several ranks need an MPI that autograd's CUDA thread may call."""
    from sparsepipe_hpc.train.transport import trainer_transport

    cuda = torch.device("cuda", 0)
    assert trainer_transport(parse_config(argv(shared, "--transport", "mpi")), cuda,
                             comm) == "mpi"
    assert trainer_transport(parse_config(argv(shared)), cuda, comm) == "staged"
    if comm.size > 1:
        layouts = [("--grid", f"{comm.size},1,1", "--grid halos")]
        if comm.size % 2 == 0:
            layouts.append(("--stages", "2", "--stages transfers"))
        for flag, value, what in layouts:
            cfg = parse_config(argv(shared, "--transport", "mpi", flag, value))
            with pytest.raises(ConfigError, match=f"^--transport mpi moves host tensors only, "
                                                  f"but with --device cuda the {what}"):
                trainer_transport(cfg, cuda, comm)
        monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_FUNNELED)
        with pytest.raises(ConfigError, match=f"--device cuda with {comm.size} ranks calls MPI "
                                              "from autograd's CUDA thread, .* "
                                              "MPI_THREAD_FUNNELED"):
            trainer_transport(parse_config(argv(shared)), cuda, comm)


def test_ipc_is_refused_where_a_grid_spans_nodes(comm, shared, monkeypatch):
    """CUDA IPC connects the ranks of one node: --transport ipc with a spatial grid spread over
    nodes is a ConfigError on every rank, naming the grid and the hosts; replicas (or stages)
    on other nodes are fine (reductions and stage payloads then go host-staged)."""
    import launch.device
    from sparsepipe_hpc.train import transport

    monkeypatch.setattr(launch.device, "gpu_uuid", lambda index: "GPU-0")  # one GPU, shared
    cuda = torch.device("cuda", 0)
    here = transport.node_names(comm)  # every rank on this machine's one node
    assert len(set(here)) == 1 and len(here) == comm.size
    monkeypatch.setattr(transport, "node_names", lambda c: [f"node{r}" for r in range(c.size)])
    cfg = parse_config(argv(shared, "--transport", "ipc"))  # replicas only: one rank per grid
    assert transport.trainer_transport(cfg, cuda, comm) == "ipc"
    if comm.size > 1:
        cfg = parse_config(argv(shared, "--transport", "ipc", "--grid", f"{comm.size},1,1"))
        with pytest.raises(ConfigError, match=r"--transport ipc moves halos within a node, but 1 "
                                              r"spatial grid\(s\) .* span nodes \(replica 0, "
                                              r"stage 0: node0, node1"):
            transport.trainer_transport(cfg, cuda, comm)
        monkeypatch.setattr(transport, "node_names", lambda c: here)
        assert transport.trainer_transport(cfg, cuda, comm) == "ipc"


def test_nccl_is_refused_only_where_ranks_share_a_gpu(comm, shared, monkeypatch):
    """NCCL refuses two ranks on one GPU. Ranks name their GPU by its UUID, so ranks that each
    see only their own GPU, as device 0 (srun --gpus-per-task=1), may use NCCL."""
    import launch.device
    from sparsepipe_hpc.train import transport

    monkeypatch.setattr(transport, "nccl_available", lambda: True)
    cuda = torch.device("cuda", 0)
    cfg = parse_config(argv(shared, "--transport", "nccl"))
    monkeypatch.setattr(launch.device, "gpu_uuid", lambda index: f"GPU-{comm.rank}")
    assert transport.trainer_transport(cfg, cuda, comm) == "nccl"
    if comm.size > 1:
        monkeypatch.setattr(launch.device, "gpu_uuid",
                            lambda index: f"GPU-{comm.rank % (comm.size - 1)}")
        with pytest.raises(ConfigError, match="--transport nccl: several ranks share a GPU"):
            transport.trainer_transport(cfg, cuda, comm)


def test_the_trainer_hands_its_transport_and_reducer_to_the_parallel_context(comm, shared,
                                                                             monkeypatch):
    """What ``device_comm`` makes moves the grid's halo rows and plan coordinates, and reduces
    BatchNorm statistics, pooled sums and gradient buckets: host staging ordered by stream events
    (the path of --device cuda --transport staged, here on the CPU stand-in device) trains the
    same losses as mpi4py on host tensors."""
    if comm.size < 2:
        pytest.skip("a spatial grid needs 2+ ranks")
    from halo.transport.mpi import MPITransport
    from halo.transport.staged import StagedTransport
    from halo.transport.staged_reduce import StagedReducer
    from halo.transport.streams import SimDevice
    from sparsepipe_hpc.train import loop
    from sparsepipe_hpc.train.transport import DeviceComm

    grid = ["--grid", f"{comm.size},1,1", "--steps", "2"]
    plain = Trainer(parse_config(argv(shared, *grid, "--out", str(shared / "run-mpi"))), comm,
                    log=None).run()
    made: list[StagedTransport] = []
    reducers: list[StagedReducer] = []

    def staged_on_stand_in(name, device):
        dev = SimDevice()

        def transport(grid_comm):
            made.append(StagedTransport(MPITransport(grid_comm), dev))
            return made[-1]

        def reducer(group_comm):
            reducers.append(StagedReducer(group_comm, dev))
            return reducers[-1]
        return DeviceComm(halo=transport, reducer=reducer)

    monkeypatch.setattr(loop, "device_comm", staged_on_stand_in)
    t = Trainer(parse_config(argv(shared, *grid, "--out", str(shared / "run-staged"))), comm,
                log=None)
    assert len(made) == 1 and t.ctx.group.transport is made[0]
    # the spatial and statistics groups, and the gradient buckets' duplicate communicator
    assert t.ctx.stats_group.reducer in reducers and t.ctx.spatial_group.reducer in reducers
    staged = t.run()
    assert comm.allreduce(made[0].pool.allocated) > 0, "no halo went through the transport"
    assert t.reducer is not None and t.reducer.group.reducer in reducers
    for r in (t.ctx.stats_group.reducer, t.reducer.group.reducer):
        assert r.pool.allocated > 0, "a reduction skipped its reducer"
    assert staged["train"]["loss"] == pytest.approx(plain["train"]["loss"], rel=1e-6)
    assert staged["eval"]["miou"] == pytest.approx(plain["eval"]["miou"], rel=1e-6)


@pytest.mark.parametrize("name", ["staged", "ipc"])
def test_the_trainer_hands_its_stage_transport_to_the_pipeline(comm, shared, monkeypatch, name):
    """--stages on the device path: stage payloads through what ``device_comm`` makes for
    stages (host-staged, or CUDA IPC for ipc on one node; here on the stand-in device),
    headers through host MPI, reductions through the reducer: the same losses as the pipeline
    on mpi4py; ``close`` frees the pipelines' transports and communicators."""
    if comm.size < 2:
        pytest.skip("a pipeline needs 2+ ranks")
    from halo.transport import streams
    from halo.transport.ipc import IPCTransport
    from halo.transport.staged import StagedTransport
    from halo.transport.streams import SimDevice
    from sparsepipe_hpc.train import loop, transport

    layout = ["--stages", "2", "--micro-batches", "2", "--steps", "2",
              "--batch-size", str(2 * (comm.size // 2))]
    if comm.size % 2:
        pytest.skip("2 stages need an even world")
    plain = Trainer(parse_config(argv(shared, *layout, "--out", str(shared / "pipe-mpi"))), comm,
                    log=None).run()
    made: list = []
    make_transport = transport.make_transport

    def keep(*a):
        made.append(make_transport(*a))
        return made[-1]

    # The trainer's own device_comm for ``name``, its CUDA streams on the stand-in device.
    monkeypatch.setattr(streams, "CudaDevice", lambda device: SimDevice())
    monkeypatch.setattr(transport, "make_transport", keep)
    monkeypatch.setattr(loop, "device_comm", lambda _, device: transport.device_comm(name, device))
    t = Trainer(parse_config(argv(shared, *layout, "--out", str(shared / f"pipe-{name}"))), comm,
                log=None)
    kind = IPCTransport if name == "ipc" else StagedTransport
    assert len(made) == 2 and all(isinstance(tr, kind) for tr in made)  # train and eval pipes
    got = t.run()
    used = [bool(tr._targets or tr._buffers) if name == "ipc" else tr.pool.allocated > 0
            for tr in made]
    assert used[0] and used[1], "a pipeline's stage payloads skipped the transport"
    assert got["train"]["loss"] == pytest.approx(plain["train"]["loss"], rel=1e-6)
    assert got["eval"]["miou"] == pytest.approx(plain["eval"]["miou"], rel=1e-6)
    t.close()  # the stage messages' communicators too
    assert all(pipe._comm == MPI.COMM_NULL for pipe in (t.pipe, t.eval_pipe))
    assert name != "ipc" or all(tr.closed for tr in made)


@pytest.mark.parametrize("layout", ["grid", "replicas"])
def test_ipc_trains_as_mpi_and_close_frees_what_the_trainer_made(comm, shared, monkeypatch,
                                                                 layout):
    """--transport ipc's path (halos, plan coordinates and every device reduction through CUDA
    IPC; here its buffers and events in shared memory, its streams on the stand-in device)
    trains the same losses as mpi4py on host tensors, on a spatial grid and over data-parallel
    replicas; ``Trainer.close`` closes every IPC transport and reducer (the spatial and
    statistics groups', the gradient buckets'), frees the communicators and leaves no
    shared-memory file."""
    if comm.size < 2:
        pytest.skip("needs 2+ ranks")
    import os

    from halo.transport.ipc import IPCTransport
    from halo.transport.ipc_memory import PREFIX
    from halo.transport.ipc_reduce import IPCReducer
    from halo.transport.streams import SimDevice
    from sparsepipe_hpc.train import loop
    from sparsepipe_hpc.train.transport import DeviceComm

    grid = ["--grid", f"{comm.size},1,1" if layout == "grid" else "1,1,1", "--steps", "2"]
    plain = Trainer(parse_config(argv(shared, *grid, "--out", str(shared / f"ipc-mpi-{layout}"))),
                    comm, log=None).run()
    made: list[IPCTransport] = []

    def ipc_on_stand_in(name, device):
        dev = SimDevice()

        def transport(grid_comm):
            made.append(IPCTransport(grid_comm, dev))
            return made[-1]

        def reducer(group_comm):
            r = IPCReducer(group_comm, dev)
            made.append(r.transport)
            return r
        return DeviceComm(halo=transport, reducer=reducer)

    monkeypatch.setattr(loop, "device_comm", ipc_on_stand_in)
    t = Trainer(parse_config(argv(shared, *grid, "--out", str(shared / f"ipc-{layout}"))), comm,
                log=None)
    ipc = t.run()
    assert ipc["train"]["loss"] == pytest.approx(plain["train"]["loss"], rel=1e-6)
    assert ipc["eval"]["miou"] == pytest.approx(plain["eval"]["miou"], rel=1e-6)
    # grid: the halo transport, the spatial and statistics groups' reducers, the gradient
    # buckets'; replicas (no spatial group): the statistics group's and the buckets'
    assert len(made) == (4 if layout == "grid" else 2) and not any(tr.closed for tr in made)
    t.close()
    assert all(tr.closed for tr in made)
    assert MPI.COMM_NULL == t.ctx.spatial_comm == t.ctx.stats_comm
    mine = f"{PREFIX}{os.getpid()}-"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(mine)]
    t.close()  # again: nothing
