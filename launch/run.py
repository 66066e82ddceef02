"""Safe start: an uncaught exception on any rank ends the whole MPI job; SIGTERM can checkpoint.

Usage::

    mpirun -n 4 python -m launch run -m sparsepipe_hpc.train --grid 2,2,1   # a module
    mpirun -n 4 python -m launch run my_script.py arg1 arg2                  # a script
    mpirun -n 4 python -m launch run -c "import mymod; mymod.main()"         # a command

    # or, in an entry point of its own (the trainer does this):
    from launch.run import abort_on_exception, install_sigterm_handler
    abort_on_exception()
    install_sigterm_handler(lambda: trainer.save_checkpoint("last.h5"))

Why: when one rank dies of an exception, the others wait forever in their next collective, and the
job burns its allocation until the wall-clock limit. The hook prints the traceback with the rank on
every line (``[rank 1] Traceback ...``), flushes, and calls ``MPI.COMM_WORLD.Abort(1)``, which ends
every rank. A rank that exits with ``sys.exit(code != 0)`` under ``python -m launch run`` ends the
job too (with ``code``), as in ``python -m mpi4py``. With one rank, or before MPI is initialized,
the process exits with status 1 and the launcher (``mpirun``, ``srun --kill-on-bad-exit``) ends the
rest.

SIGTERM: schedulers send it before killing a job (SLURM at the time limit, or earlier with
``#SBATCH --signal=TERM@120``; PBS at the wall-time limit, ``kill_delay`` seconds before SIGKILL).
:func:`install_sigterm_handler` runs a callback then exits with status 143 (``128 + SIGTERM``); or,
with no callback, it only raises a flag that the training loop polls (:func:`stop_requested`) and
agrees on across ranks (:func:`agree_to_stop`) at a step boundary. The callback runs inside a signal
handler, between two Python bytecodes of the main thread -- possibly mid-step, while another rank
is inside a collective -- so it must not communicate: let it write this rank's own state, or use
the flag and checkpoint collectively at the next step boundary.
"""

from __future__ import annotations

import builtins
import os
import runpy
import signal
import sys
import threading
import traceback
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from launch.env import from_environ, prefer_shared_memory
from launch.errors import LaunchError

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

__all__ = ["abort_on_exception", "install_sigterm_handler", "stop_requested", "agree_to_stop",
           "Terminated", "main"]

USAGE = """\
usage: python -m launch run [-h] <script.py> [arg ...]
       python -m launch run [-h] -m <module> [arg ...]
       python -m launch run [-h] -c <command> [arg ...]

Run a script, module or command so that an uncaught exception on any MPI rank prints its traceback
with the rank and aborts the whole job (MPI_Abort) instead of leaving the other ranks waiting.
"""


class Terminated(SystemExit):
    """Raised by the SIGTERM handler after its callback: an exit the scheduler asked for."""


# --------------------------------------------------------------------------------------------------
# Where am I (without initializing MPI)


def _live_mpi() -> Any:
    """The ``mpi4py.MPI`` module when it is imported and MPI is initialized and not finalized."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi


def _rank_and_size(comm: Any = None) -> tuple[int, int]:
    if comm is not None:
        return comm.Get_rank(), comm.Get_size()
    mpi = _live_mpi()
    if mpi is not None:
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    try:
        placement = from_environ()
    except LaunchError:
        placement = None
    return (placement.rank, placement.size) if placement is not None else (0, 1)


def _say(rank: int, text: str) -> None:
    """Write ``text`` to stderr with ``[rank R] `` before every line, and flush both streams."""
    prefix = f"[rank {rank}] "
    lines = text.splitlines(keepends=True)
    try:
        sys.stdout.flush()
    except Exception:  # a closed stdout must not stop the abort
        pass
    sys.stderr.write("".join(prefix + line for line in lines))
    if lines and not lines[-1].endswith("\n"):
        sys.stderr.write("\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------------
# Abort on an uncaught exception

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNNER_FILES = ("<frozen runpy>", runpy.__file__, os.path.join(_HERE, "run.py"),
                 os.path.join(_HERE, "__main__.py"))


def _trim(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of runpy and of this runner: the traceback starts at the target."""
    first = tb
    while tb is not None and tb.tb_frame.f_code.co_filename in _RUNNER_FILES:
        tb = tb.tb_next
    return tb if tb is not None else first


