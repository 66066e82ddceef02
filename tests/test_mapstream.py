"""Strided maps built on a side stream: the same maps, built without draining the compute stream,
and never before their coordinates are written (the CUDA tests skip where torch sees no GPU)."""

from __future__ import annotations

import pytest
import torch

from halo.kmap import strided_map
from helpers import cuda_unet_step, random_cloud
from sparsepipe_hpc import mapstream
from sparsepipe_hpc.nn import SparseUNet

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GEOMETRIES = [((2, 2, 0, 1), (8, 8, 8)), ((3, 2, 1, 1), (8, 8, 8)), ((2, 2, 1, 1), (9, 9, 9))]


def _same(got: tuple, ref: tuple) -> None:
    (out, km), (ref_out, ref_km) = got, ref
    assert torch.equal(out.cpu(), ref_out.cpu())
    assert torch.equal(km.in_rows.cpu(), ref_km.in_rows.cpu())
    assert torch.equal(km.out_rows.cpu(), ref_km.out_rows.cpu())
    assert torch.equal(km.ptr, ref_km.ptr) and (km.n_in, km.n_out) == (ref_km.n_in, ref_km.n_out)
    offsets = km.pair_offsets()
    assert offsets.dtype == torch.int64 and offsets.device == km.in_rows.device
    assert torch.equal(offsets.cpu(), ref_km.pair_offsets())


@pytest.mark.parametrize("geometry,out_shape", GEOMETRIES)
def test_aside_on_a_cpu_is_the_plain_map(gen, geometry, out_shape):
    x = random_cloud(gen, 1500)
    with mapstream.aside():
        _same(mapstream.strided_map(x.coords, *geometry, out_shape, 2),
              strided_map(x.coords, *geometry, out_shape, 2))


def test_a_layer_notes_each_input_once_before_its_first_map(gen, monkeypatch):
    """The U-Net's first layer records when its input's coordinates are ready, once per forward
    pass (a fresh ``kmaps``), before any strided map: the side stream's start."""
    events: list[str] = []
    monkeypatch.setattr(mapstream, "note", lambda c: events.append(f"note {len(c)}"))
    plain = mapstream.strided_map
    monkeypatch.setattr(mapstream, "strided_map",
                        lambda c, *a: events.append("map") or plain(c, *a))
    x = random_cloud(gen, 1000, channels=3)
    net = SparseUNet(3, 4, width=4, depth=3).double()
    for _ in range(2):
        net(x.replace(kmaps={}))
    assert events == ([f"note {len(x.coords)}"] + ["map"] * 3) * 2  # depth 3: three k2s2 maps


@cuda
@pytest.mark.parametrize("geometry,out_shape", GEOMETRIES)
def test_aside_on_cuda_is_the_plain_map(gen, geometry, out_shape):
    x = random_cloud(gen, 1500)
    c = x.coords.cuda()
    with mapstream.aside():
        mapstream.note(c)
        got = mapstream.strided_map(c, *geometry, out_shape, 2)
    _same(got, strided_map(x.coords, *geometry, out_shape, 2))


def _busy() -> None:
    """Queue one kernel spinning for 10**9 GPU cycles (half a second at 2 GHz) on the current
    stream."""
    torch.cuda._sleep(10**9)


@cuda
@pytest.mark.parametrize("geometry,out_shape", GEOMETRIES)
def test_the_map_does_not_wait_for_the_compute_stream(gen, geometry, out_shape):
    """With half a second of work queued on the compute stream after the coordinates were noted,
    the map is built (its host reads included) while that work still runs. (A first build
    beforehand loads the kernels: CUDA's lazy loading may wait for the device.)"""
    x = random_cloud(gen, 4000, shape=(32, 32, 32))
    c = x.coords.cuda()
    ref = strided_map(x.coords, *geometry, out_shape, 2)
    with mapstream.aside():
        mapstream.strided_map(c.clone(), *geometry, out_shape, 2)
        torch.cuda.synchronize()
        mapstream.note(c)
        _busy()
        queued = torch.cuda.current_stream().record_event()
        got = mapstream.strided_map(c, *geometry, out_shape, 2)
        assert not queued.query(), "the map waited for the compute stream's queued work"
    torch.cuda.synchronize()
    _same(got, ref)


