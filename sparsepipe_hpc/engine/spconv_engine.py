"""spconv as the local engine: its kernels on our kernel maps (gather-GEMM-scatter; on CUDA its
implicit GEMM where a map is dense enough, :mod:`.spconv_igemm`; submanifold layers on its own
indices, :mod:`.spconv_subm`).

Two facts about spconv 2.3.8's CPU build, measured here, shape this module:
  * with more than one torch thread its forward and input gradient are wrong (a race in its CPU
    scatter-add; max error ~0.5 on outputs ~2.5, different every run), so on CPU every call runs
    with torch's thread count set to 1 and restored afterwards;
  * its backward asks ``torch.cuda.current_stream()`` even for CPU tensors, which raises on a
    CPU-only torch, so :func:`patch_spconv` makes that lookup return stream 0 without CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from sparsepipe_hpc.engine import spconv_igemm
from sparsepipe_hpc.engine.base import Engine, Progress

__all__ = ["SpconvEngine", "SpconvDtypeError", "patch_spconv", "single_thread", "spconv_call",
           "native_dtype", "SPLIT_BACKWARD", "split_backward"]

_patched = False


def patch_spconv() -> None:
    """Make spconv's CPU path work on a CPU-only torch (idempotent)."""
    global _patched
    if _patched:
        return
    import spconv.pytorch.hash as sp_hash
    import spconv.pytorch.ops as sp_ops

    def current_stream() -> int:
        return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0

    sp_ops.get_current_stream = current_stream
    sp_hash.get_current_stream = current_stream
    _patched = True


@contextlib.contextmanager
def single_thread(device: torch.device) -> Iterator[None]:
    """Run spconv's CPU kernels on one thread (they race with more); no-op on CUDA."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class SpconvDtypeError(TypeError):
    """A dtype spconv has no kernels for on the tensors' device."""


def native_dtype(dtype: torch.dtype, device: torch.device,
                 gather_channels: Sequence[int] = ()) -> torch.dtype:
    """The dtype spconv computes a ``dtype`` call in on ``device``: bfloat16 in float32, on
    every device. spconv 2.3.8 has no bfloat16 at all: its torch -> tensorview dtype table
    (``spconv/pytorch/cppcore.py``) lacks it, so a CUDA bfloat16 tensor raises KeyError there
    (spconv issue 673). fp16 is the mixed precision that runs spconv's own fast kernels.

    ``gather_channels``: (C_in, C_out) of a gather-GEMM-scatter call (``ConvAlgo.Native``; not
    the implicit GEMM). On CUDA its fp16 GEMMs take channel counts that are multiples of 8: on an
    H100, a strided layer of 4 channels raised "this m, n, k isn't supported due to misaligned
    contiguous dim" in its weight gradient (spconv's tuner checks the strides it is given, its
    kernel the problem's shape), while 8 and more ran. Such a call computes in float32.

    Raises SpconvDtypeError for float64 on CUDA: spconv's CUDA build has GEMM kernels for
    float32 and float16 only (its CPU path computes float64 through torch)."""
    if dtype == torch.float64 and device.type == "cuda":
        raise SpconvDtypeError("the spconv engine has no float64 kernels on CUDA (spconv's CUDA "
                               "build has float32 and float16 only); build the model with "
                               "engine='torch' for float64 on a GPU, or compute in float32")
    if dtype == torch.float16 and device.type == "cuda" and any(c % 8 for c in gather_channels):
        return torch.float32
    return torch.float32 if dtype == torch.bfloat16 else dtype


@contextlib.contextmanager
def spconv_call(device: torch.device) -> Iterator[None]:
    """Around every spconv kernel call: one thread on CPU (:func:`single_thread`), and autocast
    off, since spconv runs some of its GEMMs through torch (``torch.mm`` for a submanifold
    centre), which autocast would hand back in another dtype than the kernels it feeds expect;
    the layers already cast inputs to the autocast dtype (:mod:`sparsepipe_hpc.nn.amp`); on
    CUDA, ``device`` made current: spconv launches on the current device and its current stream
    whatever device its tensors are on (``spconv/pytorch/cppcore.py`` maps every ``cuda:N`` to
    its device 0). Each only where it changes something: ~100 calls a U-Net step, on a host
    that an fp16 GPU step keeps busy (``bench host``)."""
    off = contextlib.nullcontext()
    cast = torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(
        device.type) else off
    elsewhere = (device.type == "cuda" and device.index is not None
                 and device.index != torch.cuda.current_device())
    with single_thread(device), cast, (torch.cuda.device(device) if elsewhere else off):
        yield


