"""GPU benchmark: the project's U-Net against the same U-Net written with spconv's layers (issue 10).

    python -m sparsepipe_hpc.bench gpu --json gpu.json                  # the issue's scene, CUDA
    python -m sparsepipe_hpc.bench gpu --device cpu --rooms 1 --voxel-size 0.2 --width 4 \\
        --depth 2 --points 20000 --layer-channels 8 --repeats 1          # a smoke run on a CPU

Side by side in one run, on one device, every step a forward + backward from fresh coordinates
(kernel maps included, as in training), timed with CUDA events after a synchronize (wall clock
on a CPU), median of ``--repeats`` rounds after a warm-up, the variants of a table alternating
within each round; the JSON is rewritten after each precision (``complete`` once all ran):

  steps        per precision (fp32, and fp16/bf16 under torch.autocast): the plain spconv U-Net
               (:mod:`.spconv_unet`), ``SparseUNet`` on one rank (and ``sparseunet_window``: the
               same with its strided layers as dense GEMMs, :mod:`sparsepipe_hpc.engine.window`,
               off by default until measured), and the distributed model on a
               1x1x1 grid (every layer through the spatial path, empty exchanges); step time and
               peak device memory, and each one's ratio to plain spconv (the issue's target:
               <= 1.10 in time and memory). ``--triton`` adds the plain U-Net written with
               spconv-triton's layers (``spconv_triton_unet``: a pure-Triton drop-in for spconv,
               GPUs only; Triton tunes each new shape in the warm-up round).
               ``launches``: per network, the kernels, CUDA runtime calls, host
               synchronizations and torch ops of one more step (:mod:`.launches`), what made
               the project's step slow before (issue 10's profile).
  layer        one submanifold 3x3x3 layer, C -> C channels, forward + backward on the scene's
               voxels: project layer (``project``: the default engine; ``project_torch``: the
               own torch engine), spconv's ``SubMConv3d``, and ``torch.mm`` of the same GEMM
               shapes ([N, 27 C] x [27 C, C] and its two gradients); TFLOP/s of useful work
               (2 * pairs * C * C per GEMM pass, three passes); with ``--triton`` also
               spconv-triton's ``SubMConv3d``.
  strided      a U-Net level's strided pair on the scene's voxels, forward + backward, its map
               built each time: ``SparseConv3d`` k2s2 W -> 2W and ``SparseInverseConv3d`` back
               (W = ``--width``), the project's (``project``; ``project_window`` as dense GEMMs)
               against spconv's own (implicit GEMM on CUDA).
  gathers      a row gather of the scene's voxels at ``--width`` and twice as many channels in
               the precision's dtype, through a random permutation, by each form torch has:
               ``x[idx]`` (``index``; the strided layers' explicit-pair backward gathers so, and
               an H100 spent 5.5 ms of an 85 ms fp16 step in the one-block-per-row kernel it
               launches), ``index_select``, a gather of single elements (``elements``) and a
               scatter by the inverse permutation (``index_copy``): which form narrow rows want.
  batchnorm    one BatchNorm over the scene's voxels at ``--width`` channels, forward + backward:
               the project's on one rank (as the trainer runs it), the project's group form
               (what each rank of a spatial group runs, all-reduce aside: deferred statistics on
               one rank take the same passes), and ``torch.nn.BatchNorm1d``.
  kernel_maps  index building for the whole U-Net: the project's (spconv's submanifold indices
               plus own strided maps) versus spconv's own, and the explicit-pair submanifold maps
               the local path no longer needs.

Defaults are the issue's scene: four synthetic rooms at 2 cm (issue 10 measured 1.78 M voxels),
width 32, depth 4. On a CPU everything runs (``--device cpu``) at whatever size is asked, so a test
checks the JSON's structure; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from sparsepipe_hpc.bench.common import environment, write_json
from sparsepipe_hpc.bench.launches import step_launches
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["main", "build_parser", "synthetic_rooms", "unet_steps", "time_step",
           "time_alternating", "triton_skip"]

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def synthetic_rooms(rooms: int, voxel_size: float, points: int, seed: int = 0,
                    size: tuple[float, float, float] = (6.0, 6.0, 3.0)) -> SparseTensor:
    """``rooms`` furnished synthetic rooms voxelized into one batch (3 colour channels)."""
    from sparsepipe_hpc.data.synth import make_room
    from sparsepipe_hpc.voxelize import voxelize

    rng = np.random.default_rng(seed)
    clouds = [make_room(rng, size=size, points=(points, points))[:2] for _ in range(rooms)]
    lo = np.min([xyz.min(0) for xyz, _ in clouds], 0) - voxel_size
    hi = np.max([xyz.max(0) for xyz, _ in clouds], 0)
    shape = np.ceil((hi - lo) / voxel_size).astype(int) + 1
    shape = (np.ceil(shape / 16) * 16).astype(int)
    vox = [voxelize(xyz, rgb.astype(np.float32) / 255.0, voxel_size, lo, shape)
           for xyz, rgb in clouds]
    return SparseTensor.from_voxels(vox, shape)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], Any], device: torch.device) -> tuple[float, Optional[int]]:
    """Seconds of one ``fn()`` (CUDA events on a GPU, wall clock on a CPU) and the peak device
    memory during it (None on a CPU)."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device)


