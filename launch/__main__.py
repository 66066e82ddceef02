"""``python -m launch {info,run,job}``: the package's command line.

Usage::

    python -m launch info [--json]
    python -m launch run [-m module | -c command | script.py] args...
    python -m launch job --scheduler slurm --nodes 2 --gpus-per-node 4 -- --epochs 10
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]

USAGE = """\
usage: python -m launch {info,run,job} ...

  info   print one line per rank: rank, local rank, node, launcher, GPU, threads, CPUs
  run    run a script or module so that an exception on any rank aborts the whole MPI job
  job    print a SLURM, PBS or local job script filled from options or a plan

'python -m launch <command> -h' explains each command.
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "run":
        from launch import run

        run.main(rest)
    elif command == "info":
        from launch import info

        info.main(rest)
    elif command == "job":
        from launch import jobs

        jobs.main(rest)
    elif command in ("-h", "--help"):
        print(USAGE, end="")
    else:
        detail = f"unknown command {command!r}\n" if command else ""
        print(f"launch: {detail}{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2)


if __name__ == "__main__":
    main()
