"""The documented library example runs under mpirun, spatially parallel, and learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_mpi import mpi_env, mpirun_command

ROOT = Path(__file__).resolve().parents[1]


def test_spatial_unet_example_under_mpirun():
    cmd = mpirun_command(2) + [sys.executable, str(ROOT / "examples" / "spatial_unet.py"),
                               "--grid", "2,1,1", "--steps", "8"]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 8
    assert min(losses[-3:]) < losses[0] * 0.9, losses