def time_alternating(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                     warmup: int = 1) -> dict[str, dict[str, Any]]:
    """Per name of ``fns``: median and min seconds of one call and its peak device memory.

    ``warmup`` rounds, then ``repeats`` rounds that call every function once in turn, so that
    drift (clocks, other load, allocator state) falls on all of them alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, Optional[int]] = {name: None for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, peak = _time_once(fn, device)
            times[name].append(t)
            if peak is not None:
                peaks[name] = max(peaks[name] or 0, peak)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "repeats": repeats,
                   "peak_bytes": peaks[name]} for name, ts in times.items()}


def time_step(fn: Callable[[], Any], device: torch.device, repeats: int,
              warmup: int = 1) -> dict[str, Any]:
    """Median and min seconds of ``fn`` (CUDA events on a GPU) and the peak device memory."""
    return time_alternating({"fn": fn}, device, repeats, warmup)["fn"]


def _autocast(device: torch.device, dtype: Optional[torch.dtype]) -> Any:
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


def unet_steps(x: SparseTensor, width: int, depth: int, device: torch.device,
               dtype: Optional[torch.dtype], triton: bool = False
               ) -> dict[str, Callable[[], None]]:
    """One forward + backward each, from fresh coordinates (kernel maps included): the plain spconv
    U-Net (left out where spconv cannot run it: CPU autocast), ``SparseUNet`` on one rank (also
    with its strided layers as dense GEMMs: ``sparseunet_window``), and the
    distributed model on a 1x1x1 grid; the same seed, so the U-Nets start alike. ``triton``: also
    the plain U-Net in spconv-triton's layers, where :func:`triton_skip` allows."""
    from mpi4py import MPI

    from sparsepipe_hpc.bench.spconv_unet import SpconvUNet
    from sparsepipe_hpc.engine import window
    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    classes = 8
    torch.manual_seed(0)
    plain = SpconvUNet(x.num_channels, classes, width, depth, device).to(device)
    ours = SparseUNet(x.num_channels, classes, width=width, depth=depth).to(device)
    ctx = ParallelContext(MPI.COMM_SELF, RankLayout(1, 1, (1, 1, 1)), force_spatial=True)

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            y = plain(x.to_spconv()).features
        y.float().square().mean().backward()

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            y = ours(x.replace(kmaps={})).feats
        y.float().square().mean().backward()

    def dist_step() -> None:
        ours.zero_grad(set_to_none=True)
        xl, = ctx.distribute(x.replace(kmaps={}), align=ours.total_stride)
        with _autocast(device, dtype):
            y = ours(xl).feats
        y.float().square().mean().backward()

    steps = {"spconv_unet": plain_step} if _spconv_runs(device, dtype) else {}
    if triton and triton_skip(device) is None:
        torch.manual_seed(0)
        tri = SpconvUNet(x.num_channels, classes, width, depth, device,
                         package="spconv_triton").to(device)

        def triton_step() -> None:
            tri.zero_grad(set_to_none=True)
            with _autocast(device, dtype):
                y = tri(tri.tensor(x)).features
            y.float().square().mean().backward()

        steps["spconv_triton_unet"] = triton_step

    def window_step() -> None:  # the strided layers as dense GEMMs (engine.window, off today)
        with window.on(device.type):
            ours_step()

    steps.update(sparseunet=ours_step, sparseunet_window=window_step,
                 distributed_1x1x1=dist_step)
    return steps


