"""Mixed precision for the library's own autograd functions: they follow ``torch.autocast``.

    with torch.autocast("cuda", dtype=torch.float16):
        y = SubMConv3d(32, 32)(x)      # convolution in float16, weights stay float32
        z = BatchNorm(32)(y)           # statistics in float64/float32, output float16

torch's autocast rewrites its own ops (``mm``, ``linear``); a custom ``autograd.Function`` runs
whatever dtypes it is handed. So the layers cast at their boundary, as autocast would:
convolution inputs and weights to the autocast dtype (:func:`autocast_inputs`; autograd casts the
weight's gradient back to float32, the master weights' dtype), BatchNorm computes in float32 and
returns the input's dtype (:func:`sparsepipe_hpc.nn.functional.batch_norm`), reductions over ranks
stay float64. Outside autocast nothing changes: the equivalence tests keep running in float64.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["autocast_dtype", "autocast_inputs", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast computes in on ``device_type`` ("cpu", "cuda"), or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The floating tensors cast to the autocast dtype of their device when autocast is on there
    (float64 stays float64, as torch's autocast leaves it); unchanged otherwise."""
    if not tensors:
        return tensors
    dtype = autocast_dtype(tensors[0].device.type)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in tensors)
