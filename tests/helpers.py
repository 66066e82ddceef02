"""Small builders shared by the test suites (random voxel clouds, a fake clock, a full disk,
the environment of a child process)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from sparsepipe_hpc.sparse import SparseTensor


REPO = Path(__file__).resolve().parents[1]


def repo_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus ``extra``, with the repository first on PYTHONPATH
    and what was there kept: on the GPU machine spconv lives only on PYTHONPATH (``.site``)."""
    env = dict(os.environ if base is None else base, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def random_cloud(gen: torch.Generator, n: int, shape=(16, 16, 16), batch: int = 2,
                 channels: int = 4, dtype=torch.float64) -> SparseTensor:
    """Up to ``n`` unique random voxels per batch, with corners and faces of the grid included."""
    xyz = torch.stack([torch.randint(0, s, (n,), generator=gen) for s in shape], 1)
    corners = torch.tensor([[a, b, c] for a in (0, shape[0] - 1) for b in (0, shape[1] - 1)
                            for c in (0, shape[2] - 1)])
    rows = []
    for b in range(batch):
        pts = torch.cat([xyz, corners]) if b == 0 else xyz
        rows.append(torch.cat([torch.full((len(pts), 1), b), pts], 1))
    coords = torch.unique(torch.cat(rows), dim=0).int()
    feats = torch.randn(len(coords), channels, generator=gen, dtype=dtype)
    return SparseTensor(coords, feats, shape, batch)


def reduce_input(k: int, rank: int, dtypes: list[torch.dtype]) -> torch.Tensor:
    """All-reduce input ``k`` of ``rank`` (k + 3 values, dtype ``dtypes[k % len]``): exact in
    every dtype, and a bool pattern that differs between ranks."""
    dtype = dtypes[k % len(dtypes)]
    if dtype == torch.bool:
        return torch.arange(k + 3) % (rank + 2) == 0
    return (torch.arange(k + 3, dtype=torch.float64) + 10 * rank).to(dtype)


class FakeClock:
    """Stands in for the ``time`` module inside halo.transport.delay: time moves only when the test
    (or the transport's own ``sleep``) moves it, so nothing depends on how loaded the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FillsUp:
    """A text file whose writes fail with ENOSPC after the first ``ok`` (a disk filling up)."""

    def __init__(self, real: Any, ok: int) -> None:
        self.real, self.ok, self.writes = real, ok, 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes > self.ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class HostReads:
    """Counts the torch ops that read device data back to the host (on CUDA each waits for the
    device): ``.item()``/``int()``, ``torch.equal``, ``nonzero`` and boolean indexing, and the
    copies out of torch that dispatch no op (``.tolist()``, ``.numpy()``, ``.cpu()``, numpy's
    ``__array__``; but not in the host transports, ``halo/transport/``, whose buffers are host
    memory by design). On the CPU they cost nothing, so a test counts them instead of timing
    them.

        with HostReads() as reads:
            layer(x)
        assert reads.count == 0, reads.ops
    """

    SYNCING = ("_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select",
               "_unique2", "unique_consecutive", "unique_dim")
    COPIES = ("tolist", "numpy", "cpu", "__array__")

    def _wrap(self, name: str) -> Any:
        import sys

        real = getattr(torch.Tensor, name)
        transport = os.path.join("halo", "transport") + os.sep

        def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if transport not in caller and not caller.endswith(os.path.join("torch", "_tensor.py")):
                self.ops.append(name)
            return real(t, *args, **kwargs)

        return real, counted

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name.split("::")[-1]
                bool_index = name.startswith("index") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple))
                              else ()))
                if name in HostReads.SYNCING or bool_index:
                    reads.ops.append(name)
                return func(*args, **(kwargs or {}))

        self.ops: list[str] = []
        self._mode = _Mode()

    @property
    def count(self) -> int:
        return len(self.ops)

    def __enter__(self) -> "HostReads":
        self._saved = {}
        for name in self.COPIES:
            self._saved[name], counted = self._wrap(name)
            setattr(torch.Tensor, name, counted)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


def cuda_unet_step(gen: torch.Generator) -> Any:
    """A function running one U-Net step on CUDA (width 16, depth 3, up to 4000 voxels per sample
    in 32^3, float32) from fresh kernel maps, returning its output and every gradient: for
    comparing two ways of running the same step."""
    from sparsepipe_hpc.nn import SparseUNet

    x = random_cloud(gen, 4000, shape=(32, 32, 32), channels=3, dtype=torch.float32)
    xc = x.replace(coords=x.coords.cuda(), feats=x.feats.cuda())
    torch.manual_seed(0)
    net = SparseUNet(3, 5, width=16, depth=3).cuda()

    def step() -> list[torch.Tensor]:
        net.zero_grad()
        y = net(xc.replace(kmaps={})).feats
        y.square().mean().backward()
        return [y.detach().clone()] + [q.grad.clone() for q in net.parameters()]
    return step