def abort_on_exception(comm: MPI.Comm | None = None) -> None:
    """Install a ``sys.excepthook`` that prints ``[rank R] Traceback ...`` and aborts the MPI job.

    ``comm``: whose rank labels the traceback and whose ``Abort`` is called (default
    ``MPI.COMM_WORLD``). The abort happens only when MPI is initialized and the world has more than
    one rank; otherwise the hook prints and returns, and Python exits with status 1.
    Exceptions in threads other than the main one are left to ``threading.excepthook``.
    """

    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        rank, size = _rank_and_size(comm)
        _say(rank, "".join(traceback.format_exception(exc_type, exc, _trim(tb))))
        mpi = _live_mpi()
        if mpi is not None and size > 1:
            _say(rank, f"aborting all {size} ranks (MPI_Abort) after an uncaught "
                       f"{exc_type.__name__}")
            (comm if comm is not None else mpi.COMM_WORLD).Abort(1)

    sys.excepthook = hook


def _abort_on_exit_status(code: object) -> None:
    """On ``sys.exit(code)``, code != 0, in a live multi-rank world: abort the job at exit."""
    if code is None or code == 0:
        return
    status = code if isinstance(code, int) else 1
    mpi = _live_mpi()
    if mpi is None or mpi.COMM_WORLD.Get_size() == 1:
        return
    rank = mpi.COMM_WORLD.Get_rank()
    _say(rank, f"exited with status {code!r}: aborting all {mpi.COMM_WORLD.Get_size()} ranks")
    setter = getattr(mpi, "_set_abort_status", None)  # mpi4py's atexit then calls MPI_Abort
    if setter is not None:
        setter(status)
    else:  # pragma: no cover - every mpi4py >= 3.1 has it
        mpi.COMM_WORLD.Abort(status)


# --------------------------------------------------------------------------------------------------
# SIGTERM


_stop_signal: int | None = None


def stop_requested() -> bool:
    """Whether a signal handled by :func:`install_sigterm_handler` has arrived on this rank."""
    return _stop_signal is not None


def agree_to_stop(comm: MPI.Comm) -> bool:
    """True on every rank when any rank of ``comm`` has :func:`stop_requested`. **Collective.**"""
    from mpi4py import MPI

    return bool(comm.allreduce(int(stop_requested()), op=MPI.MAX))


def install_sigterm_handler(callback: Callable[[], object] | None = None, *,
                            exit_after: bool | None = None,
                            signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """On SIGTERM: raise the stop flag, run ``callback`` (e.g. write a last checkpoint), then exit.

    ``exit_after``: raise :class:`Terminated` (status ``128 + signal``, 143 for SIGTERM) after the
    callback; default True when a callback is given, False when not (the loop polls
    :func:`stop_requested`). A second signal while the first is handled is ignored, so a repeated
    SIGTERM cannot cut a checkpoint in half. Must be called from the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        raise LaunchError("install_sigterm_handler must be called from the main thread "
                          f"(called from {threading.current_thread().name!r})")
    leave = callback is not None if exit_after is None else exit_after

    def handler(signum: int, frame: object) -> None:
        global _stop_signal
        if _stop_signal is not None:
            return
        _stop_signal = signum
        rank, _ = _rank_and_size()
        name = signal.Signals(signum).name
        action = "running the last-checkpoint callback" if callback is not None else "stop flag set"
        _say(rank, f"{name} received: {action}")
        if callback is not None:
            callback()
        if leave:
            _say(rank, f"exiting with status {128 + signum} after {name}")
            raise Terminated(128 + signum)

    for signum in signals:
        signal.signal(signum, handler)


# --------------------------------------------------------------------------------------------------
# python -m launch run


def _run_target(args: list[str]) -> None:
    if args[0] == "-m":
        sys.argv[:] = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv[:] = ["-c", *args[2:]]
        code = compile(args[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})  # noqa: S102
    else:
        path = args[0]
        sys.argv[:] = args
        if not sys.flags.isolated:
            sys.path[0] = os.path.dirname(os.path.realpath(path))
        runpy.run_path(path, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m launch run [-m module | -c command | script.py] args...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr, end="")
        raise SystemExit(0 if args else 2)
    if args[0].startswith("-") and args[0] not in ("-m", "-c"):
        print(f"launch run: unknown option {args[0]!r}\n{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2)
    if args[0] in ("-m", "-c") and len(args) < 2:
        print(f"launch run: {args[0]} needs an argument\n{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2)
    if not args[0].startswith("-") and not os.path.isfile(args[0]):
        print(f"launch run: script {args[0]!r} does not exist or is not a file", file=sys.stderr)
        raise SystemExit(2)
    prefer_shared_memory()  # before the target initializes MPI
    abort_on_exception()
    try:
        _run_target(args)
    except Terminated:
        raise  # every rank got the signal: finalize normally
    except SystemExit as exc:
        _abort_on_exit_status(exc.code)
        raise
