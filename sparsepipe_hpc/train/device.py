"""Where and in which precision the trainer computes: ``--device`` and ``--precision``.

    device = resolve_device("auto", local_rank=0)        # cuda:<local rank % GPUs>, else cpu
    prec = Precision("bf16", device)
    with prec.autocast():                                 # bf16 convolutions and activations
        loss = model(x.to(device)) ...
    prec.backward(loss); allreduce(grads); prec.step(optimizer)   # GradScaler only for fp16
    prec = Precision("fp16", device, comm)   # skip verdicts agreed over comm (pipeline stages)

``auto`` takes the GPU that :mod:`launch.device` gives this local rank (round-robin over the
visible devices) when torch sees CUDA, else the CPU; ``cuda`` without a usable CUDA device is a
:class:`ConfigError` naming what torch sees. Mixed precision is torch's autocast: weights and
optimizer state stay float32 (master weights), convolutions and linear layers run in the low
dtype (the library's sparse convolutions cast to it themselves, :mod:`sparsepipe_hpc.nn.amp`),
BatchNorm statistics, gradients and the loss's and pooling's reductions stay in float32/float64
(halo gradients are summed in the low dtype, as one process sums them), the loss is float32;
fp16 adds dynamic loss scaling (``torch.amp.GradScaler``; bf16 has float32's range and needs
none). Gradients are all-reduced while still scaled; the scaler unscales after the sum. Ranks
that hold the same parameters then see the same sums; ranks that hold different ones (pipeline
stages) agree on the inf/NaN verdict over ``comm`` (:class:`AgreedGradScaler`), so every rank
skips (or takes) the same step and keeps the same loss scale: a stage unscales the gradients that
the last stage's scaled loss sent back with the scale that loss was multiplied by.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch

from sparsepipe_hpc.train.config import ConfigError

__all__ = ["DEVICES", "PRECISIONS", "resolve_device", "trainer_device", "cuda_device_count",
           "compute_threads", "AgreedGradScaler", "Precision", "precision_dtype"]

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(name: str) -> Optional[torch.dtype]:
    """The autocast dtype of ``--precision name`` (None for fp32); ConfigError if unknown."""
    if name not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
    return _DTYPES.get(name)


def cuda_device_count() -> int:
    """CUDA devices torch can use in this process (0 on a CPU build of torch or without a driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as none; --device cuda then says so
        return 0


def resolve_device(name: str, local_rank: int = 0, count: Optional[int] = None) -> torch.device:
    """The device of ``--device name`` for the rank with ``local_rank`` on its node.

    ``count``: CUDA devices visible (default: what torch sees). Makes the chosen GPU torch's
    current device. Raises ConfigError for an unknown name or ``cuda`` without a CUDA device.
    """
    if name not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    n = cuda_device_count() if count is None else count
    if n == 0:
        if name == "auto":
            return torch.device("cpu")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
            f"{'unset' if visible is None else repr(visible)}); run on a GPU machine with a CUDA "
            "build of torch, or pass --device cpu (or auto, which falls back to the CPU)")
    from launch.device import gpu_for_local_rank, make_current

    index = gpu_for_local_rank(local_rank, n)
    assert index is not None  # n > 0
    if count is None:  # a real device: current for torch and CuPy, as launch.device.bind_gpu does
        make_current(index)
    return torch.device("cuda", index)


def compute_threads(cfg: Any, comm: Any) -> int:
    """Torch threads per rank for ``--threads`` (None: by device). On a CPU 1: ranks share the
    cores, and spconv's CPU kernels are only correct on one. On a GPU the rank's share of the
    node's cores (:func:`launch.env.threads_per_rank`): the host reads and voxelizes each step's
    samples while the device waits. **Collective** when it falls to splitting ``comm``."""
    if cfg.threads is not None:
        return int(cfg.threads)
    if cfg.device == "cpu":
        return 1
    from launch.env import detect, ranks_sharing_cores, threads_per_rank

    # On every rank alike (cfg agreed), whether it sees a GPU or not: both are collective.
    placement, sharing = detect(comm), ranks_sharing_cores(comm)
    return threads_per_rank(placement, sharing=sharing) if cuda_device_count() > 0 else 1


