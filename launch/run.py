"""Safe start: an uncaught exception on any rank ends the whole MPI job; SIGTERM can checkpoint.

Usage::

    mpirun -n 4 python -m launch run -m sparsepipe_hpc.train --grid 2,2,1   # a module
    mpirun -n 4 python -m launch run my_script.py arg1 arg2                  # a script
    mpirun -n 4 python -m launch run -c "import mymod; mymod.main()"         # a command

    # or, in an entry point of its own (the trainer does this):
    from launch.run import abort_on_exception, agree_to_stop, install_sigterm_handler
    abort_on_exception()
    install_sigterm_handler()          # a flag only: a handler must not communicate
    ...                                # at a step boundary, on every rank:
    if agree_to_stop(comm): trainer.save_checkpoint(); break   # collective, all ranks at once

Why: when one rank dies of an exception, the others wait forever in their next collective, and the
job burns its allocation until the wall-clock limit. The hook prints the traceback with the rank on
every line (``[rank 1] Traceback ...``), flushes, and calls ``MPI.COMM_WORLD.Abort(1)``, which ends
every rank. A rank that exits with ``sys.exit(code != 0)`` under ``python -m launch run`` ends the
job too (with ``code``), as in ``python -m mpi4py``, and says why: the message of
``sys.exit("...")`` or the exception being handled when ``sys.exit`` was called. With one rank, or
before MPI is initialized, the process exits with status 1 and the launcher (``mpirun``,
``srun --kill-on-bad-exit``) ends the rest.

A rank that *finishes* (returns, or exits with status 0) while another still runs is fine when the
other only finishes later, and a hang when the other waits for it in a collective. Under
``python -m launch run`` every finished rank therefore waits for all the others to finish too (a
non-blocking barrier on a communicator of its own, duplicated from ``COMM_WORLD`` when the target
imports mpi4py), and aborts the job, naming itself, when they have not within ``--exit-timeout``
seconds (default 300, or the ``LAUNCH_EXIT_TIMEOUT`` variable; ``0`` waits forever). So does a
rank that leaves through :func:`install_sigterm_handler`'s callback (status 143): a scheduler
signals every rank and the barrier completes at once, but a signal one rank got alone would
leave the others waiting for it.

SIGTERM: schedulers send it before killing a job (SLURM at the time limit, or earlier with
``#SBATCH --signal=TERM@120``; PBS at the wall-time limit, ``kill_delay`` seconds before SIGKILL).
:func:`install_sigterm_handler` runs a callback then exits with status 143 (``128 + SIGTERM``); or,
with no callback, it only raises a flag that the training loop polls (:func:`stop_requested`) and
agrees on across ranks (:func:`agree_to_stop`) at a step boundary. The callback runs inside a signal
handler, between two Python bytecodes of the main thread -- possibly mid-step, while another rank
is inside a collective -- so it must not communicate: let it write this rank's own state, or use
the flag and checkpoint collectively at the next step boundary.

SIGUSR1 is handled the same way, because it is the stop signal that survives ``mpirun``: Open MPI's
``mpirun`` forwards SIGUSR1 to every rank and carries on, while on its own SIGTERM it *kills* the
ranks -- Open MPI 5 sends them SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s after that (a
fixed delay in PRRTE's ``odls`` framework), Open MPI 4 the same with ``odls_base_sigkill_timeout``
seconds (default 1) in between -- too soon to reach a step boundary. So stop a run under ``mpirun``
with ``kill -USR1 <mpirun pid>`` (or ``timeout -s USR1 ...``), or send SIGTERM to the ranks
themselves (``srun`` and SLURM's ``--signal`` do).
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from launch.env import check_world, from_environ, prefer_shared_memory
from launch.errors import LaunchError

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

__all__ = ["abort_on_exception", "install_sigterm_handler", "stop_requested", "agree_to_stop",
           "Terminated", "STOP_SIGNALS", "EXIT_TIMEOUT_VARIABLE", "DEFAULT_EXIT_TIMEOUT_S", "main"]

#: The signals :func:`install_sigterm_handler` handles by default (see the module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: Environment variable: seconds a finished rank waits for the others (``--exit-timeout``).
EXIT_TIMEOUT_VARIABLE = "LAUNCH_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 300.0
_NOTICE_AFTER_S = 10.0  # a finished rank says what it is waiting for after this long

USAGE = """\
usage: python -m launch run [-h] [--exit-timeout SECONDS] <script.py> [arg ...]
       python -m launch run [-h] [--exit-timeout SECONDS] -m <module> [arg ...]
       python -m launch run [-h] [--exit-timeout SECONDS] -c <command> [arg ...]

