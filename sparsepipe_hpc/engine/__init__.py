"""Local sparse-convolution engines behind one interface (see :mod:`.base`).

    from sparsepipe_hpc.engine import get_engine
    engine = get_engine("auto")   # the measured-faster correct engine for the device

``"auto"`` picks spconv on CUDA, and on CPU spconv when torch runs one thread (it measured 1.5x
faster than the own engine on a U-Net step: ``python -m sparsepipe_hpc.bench engine``) but the
own torch engine with more threads, since spconv's CPU kernels are only correct on one thread and
the engine forces them to it. Without spconv installed (no ``cpu``/``cuda12``/``cuda13`` extra)
``auto`` is the own engine.

Submanifold layers run on the engine's own index data when it has some (:meth:`Engine.subm_map`):
spconv's hash-built indices and its submanifold kernels, Native on the CPU, implicit GEMM on CUDA
(:mod:`.spconv_subm`). Measured on the CPU, one thread (``bench engine``, 157k voxels, U-Net width
16 depth 4, forward+backward): the spconv engine's step 2.51 s -> 1.95 s with this path. On an
H100 (``bench gpu``, 1.66 M voxels, one submanifold 64 -> 64 layer forward+backward): this
engine's 32.9 ms in fp32 and 7.03 ms in fp16 equal spconv's own ``SubMConv3d`` (32.8, 7.03 ms;
the implicit GEMM at 89 TFLOP/s of useful work in fp16; docs/gpu.md). Strided layers and the halo
pairs of distributed layers keep explicit kernel maps, which the spconv engine runs through
spconv's implicit GEMM on tables built from the map where it is dense enough (CUDA: a strided
layer and its inverse; :mod:`.spconv_igemm`), else by gather-GEMM-scatter. The own torch engine
and spconv-triton are not timed on a GPU yet (``bench gpu --triton``), so the CUDA default stays
spconv, which meets its own speed.
"""

from __future__ import annotations

import torch

from sparsepipe_hpc.engine.base import Engine, Progress
from sparsepipe_hpc.engine.spconv_engine import SpconvEngine
from sparsepipe_hpc.engine.torch_engine import TorchEngine

__all__ = ["Engine", "Progress", "SpconvEngine", "TorchEngine", "get_engine", "ENGINES"]

ENGINES = ("auto", "torch", "spconv")
_cache: dict[str, Engine] = {}


def get_engine(name: str = "auto", device: torch.device | str = "cpu") -> Engine:
    """The engine called ``name`` (one of ENGINES); ``auto`` depends on ``device``."""
    if name == "auto":
        from sparsepipe_hpc.deps import spconv_available

        cuda = torch.device(device).type == "cuda"
        fast = cuda or torch.get_num_threads() == 1
        name = "spconv" if fast and spconv_available() else "torch"
    if name not in _cache:
        if name == "torch":
            _cache[name] = TorchEngine()
        elif name == "spconv":
            _cache[name] = SpconvEngine()
        else:
            raise ValueError(f"engine must be one of {ENGINES}; got {name!r}")
    return _cache[name]