def trainer_device(cfg: Any, comm: Any) -> torch.device:
    """The trainer's device on this rank. **Collective** (the local rank may come from
    splitting ``comm``; a ConfigError on any rank is raised on all, and so is a SetupError
    where ``--device auto`` found a GPU on some ranks only: they would pick other transports
    and wait in other collectives)."""
    from launch.env import detect
    from sparsepipe_hpc.train.agreement import SetupError, agree

    if cfg.device == "cpu":
        return torch.device("cpu")
    local_rank = detect(comm).local_rank
    device = agree(comm, lambda: resolve_device(cfg.device, local_rank))
    kinds = comm.allgather(device.type)
    if len(set(kinds)) > 1:
        where = "; ".join(f"{k} on rank(s) {[r for r, v in enumerate(kinds) if v == k]}"
                          for k in sorted(set(kinds)))
        raise SetupError(f"--device {cfg.device} resolved to other kinds of device on different "
                         f"ranks ({where}); every rank must train on the same kind: give every "
                         "rank a GPU, or pass --device cpu")
    return device


class AgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN verdict is the maximum over the mpi4py
    communicator ``comm``: every rank skips or takes the same step and so keeps the same scale,
    though each holds other parameters (a pipeline stage's). Collective in ``unscale_`` (one
    scalar all-reduce per step; ``step`` calls it). As torch's ShardedGradScaler does for its
    process groups, it reduces the parent's per-device verdicts in place, before ``step`` and
    ``update`` read them.

    The scale lives on ``device`` from the start: a stage that never scales a loss (all but the
    last) still unscales what came back from it.
    """

    def __init__(self, device: torch.device, comm: Any):
        super().__init__(device.type)
        self.comm = comm
        self._lazy_init_scale_growth_tracker(device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        from mpi4py import MPI

        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        mine = max((float(v.item()) for v in found.values()), default=0.0)
        agreed = self.comm.allreduce(mine, op=MPI.MAX)
        for v in found.values():
            v.fill_(agreed)


class Precision:
    """``--precision`` on a device: the autocast context and the (fp16) loss scaler, whose
    skip verdicts are agreed over ``comm`` when given (:class:`AgreedGradScaler`; pass the world
    communicator whenever ranks hold different parameters)."""

    def __init__(self, name: str, device: torch.device, comm: Any = None):
        self.dtype = precision_dtype(name)
        self.name, self.device = name, device
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.skipped = False   # whether the last step() skipped the update (fp16 only)
        self.skipped_in_a_row = 0  # updates skipped since the last one applied (checkpointed)
        if name == "fp16":
            self.scaler = (torch.amp.GradScaler(device.type) if comm is None
                           else AgreedGradScaler(device, comm))

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward (and the loss) under autocast in the low dtype; no-op for fp32."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from: multiplied by the loss scale for fp16, else itself."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        self.scale_loss(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step on (all-reduced) gradients: unscaled and skipped on inf/NaN for fp16
        (``self.skipped`` says which)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.unscale_(optimizer)  # here, so fused optimizers see the agreed verdict too
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        self.skipped = any(float(v.item()) > 0 for v in found.values())
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if self.skipped else 0
        self.scaler.step(optimizer)
        self.scaler.update()

    @contextlib.contextmanager
    def skippable(self, module: torch.nn.Module) -> Iterator[None]:
        """A training step of ``module`` that, when fp16's loss scaler skips it, leaves the
        module's buffers as they were, not only its weights: a forward that overflowed float16
        has already folded inf/NaN batch statistics into BatchNorm's running statistics, which
        no later step washes out (evaluation would then see NaN everywhere). Every rank skips
        together (the verdict is agreed), so every rank restores together. No-op but fp16."""
        if self.scaler is None:
            yield
            return
        kept = [(b, b.detach().clone()) for b in module.buffers()]
        self.skipped = False
        yield
        if self.skipped:
            with torch.no_grad():
                for b, saved in kept:
                    b.copy_(saved)

    def state_dict(self) -> Optional[dict[str, Any]]:
        if self.scaler is None:
            return None
        return {**self.scaler.state_dict(), "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if self.scaler is not None and state:
            state = dict(state)
            self.skipped_in_a_row = int(state.pop("skipped_in_a_row", 0))  # 0: older checkpoints
            self.scaler.load_state_dict(state)