Run a script, module or command so that an uncaught exception on any MPI rank prints its traceback
with the rank and aborts the whole job (MPI_Abort) instead of leaving the other ranks waiting.

  --exit-timeout SECONDS  how long a rank that finished waits for the others before it aborts the
                          job as hung (they may be waiting for it in a collective); default
                          $LAUNCH_EXIT_TIMEOUT or 300; 0 waits forever
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
        mpi = _live_mpi()
        abort = mpi is not None and size > 1
        try:  # the abort must happen even where stderr cannot be written (full, closed)
            _say(rank, "".join(traceback.format_exception(exc_type, exc, _trim(tb))))
            if abort:
                _say(rank, f"aborting all {size} ranks (MPI_Abort) after an uncaught "
                           f"{exc_type.__name__}")
        finally:
            if abort:
                (comm if comm is not None else mpi.COMM_WORLD).Abort(1)

    sys.excepthook = hook


def _exit_reason(exc: SystemExit) -> str:
    """Why ``sys.exit`` was called: its message, or the exception being handled at the time."""
    if isinstance(exc.code, str):
        return exc.code
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is None:
        return ""
    return f"{type(cause).__name__}: {cause}"


def _abort_on_exit_status(exc: SystemExit) -> bool:
    """On ``sys.exit(code)``, code != 0, in a live multi-rank world: say why and abort the job at
    exit (mpi4py's atexit calls ``MPI_Abort``). Returns whether it did."""
    code = exc.code
    if code is None or code == 0:
        return False
    status = code if isinstance(code, int) else 1
    mpi = _live_mpi()
    if mpi is None or mpi.COMM_WORLD.Get_size() == 1:
        return False
    rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    reason = _exit_reason(exc)
    why = f" ({reason})" if reason and "\n" not in reason else ""
    _say(rank, f"exited with status {status}{why}: aborting all {size} ranks")
    if reason and not why:
        _say(rank, reason)
    setter = getattr(mpi, "_set_abort_status", None)
    if setter is not None:
        setter(status)
    else:  # pragma: no cover - every mpi4py >= 3.1 has it
        mpi.COMM_WORLD.Abort(status)
    return True


# --------------------------------------------------------------------------------------------------
# A rank that finishes while others still run

_exit_comm: Any = None  # COMM_WORLD's duplicate, made when the target imports mpi4py.MPI


def _mpi_imported(module: Any) -> None:
    """Right after ``mpi4py.MPI`` initialized MPI: duplicate ``COMM_WORLD`` for the exit check.

    Collective, at the same point of every rank's program (its import of mpi4py.MPI), so the
    duplicate's own context keeps the exit barrier apart from anything the target communicates.
    """
    global _exit_comm
    try:
        live = module.Is_initialized() and not module.Is_finalized()
        size = module.COMM_WORLD.Get_size() if live else 0
        if size > 1:
            _exit_comm = module.COMM_WORLD.Dup()
    except Exception:  # noqa: BLE001 - no exit check rather than a failed import of MPI
        _exit_comm, size = None, 0
    if size == 1:
        try:
            check_world(1)
        except LaunchError as err:  # each process alone: it cannot abort the others, only leave
            _say(0, f"launch run: {err}")
            raise SystemExit(2) from None


class _ThenCall(importlib.abc.Loader):
    """A loader that runs ``inner`` and then ``after(module)``."""

    def __init__(self, inner: Any, after: Callable[[Any], None]) -> None:
        self.inner, self.after = inner, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.after(module)


