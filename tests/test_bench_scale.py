"""The input scaling benchmark runs end to end at a tiny size, and both input paths it compares
give every rank the same voxels (figures are not checked: they measure the machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sparsepipe_hpc.bench.scale import write_floor
from sparsepipe_hpc.data.scenes import SceneDataset


def test_write_floor_is_one_scene_of_the_layout(tmp_path):
    ds = SceneDataset(write_floor(tmp_path / "f.h5", 40001, rooms_x=2, rooms_y=1))
    assert len(ds) == 1 and int(ds.sizes[0]) == 40001 and ds.in_channels == 3
    lo, hi = ds.bounds()
    assert hi[0] - lo[0] > 8.0  # two rooms side by side along x


@pytest.mark.parametrize("chunk_size", ["0", "0.5"])
def test_scale_benchmark_runs_at_one_and_two_ranks(tmp_path, chunk_size):
    out = tmp_path / "scale.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,sm",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    proc = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "scale", "--points",
                           "20000", "--ranks", "1", "2", "--repeats", "1", "--voxel-size", "0.05",
                           "--chunk-size", chunk_size, "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    for n in ("1", "2"):
        whole = [r["voxels"] for r in runs["whole"][n]["per_rank"]]
        dist = [r["voxels"] for r in runs["distributed"][n]["per_rank"]]
        read = [r["points_read"] for r in runs["distributed"][n]["per_rank"]]
        assert len(whole) == int(n) and sum(whole) == sum(dist)
        if chunk_size == "0":  # the same cuts: the same boxes hold the same voxels
            assert whole == dist and sum(read) == 20000
        else:  # cuts from the chunk tables; each rank reads its chunks, not the whole floor
            assert sum(read) >= 20000 and (n == "1" or max(read) < 20000)
    assert sum(runs["whole"]["2"]["per_rank"][i]["voxels"] for i in range(2)) == \
        runs["whole"]["1"]["per_rank"][0]["voxels"]
    assert np.isfinite(result["summary"]["distributed"]["peak_ratio_2_over_1"])
