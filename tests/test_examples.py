"""The documented library example runs under mpirun, spatially parallel, and learns; an exception
on one of its ranks ends the job instead of hanging it, and the README's snippet says how."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from test_mpi import mpi_env, mpirun_command, run_bounded

ROOT = Path(__file__).resolve().parents[1]


def test_spatial_unet_example_under_mpirun():
    cmd = mpirun_command(2) + [sys.executable, str(ROOT / "examples" / "spatial_unet.py"),
                               "--grid", "2,1,1", "--steps", "8"]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 8
    assert min(losses[-3:]) < losses[0] * 0.9, losses


def test_exception_on_one_rank_of_the_example_ends_the_job(tmp_path):
    """Rank 1 fails while making its second room; rank 0 is then in the halo exchange's
    collectives. The example's own abort_on_exception ends the job (run without 'launch run')."""
    example = ROOT / "examples" / "spatial_unet.py"
    driver = tmp_path / "faulty.py"
    driver.write_text(textwrap.dedent(f"""\
        import runpy, sys
        from mpi4py import MPI
        import sparsepipe_hpc.data.synth as synth
        real, calls = synth.make_room, []

        def make_room(rng):
            calls.append(1)
            if MPI.COMM_WORLD.rank == 1 and len(calls) == 2:
                raise OSError("disk error while reading room 1 (injected)")
            return real(rng)

        synth.make_room = make_room
        sys.argv[0] = {str(example)!r}
        runpy.run_path({str(example)!r}, run_name="__main__")
        """))
    env = dict(mpi_env(), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    cmd = mpirun_command(2) + [sys.executable, str(driver), "--grid", "2,1,1", "--steps", "4"]
    proc = run_bounded(cmd, 120, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "[rank 1] OSError: disk error while reading room 1 (injected)" in proc.stderr
    assert "[rank 1] aborting all 2 ranks (MPI_Abort) after an uncaught OSError" in proc.stderr


def test_readme_library_snippet_aborts_on_exception():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using the library from your own code"):]
    start = section.index("```python")
    snippet = section[start:section.index("```", start + 3)]
    assert snippet.index("abort_on_exception()") < snippet.index("ParallelContext(")
    assert "launch run" in section[:section.index("## ", 5)]