@cuda
def test_the_compute_stream_waits_for_the_map(gen, monkeypatch):
    """Where the side stream writes the map's rows half a second late, the compute stream's
    first read of them, queued at once, still sees them written."""
    from halo import kmap

    x = random_cloud(gen, 4000, shape=(32, 32, 32))
    ref = strided_map(x.coords, 2, 2, 0, 1, (16, 16, 16), 2)
    real = kmap.strided_map

    def late(*args):
        out, km = real(*args)
        _busy()  # on the side stream: the copies below land after it
        km.in_rows = km.in_rows.clone()
        return out.clone(), km

    monkeypatch.setattr(mapstream.kmap, "strided_map", late)
    c = x.coords.cuda()
    with mapstream.aside():
        mapstream.note(c)
        out, km = mapstream.strided_map(c, 2, 2, 0, 1, (16, 16, 16), 2)
        seen = km.in_rows.clone(), out.clone()  # on the compute stream, right away
    assert torch.equal(seen[0].cpu(), ref[1].in_rows) and torch.equal(seen[1].cpu(), ref[0])


@cuda
@pytest.mark.parametrize("part", ["in_rows", "pair_offsets"])
def test_a_map_freed_while_the_compute_stream_reads_it_is_not_reused_early(gen, part):
    """The compute stream's read of a map, queued behind half a second of work, sees its rows
    (and each pair's offset, which the map keeps from its sort for the implicit-GEMM tables)
    even where the map is dropped at once and more maps are built aside (the allocator would
    hand the first map's memory to those without ``record_stream``)."""
    def read(km):
        return km.in_rows + 0 if part == "in_rows" else km.pair_offsets()

    a, b = random_cloud(gen, 4000, shape=(32, 32, 32)), random_cloud(gen, 4000, shape=(32, 32, 32))
    ref = read(strided_map(a.coords, 2, 2, 0, 1, (16, 16, 16), 2)[1])
    with mapstream.aside():
        ca, cb = a.coords.cuda(), b.coords.cuda()
        mapstream.note(ca)
        mapstream.note(cb)
        _, km = mapstream.strided_map(ca, 2, 2, 0, 1, (16, 16, 16), 2)
        _busy()
        seen = read(km)  # runs after the busy kernel
        del km
        for _ in range(4):
            mapstream.strided_map(cb, 2, 2, 0, 1, (16, 16, 16), 2)
    assert torch.equal(seen.cpu(), ref)


@cuda
def test_coordinates_written_in_place_after_their_note_are_read_after_the_write(gen):
    """A strided layer meeting coordinates first does not refuse ones written in place since a
    layer noted them: the side stream then waits for the write (queued behind half a second of
    work), not for the note's event."""
    x = random_cloud(gen, 4000, shape=(32, 32, 32))
    ref = strided_map(x.coords, 2, 2, 0, 1, (16, 16, 16), 2)
    c = torch.zeros_like(x.coords).cuda()
    torch.cuda.synchronize()
    with mapstream.aside():
        mapstream.note(c)
        _busy()
        c.copy_(x.coords.cuda())  # in place, after the note
        got = mapstream.strided_map(c, 2, 2, 0, 1, (16, 16, 16), 2)
    _same(got, ref)


@cuda
def test_a_note_made_with_aside_off_drops_the_old_record():
    """A tensor noted aside, then met again with aside off, keeps no record: a later map built
    aside waits for everything queued instead of trusting a record older than an update."""
    c = torch.zeros(4, 4, dtype=torch.int32, device="cuda")
    with mapstream.aside():
        mapstream.note(c)
    assert c in mapstream._ready
    with mapstream.aside(False):
        mapstream.note(c)
    assert c not in mapstream._ready


@cuda
@pytest.mark.parametrize("noted", [True, False])
def test_the_map_waits_for_coordinates_written_after_queued_work(gen, noted):
    """Coordinates written by the compute stream behind half a second of work: noted after the
    write, or not noted at all (then the side stream waits for everything queued), the map reads
    the written values, not the buffer's earlier contents."""
    x = random_cloud(gen, 4000, shape=(32, 32, 32))
    src = x.coords.cuda()
    ref = strided_map(x.coords, 2, 2, 0, 1, (16, 16, 16), 2)
    c = torch.zeros_like(src)  # a wrong map if read before the copy below
    torch.cuda.synchronize()
    with mapstream.aside():
        _busy()
        c.copy_(src)
        if noted:
            mapstream.note(c)
        got = mapstream.strided_map(c, 2, 2, 0, 1, (16, 16, 16), 2)
    _same(got, ref)


@cuda
def test_unet_step_aside_equals_the_step_with_maps_inline_on_gpu(gen):
    """A U-Net step (its strided layers and inverses through implicit GEMM) gives the same
    outputs and gradients with its maps built aside (the default) as on the compute stream."""
    step = cuda_unet_step(gen)
    with mapstream.aside(False):
        ref = step()
    mapstream._streams.clear()
    with mapstream.aside():
        got = step()
    assert mapstream._streams, "no map was built aside"
    for a, r in zip(got, ref):  # the same kernels on the same operands, but spconv's backward
        # adds with atomics, in any order: relative to the norm (another map is far off)
        assert float((a - r).norm()) <= 1e-5 * float(r.norm())
