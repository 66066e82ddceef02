"""Row gathers of feature matrices, in one place, so their form can follow a measurement.

    y = take(x, idx)                    # x[idx]: [len(idx), C], x [N, C] contiguous
    with rows.form("elements"):         # bench gpu's comparison
        ...

The explicit-pair paths gather feature rows per kernel offset (the strided layers' weight
gradient on CUDA gathers both operands: :func:`~.spconv_engine.split_backward`). torch's CUDA
``x[idx]`` launches one thread block per row, which for narrow fp16 rows (32-64 channels: 64-128
bytes) moves little per block; an H100 spent 5.5 ms of an 85 ms fp16 U-Net step there.
``"elements"`` gathers single elements by a flat index instead (``bench gpu``'s ``gathers``
table times both, and its ``sparseunet_elements`` step the whole U-Net with it). Both forms give
the same values, bit for bit. :data:`FORM` stays ``"index"`` until a GPU measures the other
faster.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["FORMS", "FORM", "take", "form"]

FORMS = ("index", "elements")
FORM = "index"


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a 2-D ``x`` [N, C] and an integer ``idx`` [M]: [M, C], by :data:`FORM`."""
    if FORM == "index" or x.dim() != 2 or not x.is_contiguous():
        return x[idx]
    c = x.shape[1]
    flat = (idx.long()[:, None] * c + torch.arange(c, device=idx.device)).reshape(-1)
    return x.reshape(-1)[flat].view(len(idx), c)


@contextlib.contextmanager
def form(name: str) -> Iterator[None]:
    """Within the block, :func:`take` gathers by ``name`` (one of :data:`FORMS`)."""
    global FORM
    if name not in FORMS:
        raise ValueError(f"rows.form: {name!r} is not one of {FORMS}")
    saved, FORM = FORM, name
    try:
        yield
    finally:
        FORM = saved