class SpconvEngine(Engine):
    name = "spconv"

    def __init__(self) -> None:
        from sparsepipe_hpc.deps import check_spconv

        check_spconv(required=True)  # one build, not two half-overwritten ones (once: cached)
        patch_spconv()
        from spconv.pytorch import ops

        self._ops = ops

    def subm_map(self, coords: torch.Tensor, spatial_shape: Sequence[int], batch_size: int,
                 kernel_size: int, dilation: int) -> Optional[Any]:
        """spconv's own submanifold indices (:mod:`.spconv_subm`); None for kernel size 1, and
        on a CPU grid past spconv's int32 index (:func:`.spconv_subm.indexable`)."""
        from sparsepipe_hpc.engine.spconv_subm import indexable, subm_map

        if kernel_size == 1 or not indexable(coords.device, spatial_shape, batch_size):
            return None

        return subm_map(coords, spatial_shape, batch_size, kernel_size, dilation)

    def forward(self, feats: torch.Tensor, weight: torch.Tensor, kmap: Any,
                progress: Progress = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        from sparsepipe_hpc.engine.spconv_subm import SubmMap, subm_forward

        if isinstance(kmap, SubmMap):
            y = subm_forward(feats, weight, kmap, progress)
            return y if out is None else out.add_(y)
        if kmap.num_pairs == 0:
            return feats.new_zeros(kmap.n_out, weight.shape[0]) if out is None else out
        if spconv_igemm.applies(kmap, feats, weight):
            work = native_dtype(feats.dtype, feats.device)  # its kernels: float32 and float16
            with spconv_call(feats.device):
                y = spconv_igemm.forward(feats.to(work).contiguous(),
                                         weight.to(work).contiguous(), kmap).to(feats.dtype)
            if progress is not None:
                progress()
            return y if out is None else out.add_(y)
        work = native_dtype(feats.dtype, feats.device, (weight.shape[2], weight.shape[0]))
        if work != feats.dtype:
            y = self.forward(feats.to(work), weight.to(work), kmap, progress).to(feats.dtype)
            return y if out is None else out.add_(y)
        pairs, counts = kmap.spconv_pairs()
        feats, weight = feats.contiguous(), weight.contiguous()
        with spconv_call(feats.device):
            for part in _chunks(counts, progress):
                y = self._ops.indice_conv(feats, weight, pairs, part, kmap.n_out, False, False)
                out = y if out is None else out.add_(y)
                if progress is not None:
                    progress()
        assert out is not None  # num_pairs > 0: at least one part ran
        return out

    def backward(self, feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                 kmap: Any, progress: Progress = None, need_input_grad: bool = True,
                 grad_in: Optional[torch.Tensor] = None
                 ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        from sparsepipe_hpc.engine.spconv_subm import SubmMap, subm_backward

        if isinstance(kmap, SubmMap):
            gi, gw = subm_backward(feats, weight, grad_out, kmap, progress,
                                   need_input_grad or grad_in is not None)
            if gi is not None and grad_in is not None:
                gi = grad_in.add_(gi)
            return (gi if need_input_grad or grad_in is not None else None), gw
        if kmap.num_pairs == 0:
            if grad_in is None and need_input_grad:
                grad_in = feats.new_zeros(kmap.n_in, weight.shape[2])
            return grad_in, torch.zeros_like(weight)
        if spconv_igemm.applies(kmap, feats, weight):
            work = native_dtype(feats.dtype, feats.device)
            with spconv_call(feats.device):
                gi, gw = spconv_igemm.backward(
                    feats.to(work).contiguous(), weight.to(work).contiguous(),
                    grad_out.to(work).contiguous(), kmap, need_input_grad or grad_in is not None)
            if progress is not None:
                progress()
            gw = gw.to(weight.dtype)
            if gi is None:
                return None, gw
            gi = gi.to(feats.dtype)
            return (gi if grad_in is None else grad_in.add_(gi)), gw
        work = native_dtype(feats.dtype, feats.device, (weight.shape[2], weight.shape[0]))
        if work != feats.dtype:
            gi, gw = self.backward(feats.to(work), weight.to(work), grad_out.to(work), kmap,
                                   progress, need_input_grad or grad_in is not None)
            gw = gw.to(weight.dtype)
            if gi is None:
                return None, gw
            gi = gi.to(feats.dtype)
            return (gi if grad_in is None else grad_in.add_(gi)), gw
        feats, grad_out = feats.contiguous(), grad_out.contiguous()
        input_grad = need_input_grad or grad_in is not None
        pairs, counts = kmap.spconv_pairs()
        if feats.device.type in SPLIT_BACKWARD:
            g_in, g_w = split_backward(self._ops, feats, weight, grad_out, pairs, counts,
                                       kmap.n_in, progress, input_grad)
        else:
            g_in, g_w = _spconv_backward(self._ops, feats, weight, grad_out, pairs, counts,
                                         progress)
        if not input_grad:
            return None, g_w
        assert g_in is not None
        return (g_in if grad_in is None else grad_in.add_(g_in)), g_w


# Devices whose explicit-pair backward avoids spconv's indice_conv_backward. On CUDA, for each
# offset's weight gradient it runs a split-K GEMM without the workspace it allocated (spconv
# 2.3.8, csrc/sparse/convops.py), so its GEMM library takes one with cudaMalloc and frees it with
# cudaFree, a device-wide sync: 64 of each per U-Net step on an H100 (none in a plain spconv
# network). On the CPU it costs nothing of the kind and ran 2x faster than the split form
# (strided layers of 157k voxels, 16/32 channels, one thread).
SPLIT_BACKWARD = ("cuda",)


def _spconv_backward(ops: Any, feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                     pairs: torch.Tensor, counts: torch.Tensor, progress: Progress
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of an explicit-pair call through spconv's indice_conv_backward (which
    computes the input gradient whether asked for or not)."""
    weight = weight.contiguous()
    g_in: Optional[torch.Tensor] = None
    g_w: Optional[torch.Tensor] = None
    with spconv_call(feats.device):
        for part in _chunks(counts, progress):
            gi, gw = ops.indice_conv_backward(feats, weight, grad_out, pairs, part, False, False)
            g_in = gi if g_in is None else g_in.add_(gi)
            g_w = gw if g_w is None else g_w.add_(gw)
            if progress is not None:
                progress()
    assert g_in is not None and g_w is not None  # num_pairs > 0: at least one part ran
    return g_in, g_w.view_as(weight)


def split_backward(ops: Any, feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                   pairs: torch.Tensor, counts: torch.Tensor, n_in: int, progress: Progress,
                   input_grad: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """The backward of a gather-GEMM-scatter call over spconv's ``pairs`` [2, K, L] and host
    ``counts`` [K] without spconv's backward kernels: the input gradient is the transposed
    convolution of ``grad_out`` (spconv's forward kernel, the pairs read in reverse, the weight
    as [C_in, K, C_out]; None where no offset has pairs); the weight gradient one torch GEMM per
    offset. ``feats``, ``grad_out`` contiguous."""
    w_t = weight.permute(2, 1, 0).contiguous() if input_grad else None
    g_in: Optional[torch.Tensor] = None
    g_w = torch.zeros_like(weight)
    with spconv_call(feats.device):  # autocast off: the GEMMs stay in the dtype given
        for part in _chunks(counts, progress):
            if not bool(part.any()):  # spconv's kernel refuses a call without pairs
                continue
            if w_t is not None:
                gi = ops.indice_conv(grad_out, w_t, pairs, part, n_in, True, False)
                g_in = gi if g_in is None else g_in.add_(gi)
            for k, n in enumerate(part.tolist()):  # host counts: no device sync
                if n:
                    i, o = pairs[0, k, :n], pairs[1, k, :n]
                    torch.mm(grad_out[o].t(), feats[i], out=g_w[:, k])
            if progress is not None:
                progress()
    return g_in, g_w


def _chunks(counts: torch.Tensor, progress: Progress, parts: int = 4) -> list[torch.Tensor]:
    """The pair counts as one piece, or, when an exchange needs progress calls between pieces of
    work, as ``parts`` copies each keeping only a contiguous range of kernel offsets."""
    if progress is None or len(counts) < parts:
        return [counts]
    bounds = torch.linspace(0, len(counts), parts + 1).round().long().tolist()
    host = counts.cpu()  # one copy, not a device sync per piece
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if int(host[a:b].sum()):
            part = torch.zeros_like(counts)
            part[a:b] = counts[a:b]
            pieces.append(part)
    return pieces or [counts]
