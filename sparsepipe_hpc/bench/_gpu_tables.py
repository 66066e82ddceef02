"""The micro-benchmark tables of ``bench gpu`` (:mod:`.gpu` documents each and runs them).

    t = layer_table(x, 64, args, device, torch.float16)   # {"project": {...}, "spconv": ..., ...}

Each table times its variants side by side (:func:`~.common.time_alternating`) on the scene's
voxels in one precision (``dtype``: None is float32, else the autocast dtype).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch

from sparsepipe_hpc.bench.common import time_alternating, time_step
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["SKIP_CPU_AUTOCAST", "autocast", "variants", "switched", "spconv_runs", "triton_skip",
           "layer_table",
           "strided_table", "batchnorm_table", "kernel_maps_table"]

SKIP_CPU_AUTOCAST = ("spconv's own layers fail under CPU autocast (their torch.mm into a float32 "
                     "buffer comes back in the autocast dtype); they run it on CUDA")


def variants(device: torch.device) -> dict[str, Callable[[], ContextManager[None]]]:
    """Other ways the project's layers can run than the default, to time beside it: name -> a
    context that switches to it; CUDA only. ``explicit``: strided layers by explicit
    gather-GEMM-scatter, not through spconv's implicit GEMM (:mod:`sparsepipe_hpc.engine.
    spconv_igemm`, the default there since an H100 timed both). ``inline``: strided layers' maps
    built on the compute stream, not on the side stream (:mod:`sparsepipe_hpc.mapstream`, the
    default since an H200 timed both)."""
    from sparsepipe_hpc import mapstream
    from sparsepipe_hpc.engine import spconv_igemm

    if device.type != "cuda":
        return {}
    return {"explicit": lambda: spconv_igemm.only_on(), "inline": lambda: mapstream.aside(False)}


def spconv_runs(device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    return device.type == "cuda" or dtype is None


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> Any:
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def triton_skip(device: torch.device) -> Optional[str]:
    """Why spconv-triton cannot run on ``device`` here; None when it can."""
    if device.type != "cuda":
        return "spconv-triton runs on GPUs only"
    try:
        import spconv_triton.pytorch  # noqa: F401
    except ImportError as e:
        return f"spconv-triton is not importable ({e}); pip install spconv-triton"
    return None


def layer_table(x: SparseTensor, c: int, args: Any, device: torch.device,
                dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """One submanifold 3x3x3 layer c -> c, fwd+bwd: project, spconv, and torch.mm's shapes."""
    import spconv.pytorch as sp

    from halo.kmap import kernel_map
    from sparsepipe_hpc.bench.spconv_unet import _algo
    from sparsepipe_hpc.nn import SubMConv3d

    n = x.num_voxels
    pairs = kernel_map(x.coords, x.coords, 3, 1, 1, 1).num_pairs
    feats = torch.randn(n, c, device=device)
    xs = x.replace(feats=feats, kmaps={})
    grad = torch.randn(n, c, device=device)

    def layer_fn(engine: str) -> Callable[[], None]:
        torch.manual_seed(0)
        layer = SubMConv3d(c, c, 3, engine=engine).to(device)

        def fn() -> None:
            f = feats.clone().requires_grad_()
            with autocast(device, dtype):
                y = layer(xs.replace(feats=f)).feats
            y.backward(grad.to(y.dtype))
        return fn

    useful = 3 * 2 * pairs * c * c
    dense = 3 * 2 * n * 27 * c * c
    out: dict[str, Any] = {"channels": c, "voxels": n, "pairs": pairs,
                           "useful_flop": useful, "dense_flop": dense}
    # The default engine's layer, and the same layer on the own torch engine (explicit pairs,
    # one gather, GEMM and scatter-add per offset): the engines a GPU default is chosen from.
    layers = {"project": layer_fn("auto"), "project_torch": layer_fn("torch")}
    if spconv_runs(device, dtype):
        layers["spconv"] = _plain_layer(sp, _algo(device), x, c, feats, grad, device, dtype)
    else:
        out["spconv"] = {"skipped": SKIP_CPU_AUTOCAST}
    if args.triton:
        skip = triton_skip(device)
        if skip is None:
            import spconv_triton.pytorch as spt

            layers["spconv_triton"] = _plain_layer(spt, None, x, c, feats, grad, device, dtype)
        else:
            out["spconv_triton"] = {"skipped": skip}
    for name, t in time_alternating(layers, device, args.repeats).items():
        out[name] = dict(t, tflops=useful / t["median_s"] / 1e12)

    # torch.mm's operands only now, so the layers' peak memory does not hold them
    mm_dtype = dtype or torch.float32
    a = torch.randn(n, 27 * c, device=device, dtype=mm_dtype)
    b = torch.randn(27 * c, c, device=device, dtype=mm_dtype)
    g = torch.randn(n, c, device=device, dtype=mm_dtype)

    def mm_fn() -> None:
        torch.mm(a, b)
        torch.mm(a.t(), g)
        torch.mm(g, b.t())

    t = time_step(mm_fn, device, args.repeats)
    out["torch_mm"] = dict(t, tflops=dense / t["median_s"] / 1e12)
    del a, b, g
    return out


def _plain_layer(sp: Any, algo: Any, x: SparseTensor, c: int, feats: torch.Tensor,
                 grad: torch.Tensor, device: torch.device,
                 dtype: Optional[torch.dtype]) -> Callable[[], None]:
    """``sp.SubMConv3d`` c -> c fwd+bwd (``sp``: spconv's or spconv-triton's ``pytorch``
    module), on the indices it built once, as the project's layer runs on its map."""
    ref = sp.SubMConv3d(c, c, 3, padding=1, bias=False, indice_key="l", algo=algo).to(device)
    st = sp.SparseConvTensor(feats, x.coords, list(x.spatial_shape), x.batch_size)
    with torch.no_grad():  # the indices it builds are kept on its output (key "l"), not on its
        st = ref(st).replace_feature(feats)  # input: time it on them

    def fn() -> None:
        f = feats.clone().requires_grad_()
        with autocast(device, dtype):
            y = ref(st.replace_feature(f)).features
        y.backward(grad.to(y.dtype))
    return fn


def strided_table(x: SparseTensor, c: int, args: Any, device: torch.device,
                  dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """A U-Net level's way down and back: ``SparseConv3d`` k2s2 c -> 2c, then
    ``SparseInverseConv3d`` 2c -> c onto the same voxels, forward + backward with their map built
    each time (as a step does): the project's (default engine, and each of :func:`variants`)
    against spconv's own layers."""
    from sparsepipe_hpc.bench.spconv_unet import _algo
    from sparsepipe_hpc.nn import SparseConv3d, SparseInverseConv3d

    n = x.num_voxels
    feats = torch.randn(n, c, device=device)
    grad = torch.randn(n, c, device=device)

    def project() -> Callable[[], None]:
        torch.manual_seed(0)
        down = SparseConv3d(c, 2 * c, 2, 2, indice_key="d").to(device)
        up = SparseInverseConv3d(2 * c, c, 2, indice_key="d").to(device)

        def fn() -> None:
            f = feats.clone().requires_grad_()
            with autocast(device, dtype):
                y = up(down(x.replace(feats=f, kmaps={}))).feats
            y.backward(grad.to(y.dtype))
        return fn

    def spconv() -> Callable[[], None]:
        import spconv.pytorch as sp

        algo = _algo(device)
        down = sp.SparseConv3d(c, 2 * c, 2, 2, bias=False, indice_key="d", algo=algo).to(device)
        up = sp.SparseInverseConv3d(2 * c, c, 2, bias=False, indice_key="d",
                                    algo=algo).to(device)

        def fn() -> None:
            f = feats.clone().requires_grad_()
            with autocast(device, dtype):
                st = sp.SparseConvTensor(f, x.coords, list(x.spatial_shape), x.batch_size)
                y = up(down(st)).features
            y.backward(grad.to(y.dtype))
        return fn

    out: dict[str, Any] = {"channels": [c, 2 * c], "voxels": n}
    runs = {"project": project()}
    runs.update({f"project_{v}": switched(runs["project"], on)
                 for v, on in variants(device).items()})
    ours = list(runs)
    if spconv_runs(device, dtype):
        runs["spconv"] = spconv()
    else:
        out["spconv"] = {"skipped": SKIP_CPU_AUTOCAST}
    out.update(time_alternating(runs, device, args.repeats))
    if "spconv" in runs:
        for name in ours:
            out[f"time_ratio_{name}_over_spconv"] = (out[name]["median_s"]
                                                     / out["spconv"]["median_s"])
    return out


def switched(fn: Callable[[], None], on: Callable[[], ContextManager[None]]
             ) -> Callable[[], None]:
    """``fn`` run with a :func:`variants` switch on."""
    def run() -> None:
        with on():
            fn()
    return run


def batchnorm_table(x: SparseTensor, c: int, args: Any, device: torch.device,
                    dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """One BatchNorm over [N, c] features, fwd+bwd: project (one rank, group form) and torch's."""
    from sparsepipe_hpc.nn import BatchNorm

    n = x.num_voxels
    feats = torch.randn(n, c, device=device, dtype=dtype or torch.float32) * 3 + 1
    grad = torch.randn_like(feats)
    xs = x.replace(feats=feats, kmaps={})
    ours, group, ref = BatchNorm(c).to(device), BatchNorm(c, deferred=True).to(device), \
        torch.nn.BatchNorm1d(c).to(device)

    def run(layer: torch.nn.Module, sparse: bool) -> Callable[[], None]:
        def fn() -> None:
            f = feats.clone().requires_grad_()
            with autocast(device, dtype):
                y = layer(xs.replace(feats=f)).feats if sparse else layer(f)
            y.backward(grad.to(y.dtype))
            if sparse and layer is group:
                group.commit()
        return fn

    out: dict[str, Any] = {"channels": c, "voxels": n}
    out.update(time_alternating({"project": run(ours, True), "project_group": run(group, True),
                                 "torch": run(ref, False)}, device, args.repeats))
    for name in ("project", "project_group"):
        out[f"time_ratio_{name}_over_torch"] = out[name]["median_s"] / out["torch"]["median_s"]
    return out


def kernel_maps_table(x: SparseTensor, depth: int, device: torch.device, repeats: int
                      ) -> dict[str, Any]:
    """Index building for a U-Net of ``depth`` levels: project (what its layers build: spconv's
    own submanifold indices, :func:`~halo.kmap.strided_map` for each k2s2 layer and, where its
    layers run them, the map's implicit-GEMM tables) versus spconv's indices for the same
    layers; and the strided layers' part alone (``project_strided``, ``spconv_strided``), where
    the two differ."""
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    from halo.kmap import kernel_map, output_coords, strided_map
    from sparsepipe_hpc.engine import spconv_igemm
    from sparsepipe_hpc.engine.spconv_engine import patch_spconv
    from sparsepipe_hpc.engine.spconv_subm import subm_map

    patch_spconv()
    cuda = device.type == "cuda"
    igemm = device.type in spconv_igemm.DEVICES and cuda

    def levels() -> list[tuple[torch.Tensor, list[int]]]:
        out, coords, shape = [], x.coords, list(x.spatial_shape)
        for _ in range(depth + 1):
            out.append((coords, shape))
            nxt = [s // 2 for s in shape]
            coords = output_coords(coords, 2, 2, 0, 1, nxt)
            shape = nxt
        return out

    lv = levels()

    def project(subm: bool = True) -> None:
        for i, (c, shape) in enumerate(lv):
            if subm:
                subm_map(c, shape, x.batch_size, 3, 1)
            if i < depth:
                _, km = strided_map(c, 2, 2, 0, 1, [s // 2 for s in shape], x.batch_size)
                if igemm:
                    spconv_igemm.tables(km)

    def explicit_subm() -> None:
        for c, _ in lv:
            kernel_map(c, c, 3, 1, 1, 1)

    def spconv_own(with_subm: bool = True) -> None:
        for i, (c, shape) in enumerate(lv):
            for subm, ks, st in ((True, 3, 1), (False, 2, 2)) if i < depth else ((True, 3, 1),):
                if subm and not with_subm:
                    continue
                args = (c, x.batch_size, shape)
                geo = dict(ksize=[ks] * 3, stride=[st] * 3, padding=[0] * 3, dilation=[1] * 3,
                           out_padding=[0] * 3, subm=subm, transpose=False)
                if cuda:
                    ops.get_indice_pairs_implicit_gemm(*args, ConvAlgo.MaskImplicitGemm,
                                                       is_train=True, **geo)
                else:
                    ops.get_indice_pairs(*args, ConvAlgo.Native, geo["ksize"], geo["stride"],
                                         geo["padding"], geo["dilation"], geo["out_padding"],
                                         subm, False)

    out: dict[str, Any] = time_alternating(
        {"project": project, "spconv": spconv_own, "explicit_subm_maps": explicit_subm,
         "project_strided": lambda: project(subm=False),
         "spconv_strided": lambda: spconv_own(with_subm=False)}, device, repeats)
    out["ratio_project_over_spconv"] = out["project"]["median_s"] / out["spconv"]["median_s"]
    out["ratio_strided_project_over_spconv"] = (out["project_strided"]["median_s"]
                                                / out["spconv_strided"]["median_s"])
    return out