class _WatchMPIImport(importlib.abc.MetaPathFinder):
    """Finds ``mpi4py.MPI`` with the other finders and wraps its loader (once)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "mpi4py.MPI":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, _mpi_imported)
        return spec


def _watch_mpi_import() -> None:
    """Arrange for :func:`_mpi_imported` to run when the target imports mpi4py.MPI; at once if
    it is imported already."""
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        _mpi_imported(module)
    else:
        sys.meta_path.insert(0, _WatchMPIImport())


def exit_timeout(text: str | None = None) -> float | None:
    """Seconds a finished rank waits for the others: ``text`` (``--exit-timeout``), else the
    ``LAUNCH_EXIT_TIMEOUT`` variable, else 300; ``None`` (wait forever) for 0."""
    name = "--exit-timeout"
    if text is None:
        text = os.environ.get(EXIT_TIMEOUT_VARIABLE, "").strip() or None
        name = EXIT_TIMEOUT_VARIABLE
    if text is None:
        return DEFAULT_EXIT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise LaunchError(f"{name} {text!r} is not a number of seconds >= 0 (0: wait forever)")
    return seconds or None


def _wait_for_all_at_exit(timeout: float | None, why: str = "it returned early") -> None:
    """This rank finished: wait until every rank has, or abort the job after ``timeout`` s.
    ``why``: how this rank may have left the others behind, for the abort's message."""
    global _exit_comm
    comm, _exit_comm = _exit_comm, None
    mpi = _live_mpi()
    if comm is None or mpi is None:
        return
    rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    request = comm.Ibarrier()
    start = time.monotonic()
    noticed = False
    while not request.Test():
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            _say(rank, f"finished {timeout:g} s ago, but not all {size} ranks have: the others "
                       f"are presumably waiting for rank {rank} in a collective or a receive it "
                       f"skipped ({why}); aborting all {size} ranks. A rank that "
                       "legitimately works on alone needs a longer --exit-timeout (or "
                       f"{EXIT_TIMEOUT_VARIABLE})")
            mpi.COMM_WORLD.Abort(1)
        if not noticed and waited > _NOTICE_AFTER_S:
            noticed = True
            limit = "for ever" if timeout is None else f"up to {timeout:g} s in all"
            _say(rank, f"finished; waiting for the other ranks to finish too ({limit}; they may "
                       f"be waiting for rank {rank} in a collective it skipped)")
        time.sleep(0.005)
    comm.Free()


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
                            signals: Iterable[int] = STOP_SIGNALS) -> None:
    """On SIGTERM or SIGUSR1: raise the stop flag, run ``callback`` (e.g. write a last checkpoint),
    then exit.

    ``exit_after``: raise :class:`Terminated` (status ``128 + signal``, 143 for SIGTERM) after the
    callback; default True when a callback is given, False when not (the loop polls
    :func:`stop_requested`). ``signals``: default :data:`STOP_SIGNALS` (SIGUSR1 is the one
    ``mpirun`` forwards without killing the ranks; see the module docstring). A second signal while
    the first is handled is ignored, so a repeated SIGTERM cannot cut a checkpoint in half. Must be
    called from the main thread.
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


def _module_exists(name: str) -> bool:
    """Whether ``name`` can be found; a parent package that fails to import for another reason
    raises, so that its own error is seen."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as e:  # a parent package missing: "pkg" of "pkg.mod"
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return False
        raise


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m launch run [--exit-timeout S] [-m module | -c command | script.py] args...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    option: str | None = None
    if args and args[0].startswith("--exit-timeout"):
        name, _, value = args.pop(0).partition("=")
        if name != "--exit-timeout" or (not value and not args):
            print(f"launch run: {name} needs a number of seconds\n{USAGE}", file=sys.stderr,
                  end="")
            raise SystemExit(2)
        option = value or args.pop(0)
    try:
        timeout = exit_timeout(option)
    except LaunchError as err:
        print(f"launch run: {err}", file=sys.stderr)
        raise SystemExit(2) from None
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
    try:
        prefer_shared_memory()  # before the target initializes MPI
    except LaunchError as err:
        print(f"launch run: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    abort_on_exception()
    _watch_mpi_import()
    if args[0] == "-m" and not _module_exists(args[1]):  # may import its parent packages
        print(f"launch run: no module named {args[1]!r} (python {sys.executable}; is the "
              "environment that has it active?)", file=sys.stderr)
        raise SystemExit(2)
    try:
        _run_target(args)
    except Terminated:
        # A scheduler signals every rank, and each finishes its callback before any leaves (an
        # abort would cut another rank's checkpoint short); a signal one rank got alone would
        # leave the others waiting for it, so they are waited for, then aborted.
        _wait_for_all_at_exit(timeout, "it stopped on a signal they may not have had")
        raise
    except SystemExit as exc:
        if _abort_on_exit_status(exc):
            raise SystemExit(exc.code if isinstance(exc.code, int) else 1) from None  # said it
        if not exc.code:
            _wait_for_all_at_exit(timeout)
        raise
    _wait_for_all_at_exit(timeout)
