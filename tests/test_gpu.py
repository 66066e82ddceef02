"""The local path on a CUDA device equals the CPU path (skipped where torch sees no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from halo.kmap import KernelMap, kernel_map, output_coords, strided_map
from helpers import cuda_unet_step, random_cloud, repo_env
from sparsepipe_hpc.bench.launches import is_sync_warning
from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.nn import SparseUNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_kernel_maps_on_gpu_equal_cpu(gen):
    x = random_cloud(gen, 2000)
    for args in ((3, 1, 1, 1), (3, 2, 1, 1), (2, 2, 0, 1)):
        out = x.coords if args[1] == 1 else output_coords(x.coords, *args, (8, 8, 8))
        cpu = kernel_map(x.coords, out, *args)
        gpu = kernel_map(x.coords.cuda(), out.cuda(), *args)
        assert torch.equal(gpu.in_rows.cpu(), cpu.in_rows)
        assert torch.equal(gpu.out_rows.cpu(), cpu.out_rows)


def _syncs(fn) -> list[str]:
    """Where ``fn()`` made torch wait for the GPU (torch's sync debug mode): one 'file:line' per
    wait, after one call beforehand (a first call's one-time setup is not a per-step cost)."""
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if is_sync_warning(str(w.message))]


def test_kernel_maps_wait_for_the_gpu_once_per_pass(gen):
    """A kernel map's lookup pass waits once (its hit counts; with tiling windows it took four
    waits before), a k2s2 layer's outputs and map once, and spconv's layout of a map and of its
    transpose not at all: before, each blocking host-to-device copy of the offsets' bounds
    waited for the device, 16 times in a U-Net step on an H100."""
    x = random_cloud(gen, 2000)
    c = x.coords.cuda()
    out = output_coords(c, 2, 2, 0, 1, (8, 8, 8))
    waits = _syncs(lambda: kernel_map(c, c, 3, 1, 1, 1))
    assert len(waits) == 1, waits
    for batch_size in (None, x.batch_size):  # int64 keys; int32 ones, the batch bound checked
        waits = _syncs(lambda: strided_map(c, 2, 2, 0, 1, (7, 8, 8), batch_size))  # some dropped
        assert len(waits) == 1, waits
    waits = _syncs(lambda: kernel_map(c, out, 2, 2, 0, 1))  # tiling windows: one lookup pass
    assert len(waits) == 1, waits
    km = kernel_map(c, out, 2, 2, 0, 1)

    def layouts() -> None:  # on a new map each call: the layout is kept on the map
        m = KernelMap(km.in_rows, km.out_rows, km.ptr, km.n_in, km.n_out)
        m.spconv_pairs(), m.transpose().spconv_pairs()
    assert _syncs(layouts) == []


def _path(name: str):
    """The spconv engine's way with explicit maps on CUDA: ``implicit``, spconv's implicit GEMM
    where the map is dense enough (the default), or ``explicit`` gather-GEMM-scatter always."""
    import contextlib

    from sparsepipe_hpc.engine import spconv_igemm

    return spconv_igemm.only_on() if name == "explicit" else contextlib.nullcontext()


@pytest.mark.parametrize("engine,path", [("torch", "explicit"), ("spconv", "implicit"),
                                         ("spconv", "explicit")])
def test_engines_on_gpu_equal_cpu(gen, engine, path):
    x = random_cloud(gen, 3000, channels=8, dtype=torch.float32)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    kg = kernel_map(x.coords.cuda(), x.coords.cuda(), 3, 1, 1, 1)
    w = torch.randn(16, 27, 8, generator=gen)
    g = torch.randn(km.n_out, 16, generator=gen)
    ref_y = get_engine("torch").forward(x.feats, w, km)
    ref_gi, ref_gw = get_engine("torch").backward(x.feats, w, g, km)
    eng = get_engine(engine, "cuda")
    with _path(path):
        y = eng.forward(x.feats.cuda(), w.cuda(), kg)
        gi, gw = eng.backward(x.feats.cuda(), w.cuda(), g.cuda(), kg)
    torch.testing.assert_close(y.cpu(), ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gi.cpu(), ref_gi, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw.cpu(), ref_gw, rtol=1e-3, atol=1e-3)


def test_unet_step_on_gpu(gen):
    x = random_cloud(gen, 4000, shape=(32, 32, 32), channels=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = SparseUNet(3, 5, width=8, depth=3).cuda()
    y = net(x.replace(coords=x.coords.cuda(), feats=x.feats.cuda()))
    y.feats.square().mean().backward()
    assert y.feats.is_cuda and all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("k,dtype,progress", [(3, torch.float32, False), (3, torch.float16, False),
                                               (5, torch.float32, False), (5, torch.float32, True)])
def test_spconv_subm_map_on_gpu_equals_cpu(gen, k, dtype, progress):
    """spconv's own indices on CUDA against the CPU reference: implicit GEMM for 3x3x3, the Native
    path for 5x5x5 (kernel volume over 32; its backward without spconv's backward kernels),
    whole and between progress calls."""
    from sparsepipe_hpc.engine.spconv_subm import subm_backward, subm_forward, subm_map

    x = random_cloud(gen, 3000, channels=16, dtype=torch.float32)
    km = kernel_map(x.coords, x.coords, k, 1, k // 2, 1)
    w = torch.randn(16, k ** 3, 16, generator=gen) / (4 * k ** 1.5)
    g = torch.randn(km.n_out, 16, generator=gen)
    ref_y = get_engine("torch").forward(x.feats, w, km)
    ref_gi, ref_gw = get_engine("torch").backward(x.feats, w, g, km)
    m = subm_map(x.coords.cuda(), x.spatial_shape, x.batch_size, k, 1)
    assert m.implicit_gemm == (k == 3)
    calls: list = []
    p = (lambda: calls.append(1)) if progress else None
    f, wc, gc = x.feats.cuda().to(dtype), w.cuda().to(dtype), g.cuda().to(dtype)
    y = subm_forward(f, wc, m, p)
    gi, gw = subm_backward(f, wc, gc, m, p)
    assert bool(calls) == progress
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(y.float().cpu(), ref_y, **tol)
    torch.testing.assert_close(gi.float().cpu(), ref_gi, **tol)
    torch.testing.assert_close(gw.float().cpu(), ref_gw, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (2, 2, 1), (3, 2, 1)])
def test_strided_map_and_its_backward_on_gpu_equal_cpu(gen, k, s, p):
    """A strided layer's outputs and map built on the GPU equal the CPU's; its spconv backward
    on CUDA, whole and between progress calls, equals the torch engine on the CPU: through
    implicit GEMM (the default: the map is dense) and explicitly (input gradient by spconv's
    forward kernel, weight gradient by torch GEMMs). A sparse part of the map (as a halo part
    is) stays explicit."""
    from sparsepipe_hpc.engine import spconv_igemm

    x = random_cloud(gen, 3000, channels=8, dtype=torch.float32)
    shape = tuple(int(v) + 1 for v in x.coords[:, 1:].max(0).values)
    out_shape = tuple((n + 2 * p - k) // s + 1 for n in shape)
    out, km = strided_map(x.coords, k, s, p, 1, out_shape)
    for batch_size in (x.batch_size, None):  # int32 keys (where windows tile), int64 ones
        out_g, km_g = strided_map(x.coords.cuda(), k, s, p, 1, out_shape, batch_size)
        assert torch.equal(out_g.cpu(), out) and torch.equal(km_g.ptr, km.ptr)
        assert torch.equal(km_g.in_rows.cpu(), km.in_rows)
        assert torch.equal(km_g.out_rows.cpu(), km.out_rows)
    w = torch.randn(16, k ** 3, 8, generator=gen) / 10
    g = torch.randn(km.n_out, 16, generator=gen)
    ref_gi, ref_gw = get_engine("torch").backward(x.feats, w, g, km)
    eng = get_engine("spconv", "cuda")
    f = x.feats.cuda()
    assert spconv_igemm.applies(km_g, f, w)
    assert not spconv_igemm.applies(km_g.select(km_g.out_rows < 10), f, w)
    for path in ("implicit", "explicit"):
        with _path(path):
            assert spconv_igemm.applies(km_g, f, w) == (path == "implicit")
            eng.forward(f, w.cuda(), km_g)  # implicit GEMM's backward reads its forward's mask
            for progress in (None, lambda: None):
                gi, gw = eng.backward(f, w.cuda(), g.cuda(), km_g, progress)
                torch.testing.assert_close(gi.cpu(), ref_gi, rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(gw.cpu(), ref_gw, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1)])
def test_explicit_maps_through_implicit_gemm_on_gpu_equal_cpu(gen, dtype, k, s, p):
    """engine.spconv_igemm (CUDA's default for strided maps): a strided map and its
    transpose through spconv's implicit GEMM on the project's own tables, forward and backward,
    equal the torch engine on the CPU; two same-shape layers on one map (forward 1, forward 2,
    backward 2, backward 1) each get their own gradients."""
    from sparsepipe_hpc.engine import spconv_igemm

    x = random_cloud(gen, 3000, channels=8, dtype=torch.float32)
    shape = tuple(int(v) + 1 for v in x.coords[:, 1:].max(0).values)
    out_shape = tuple((n + 2 * p - k) // s + 1 for n in shape)
    _, km = strided_map(x.coords, k, s, p, 1, out_shape)
    _, km_g = strided_map(x.coords.cuda(), k, s, p, 1, out_shape)
    ref_eng, eng = get_engine("torch"), get_engine("spconv", "cuda")
    tol = dict(rtol=1e-2, atol=5e-2) if dtype == torch.float16 else dict(rtol=1e-3, atol=1e-3)
    for m, m_g, c_in, c_out in ((km, km_g, 8, 16), (km.transpose(), km_g.transpose(), 16, 8)):
        layers = [(torch.randn(m.n_in, c_in, generator=gen, dtype=torch.float64),
                   torch.randn(c_out, k ** 3, c_in, generator=gen, dtype=torch.float64) / 10,
                   torch.randn(m.n_out, c_out, generator=gen, dtype=torch.float64))
                  for _ in range(2)]
        with spconv_igemm.only_on("cuda"):
            dev = [tuple(t.cuda().to(dtype) for t in layer) for layer in layers]
            assert spconv_igemm.applies(m_g, dev[0][0], dev[0][1])
            outs = [eng.forward(f, w, m_g) for f, w, _ in dev]
            grads = [eng.backward(f, w, g, m_g) for f, w, g in reversed(dev)][::-1]
        for (f, w, g), y, (gi, gw) in zip(layers, outs, grads):
            ref_gi, ref_gw = ref_eng.backward(f, w, g, m)
            torch.testing.assert_close(y.double().cpu(), ref_eng.forward(f, w, m), **tol)
            torch.testing.assert_close(gi.double().cpu(), ref_gi, **tol)
            torch.testing.assert_close(gw.double().cpu(), ref_gw, rtol=2e-2, atol=2e-1)


def test_unet_with_implicit_gemm_strided_layers_equals_the_explicit_path_on_gpu(gen):
    """The whole U-Net step with its strided and inverse layers through implicit GEMM (the
    default on CUDA) gives the explicit path's outputs and gradients (float32)."""
    from sparsepipe_hpc.engine import spconv_igemm

    step = cuda_unet_step(gen)
    with spconv_igemm.only_on():
        ref = step()
    calls, forward = [], spconv_igemm.forward
    spconv_igemm.forward = lambda *a: calls.append(1) or forward(*a)
    try:
        got = step()
    finally:
        spconv_igemm.forward = forward
    assert len(calls) == 6  # depth 3: three k2s2 layers and their inverses
    for a, r in zip(got, ref):  # relative to the norm: spconv's fp32 tiles may run TF32
        assert float((a - r).norm()) <= 5e-3 * float(r.norm())


def test_two_layers_sharing_one_subm_map_each_get_their_own_gradients(gen):
    """Every submanifold layer of one stride shares one SubmMap, and the implicit GEMM's
    backward reuses the mask its forward stored there, keyed by weight shape and dtype: two
    same-shape layers (a residual unit) run forward 1, forward 2, backward 2, backward 1, and
    each must get its own gradients (the mask may depend on the indices only, not the data)."""
    from sparsepipe_hpc.engine.spconv_subm import subm_backward, subm_forward, subm_map

    x = random_cloud(gen, 3000, channels=16, dtype=torch.float32)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    m = subm_map(x.coords.cuda(), x.spatial_shape, x.batch_size, 3, 1)
    ref = get_engine("torch")
    layers = [(torch.randn(km.n_in, 16, generator=gen), torch.randn(16, 27, 16, generator=gen) / 20,
               torch.randn(km.n_out, 16, generator=gen)) for _ in range(2)]
    outs = [subm_forward(f.cuda(), w.cuda(), m) for f, w, _ in layers]
    grads = [subm_backward(f.cuda(), w.cuda(), g.cuda(), m) for f, w, g in reversed(layers)][::-1]
    for (f, w, g), y, (gi, gw) in zip(layers, outs, grads):
        ref_gi, ref_gw = ref.backward(f, w, g, km)
        torch.testing.assert_close(y.cpu(), ref.forward(f, w, km), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(gi.cpu(), ref_gi, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(gw.cpu(), ref_gw, rtol=2e-2, atol=2e-1)


def test_unet_under_autocast_on_gpu(gen):
    x = random_cloud(gen, 4000, shape=(32, 32, 32), channels=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = SparseUNet(3, 5, width=8, depth=3).cuda()
    xc = x.replace(coords=x.coords.cuda(), feats=x.feats.cuda())
    y32 = net(xc.replace(kmaps={})).feats
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype):
            y = net(xc.replace(kmaps={})).feats
        assert y.dtype == dtype
        y.float().square().mean().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())
        net.zero_grad()
        err = (y.float() - y32).norm() / y32.norm()
        assert err < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batchnorm_forms_on_gpu_equal_cpu(gen, dtype, device="cuda"):
    """One CUDA rank (torch's fused kernel) and the group form (deferred statistics take it)
    equal the CPU layer in float32 on the same inputs: outputs, input and weight gradients,
    running statistics (fp16: features as a convolution under autocast hands them on)."""
    from sparsepipe_hpc.nn import BatchNorm, commit_batchnorm

    x = random_cloud(gen, 5000, channels=6, dtype=torch.float32)
    x = x.replace(feats=(x.feats * 3 + 2).to(dtype).float())
    g = torch.randn(x.feats.shape, generator=gen).to(dtype).float()
    cpu = BatchNorm(6)
    with torch.no_grad():
        cpu.weight.uniform_(0.5, 1.5)
        cpu.bias.uniform_(-1, 1)
    ref = _bn_step(cpu, x, g)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for deferred in (False, True):
        bn = BatchNorm(6, deferred=deferred)
        bn.load_state_dict(cpu.state_dict())
        bn.running_mean.zero_()
        bn.running_var.fill_(1)
        bn.to(device)
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            got = _bn_step(bn, x.replace(coords=x.coords.to(device),
                                         feats=x.feats.to(device, dtype)), g.to(device, dtype))
        assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == torch.float32
        assert commit_batchnorm(bn) == deferred
        for a, b in zip(got + (bn.running_mean, bn.running_var),
                        ref + (cpu.running_mean, cpu.running_var)):
            torch.testing.assert_close(a.float().cpu(), b, rtol=tol, atol=tol * float(b.abs().max()))


def _bn_step(bn, x, g):
    f = x.feats.clone().requires_grad_()
    y = bn(x.replace(feats=f)).feats
    y.backward(g)
    return y, f.grad, bn.weight.grad


@pytest.mark.parametrize("path", ["implicit", "explicit"])
@pytest.mark.parametrize("c_in,c_out", [(4, 8), (8, 4), (3, 13), (8, 16)])
def test_spconv_strided_layer_in_fp16_on_any_channels(gen, c_in, c_out, path):
    """spconv's fp16 gather-GEMM-scatter refused 4 channels on an H100 ('misaligned contiguous
    dim', in the weight gradient of a strided layer): the explicit path computes such calls in
    float32; through implicit GEMM (the default) and explicitly every channel count gives the
    float32 result to fp16 rounding."""
    x = random_cloud(gen, 3000, channels=c_in, dtype=torch.float32)
    out = output_coords(x.coords, 2, 2, 0, 1, (8, 8, 8))
    km = kernel_map(x.coords.cuda(), out.cuda(), 2, 2, 0, 1)
    w = torch.randn(c_out, 8, c_in, generator=gen).cuda()
    f = x.feats.cuda()
    g = torch.randn(km.n_out, c_out, generator=gen).cuda()
    eng = get_engine("spconv", "cuda")
    with _path(path):
        ref_y = eng.forward(f, w, km)
        ref_gi, ref_gw = eng.backward(f, w, g, km)
        y = eng.forward(f.half(), w.half(), km)
        gi, gw = eng.backward(f.half(), w.half(), g.half(), km)
    assert y.dtype == gi.dtype == gw.dtype == torch.float16
    for a, b in ((y, ref_y), (gi, ref_gi), (gw, ref_gw)):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


TRITON_TESTS = "SPARSEPIPE_TRITON_TESTS"


@pytest.mark.skipif(not os.environ.get(TRITON_TESTS), reason=f"spconv-triton compiles its kernels "
                    f"on first use (this test ran past 100 s on an H100); set {TRITON_TESTS}=1")
def test_spconv_triton_unet_is_the_same_architecture(device="cuda"):
    """The plain U-Net in spconv-triton's layers (``bench gpu --triton``): spconv's parameter
    count, one output row per input voxel in the input's order."""
    pytest.importorskip("spconv_triton.pytorch", reason="spconv-triton is not installed")
    from sparsepipe_hpc.bench.gpu import synthetic_rooms
    from sparsepipe_hpc.bench.spconv_unet import SpconvUNet

    x = synthetic_rooms(1, 0.2, 20000)
    x = x.replace(coords=x.coords.to(device), feats=x.feats.to(device))
    ref = SpconvUNet(3, 8, width=4, depth=2, device=torch.device(device))
    tri = SpconvUNet(3, 8, width=4, depth=2, device=torch.device(device),
                     package="spconv_triton").to(device)
    assert sum(p.numel() for p in tri.parameters()) == sum(p.numel() for p in ref.parameters())
    y = tri(tri.tensor(x))
    assert y.features.shape == (x.num_voxels, 8) and torch.equal(y.indices, x.coords)


def test_gpu_benchmark_runs_on_cuda(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "gpu", "--device", "cuda",
                           "--rooms", "1", "--voxel-size", "0.1", "--points", "50000",
                           "--width", "8", "--depth", "2", "--repeats", "2", "--json", str(out)],
                          env=repo_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["steps"]["fp16"]["spconv_unet"]["peak_bytes"] > 0
    assert "sparseunet_explicit" in r["steps"]["fp32"]["networks"]  # implicit GEMM's baseline
    assert r["strided"]["fp16"]["project_explicit"]["median_s"] > 0
    for precision in ("fp32", "fp16"):  # the profiled step of every network saw the GPU's work
        for net, n in r["steps"][precision]["launches"].items():
            assert "error" not in n, (precision, net, n)
            assert n["kernels"] > 0 and n["kernel_time_s"] > 0, (precision, net, n)
            assert sum(n["runtime_calls"].values()) > 0, (precision, net, n)


def test_every_gpu_has_a_uuid():
    """Ranks that share a GPU are told by its UUID (launch.device.ranks_per_gpu)."""
    from launch.device import gpu_uuid

    uuids = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    assert all(isinstance(u, str) and u for u in uuids) and len(set(uuids)) == len(uuids)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_trainer_on_gpu_resumes_to_the_uninterrupted_run(tmp_path, precision):
    """``train --device cuda`` in one process, end to end: 4 steps straight, and 2 steps then a
    resume to 4 from the checkpoint end at the same losses, weights and (fp16) loss scale, and
    the resumed run restores the CUDA generator's state (the model draws nothing from it, so this
    checks that the state is saved and set on a real device). A constant learning rate: a
    cosine's shape depends on --steps. spconv's CUDA backward adds with atomics, so the runs
    agree to rounding, not bitwise (the same test on the CPU is bitwise)."""
    from mpi4py import MPI

    from sparsepipe_hpc.data.synth import generate_scenes
    from sparsepipe_hpc.train.checkpoint import load_checkpoint
    from sparsepipe_hpc.train.config import parse_config
    from sparsepipe_hpc.train.loop import Trainer
    from sparsepipe_hpc.train.metrics import read_metrics

    data = generate_scenes(tmp_path / "data", train=8, val=2, seed=0, objects=(2, 4),
                           points=(1500, 2500))

    def trainer(out, steps, *extra):
        return Trainer(parse_config([
            "--data", str(data), "--out", str(tmp_path / out), "--width", "4", "--depth", "2",
            "--voxel-size", "0.2", "--batch-size", "2", "--no-progress", "--device", "cuda",
            "--precision", precision, "--steps", str(steps), "--lr", "0.01", "--schedule",
            "constant", *extra]), MPI.COMM_SELF, log=None)

    def losses(out):
        return torch.tensor([r["loss"] for r in read_metrics(tmp_path / out / "metrics.jsonl",
                                                             "train")])

    trainer("a", 4).run()
    t = trainer("b", 2)
    t.run()
    assert all(p.is_cuda and p.dtype == torch.float32 for p in t.model.parameters())
    saved = load_checkpoint(tmp_path / "b" / "last.pt")
    resumed = trainer("b", 4, "--resume", "auto")
    assert torch.equal(torch.cuda.get_rng_state(t.device), saved["rng"][0]["cuda"])
    resumed.run()
    assert len(losses("a")) == len(losses("b")) == 4
    torch.testing.assert_close(losses("b"), losses("a"), rtol=1e-3, atol=1e-4)
    a, b = load_checkpoint(tmp_path / "a" / "last.pt"), load_checkpoint(tmp_path / "b" / "last.pt")
    assert a["step"] == b["step"] == 4 and ("scaler" in a) == (precision == "fp16")
    if precision == "fp16":
        assert a["scaler"]["scale"] == b["scaler"]["scale"]
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-3, atol=1e-3, msg=k)