def _steps(x: SparseTensor, args: Any, device: torch.device,
           dtype: Optional[torch.dtype]) -> dict[str, Any]:
    steps = unet_steps(x, args.width, args.depth, device, dtype, args.triton)
    out: dict[str, Any] = {}
    if "spconv_unet" not in steps:
        out["spconv_unet"] = {"skipped": SKIP_CPU_AUTOCAST}
    if args.triton and "spconv_triton_unet" not in steps:
        out["spconv_triton_unet"] = {"skipped": triton_skip(device)}
    out.update(time_alternating(steps, device, args.repeats))
    out["launches"] = {}
    for name, fn in steps.items():
        try:  # a diagnostic: a profiler that fails must not cost the timings above
            out["launches"][name] = step_launches(fn, device)
        except Exception as e:
            out["launches"][name] = {"error": f"{type(e).__name__}: {e}"}
    base = out["spconv_unet"]
    for name in ("sparseunet", "sparseunet_window", "distributed_1x1x1", "spconv_triton_unet"):
        if name not in steps:
            continue
        if "median_s" in base:
            out[f"time_ratio_{name}_over_spconv"] = out[name]["median_s"] / base["median_s"]
        if base.get("peak_bytes"):
            out[f"memory_ratio_{name}_over_spconv"] = out[name]["peak_bytes"] / base["peak_bytes"]
    return out


SKIP_CPU_AUTOCAST = ("spconv's own layers fail under CPU autocast (their torch.mm into a float32 "
                     "buffer comes back in the autocast dtype); they run it on CUDA")


