"""Dispatch ``python -m sparsepipe_hpc.bench NAME [options]`` to ``sparsepipe_hpc.bench.NAME.main``."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import sparsepipe_hpc.bench as bench


def _has_main(name: str) -> bool:
    """Whether module ``name`` of the package is a benchmark (defines ``main``), read from its
    source: importing every module would import torch and spconv just to print the usage."""
    return "\ndef main(" in (Path(bench.__path__[0]) / f"{name}.py").read_text()


def _summary(name: str) -> str:
    """The first line of benchmark ``name``'s module docstring (read, not imported)."""
    source = (Path(bench.__path__[0]) / f"{name.replace('-', '_')}.py").read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                   if not m.name.startswith("_") and _has_main(m.name))
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m sparsepipe_hpc.bench {{{','.join(names)}}} [options]\n\n"
              "Benchmarks print their figures and write JSON (--json FILE); NAME --help lists "
              "a benchmark's options.\n")
        for name in names:
            print(f"  {name:<10} {_summary(name)}")
        sys.exit(0)
    if argv and argv[0].replace("_", "-") in names:  # gpu-comm and gpu_comm both work
        argv = [argv[0].replace("-", "_"), *argv[1:]]
    if not argv or argv[0].replace("_", "-") not in names:
        why = f"no benchmark {argv[0]!r}" if argv else "name a benchmark"
        print(f"usage: python -m sparsepipe_hpc.bench {{{','.join(names)}}} [options]\n"
              f"python -m sparsepipe_hpc.bench: error: {why}", file=sys.stderr)
        sys.exit(2)  # argparse's status for a usage error
    from launch.env import prefer_shared_memory
    from launch.run import abort_on_exception

    prefer_shared_memory()  # before MPI starts: one node needs no network transports
    abort_on_exception()  # a failure on one rank ends the whole benchmark
    importlib.import_module(f"sparsepipe_hpc.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main()