def _spconv_runs(device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    return device.type == "cuda" or dtype is None


def _layer(x: SparseTensor, c: int, args: Any, device: torch.device,
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
            with _autocast(device, dtype):
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
    if _spconv_runs(device, dtype):
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
        with _autocast(device, dtype):
            y = ref(st.replace_feature(f)).features
        y.backward(grad.to(y.dtype))
    return fn


def _strided(x: SparseTensor, c: int, args: Any, device: torch.device,
             dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """A U-Net level's way down and back: ``SparseConv3d`` k2s2 c -> 2c, then
    ``SparseInverseConv3d`` 2c -> c onto the same voxels, forward + backward with their map built
    each time (as a step does): the project's (default engine, and through
    :mod:`sparsepipe_hpc.engine.window`) against spconv's own layers."""
    from sparsepipe_hpc.bench.spconv_unet import _algo
    from sparsepipe_hpc.engine import window
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
            with _autocast(device, dtype):
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
            with _autocast(device, dtype):
                st = sp.SparseConvTensor(f, x.coords, list(x.spatial_shape), x.batch_size)
                y = up(down(st)).features
            y.backward(grad.to(y.dtype))
        return fn

    out: dict[str, Any] = {"channels": [c, 2 * c], "voxels": n}
    plain = project()

    def dense() -> None:  # the same layers through engine.window
        with window.on(device.type):
            plain()

    runs = {"project": plain, "project_window": dense}
    if _spconv_runs(device, dtype):
        runs["spconv"] = spconv()
    else:
        out["spconv"] = {"skipped": SKIP_CPU_AUTOCAST}
    out.update(time_alternating(runs, device, args.repeats))
    if "spconv" in runs:
        for name in ("project", "project_window"):
            out[f"time_ratio_{name}_over_spconv"] = (out[name]["median_s"]
                                                     / out["spconv"]["median_s"])
    return out


def _gathers(n: int, c: int, args: Any, device: torch.device,
             dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """``y = x[perm]`` for x [n, c] and a random permutation (a kernel map's rows are grouped by
    offset, closer to ascending: a random one is the worst case for locality), by four forms,
    all equal. ``elements`` builds its element index inside the timing, as a caller would;
    ``index_copy``'s inverse permutation is built once outside it, as a kernel map would keep
    it (and only a permutation has one)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, c, generator=g, device=device).to(dtype or torch.float32)
    perm = torch.randperm(n, generator=g, device=device)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n, device=device)
    cols = torch.arange(c, device=device)

    def index() -> torch.Tensor:
        return x[perm]

    def select() -> torch.Tensor:
        return torch.index_select(x, 0, perm)

    def elements() -> torch.Tensor:
        return x.reshape(-1)[(perm[:, None] * c + cols).reshape(-1)].view(n, c)

    def scatter() -> torch.Tensor:
        return torch.empty_like(x).index_copy_(0, inverse, x)

    forms = {"index": index, "index_select": select, "elements": elements, "index_copy": scatter}
    want = index()
    for name, fn in forms.items():  # a form that gathers something else is no contender
        if not torch.equal(fn(), want):
            raise RuntimeError(f"bench gpu gathers: {name} differs from x[idx]")
    out: dict[str, Any] = {"rows": n, "channels": c, "row_bytes": c * x.element_size()}
    out.update(time_alternating(forms, device, args.repeats))
    return out


def _batchnorm(x: SparseTensor, c: int, args: Any, device: torch.device,
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
            with _autocast(device, dtype):
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


def _kernel_maps(x: SparseTensor, depth: int, device: torch.device, repeats: int
                 ) -> dict[str, Any]:
    """Index building for a U-Net of ``depth`` levels: project (what its layers build: spconv's
    own submanifold indices, :func:`~halo.kmap.strided_map` for each k2s2 layer) versus spconv's
    indices for the same layers."""
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    from halo.kmap import kernel_map, output_coords, strided_map
    from sparsepipe_hpc.engine.spconv_engine import patch_spconv
    from sparsepipe_hpc.engine.spconv_subm import subm_map

    patch_spconv()
    cuda = device.type == "cuda"

    def levels() -> list[tuple[torch.Tensor, list[int]]]:
        out, coords, shape = [], x.coords, list(x.spatial_shape)
        for _ in range(depth + 1):
            out.append((coords, shape))
            nxt = [s // 2 for s in shape]
            coords = output_coords(coords, 2, 2, 0, 1, nxt)
            shape = nxt
        return out

    lv = levels()

    def project() -> None:
        for i, (c, shape) in enumerate(lv):
            subm_map(c, shape, x.batch_size, 3, 1)
            if i < depth:
                strided_map(c, 2, 2, 0, 1, [s // 2 for s in shape])

    def explicit_subm() -> None:
        for c, _ in lv:
            kernel_map(c, c, 3, 1, 1, 1)

    def spconv_own() -> None:
        for i, (c, shape) in enumerate(lv):
            for subm, ks, st in ((True, 3, 1), (False, 2, 2)) if i < depth else ((True, 3, 1),):
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

    out: dict[str, Any] = time_alternating({"project": project, "spconv": spconv_own,
                                            "explicit_subm_maps": explicit_subm}, device, repeats)
    out["ratio_project_over_spconv"] = out["project"]["median_s"] / out["spconv"]["median_s"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench gpu")
    p.add_argument("--json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rooms", type=int, default=4)
    p.add_argument("--voxel-size", type=float, default=0.02)
    p.add_argument("--points", type=int, default=2_000_000, help="points per room")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--layer-channels", type=int, default=64)
    p.add_argument("--precisions", default=None,
                   help="comma-separated (default fp32,fp16). spconv 2.3.8 has no bfloat16: under "
                   "bf16 autocast its own layers compute in fp16 (their custom_fwd casts to "
                   "float16 whatever the autocast dtype) and the project's in float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--triton", action="store_true", help="also time the plain U-Net and the layer "
                   "in spconv-triton's layers (pip install spconv-triton; GPUs only)")
    return p


def main(argv: list[str]) -> None:
    p = build_parser()
    args = p.parse_args(argv)

    from sparsepipe_hpc.train.device import resolve_device

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # spconv's CPU kernels race with more
    precisions = args.precisions or "fp32,fp16"
    names = [s.strip() for s in precisions.split(",") if s.strip()]
    bad = [s for s in names if s not in PRECISIONS]
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {sorted(PRECISIONS)}")

    x = synthetic_rooms(args.rooms, args.voxel_size, args.points)
    x = x.to(device)
    print(f"{args.rooms} room(s) at {args.voxel_size} m: {x.num_voxels} voxels, grid "
          f"{x.spatial_shape}; U-Net width {args.width} depth {args.depth}; device {device}")
    result: dict[str, Any] = {
        "env": environment(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "scene": {"rooms": args.rooms, "voxel_size": args.voxel_size, "points": args.points,
                  "voxels": x.num_voxels, "spatial_shape": list(x.spatial_shape),
                  "width": args.width, "depth": args.depth},
        "targets": {"time_ratio_max": 1.10, "memory_ratio_max": 1.10},
        "steps": {}, "layer": {}, "strided": {}, "gathers": {}, "batchnorm": {},
        "complete": False}
    for name in names:
        steps = result["steps"][name] = _steps(x, args, device, PRECISIONS[name])
        for net in ("spconv_unet", "spconv_triton_unet", "sparseunet", "sparseunet_window",
                    "distributed_1x1x1"):
            if net not in steps:
                continue
            t = steps[net]
            if "skipped" in t:
                print(f"{name} step {net:18s} skipped: {t['skipped']}")
                continue
            mem = f", peak {t['peak_bytes'] / 2**30:.2f} GiB" if t["peak_bytes"] else ""
            print(f"{name} step {net:18s} {t['median_s']:8.3f} s{mem}")
        for net, n in steps["launches"].items():
            print(f"{name} launches {net:18s} " + (n["error"] if "error" in n else
                  f"{n['kernels']} kernels, {n['syncs']} host syncs ({n['torch_host_syncs']} in "
                  f"torch ops), {n['runtime_calls'].get('cudaFree', 0)} cudaFree, "
                  f"{n['runtime_calls'].get('cudaMalloc', 0)} cudaMalloc, {n['aten_ops']} torch "
                  "ops"))
            if n.get("sync_sites"):
                print("    from: " + ", ".join(f"{k} x{v}" for k, v in
                                               list(n["sync_sites"].items())[:6]))
        if "time_ratio_distributed_1x1x1_over_spconv" in steps:
            print(f"{name} distributed / spconv: time "
                  f"{steps['time_ratio_distributed_1x1x1_over_spconv']:.2f}")
        layer = result["layer"][name] = _layer(x, args.layer_channels, args, device,
                                               PRECISIONS[name])
        for net in ("project", "project_torch", "spconv", "spconv_triton", "torch_mm"):
            t = layer.get(net, {"skipped": "not asked for"})
            if "skipped" in t:
                continue
            print(f"{name} layer {args.layer_channels}->{args.layer_channels} {net:8s} "
                  f"{t['median_s'] * 1e3:8.2f} ms {t['tflops']:8.3f} TFLOP/s")
        st = result["strided"][name] = _strided(x, args.width, args, device, PRECISIONS[name])
        print(f"{name} strided {args.width}->{2 * args.width}->{args.width} (map included): "
              f"project {st['project']['median_s'] * 1e3:.2f} ms, as dense GEMMs "
              f"{st['project_window']['median_s'] * 1e3:.2f} ms" +
              (f", spconv {st['spconv']['median_s'] * 1e3:.2f} ms" if "median_s" in
               st.get("spconv", {}) else ""))
        result["gathers"][name] = []
        for c in (args.width, 2 * args.width):
            gt = _gathers(x.num_voxels, c, args, device, PRECISIONS[name])
            result["gathers"][name].append(gt)
            print(f"{name} gather {x.num_voxels} rows of {gt['row_bytes']} B: " + ", ".join(
                f"{form} {gt[form]['median_s'] * 1e3:.2f} ms"
                for form in ("index", "index_select", "elements", "index_copy")))
        bn = result["batchnorm"][name] = _batchnorm(x, args.width, args, device,
                                                    PRECISIONS[name])
        print(f"{name} batchnorm {args.width} ch: project {bn['project']['median_s'] * 1e3:.2f} ms"
              f", group form {bn['project_group']['median_s'] * 1e3:.2f} ms, torch "
              f"{bn['torch']['median_s'] * 1e3:.2f} ms")
        write_json(args.json, result)  # what is measured so far survives a later crash
    km = result["kernel_maps"] = _kernel_maps(x, args.depth, device, args.repeats)
    print(f"kernel maps: project {km['project']['median_s'] * 1e3:.1f} ms, spconv "
          f"{km['spconv']['median_s'] * 1e3:.1f} ms, explicit subm maps "
          f"{km['explicit_subm_maps']['median_s'] * 1e3:.1f} ms")
    result["complete"] = True
    write_json(args.json, result)
