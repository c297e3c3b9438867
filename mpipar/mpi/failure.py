"""How a job ends when something goes wrong: at once, on every rank, and with one clear message.

An MPI job is P processes that wait for each other, so one rank in trouble leaves the others
waiting forever unless someone ends the job. Five ways a job goes wrong, and what ends it:

1. an uncaught exception on one rank: :func:`install_excepthook` prints the traceback with the
   rank and calls MPI_Abort, which makes the launcher kill every process of the job;
2. Ctrl-C (mpirun forwards SIGINT to every rank): world rank 0 prints one line and the job
   ends with exit code 130, without a traceback per rank (:func:`interrupted`);
3. a rank that is stopped or hung (SIGSTOP, an endless loop, a debugger): the others wait in an
   MPI call that never completes. :func:`start_watchdog` starts a thread that ends the job when
   this rank has waited longer than ``--timeout`` seconds inside ONE call, after printing what
   it waits for and its last calls (the flight recorder, :data:`FLIGHT`);
4. bad input (a flag, an environment variable): every rank sees the same input and refuses it
   with :func:`refuse`: exit code 2, the message printed once;
5. a rank ended by SIGTERM or SIGHUP (``kill PID``): it names itself and the signal in one
   line (:func:`terminated`), and the launcher ends the others. ``kill -9`` cannot be caught:
   the launcher's "BAD TERMINATION" message names the PID that died.

:mod:`mpipar.mpi.comm` keeps the flight recorder up to date on every call (about 0.2 us a call), and
re-exports ``install_excepthook``, ``start_watchdog`` and ``refuse``. This module does not import
comm, so comm can import it.

Run ``mpirun -n 4 python tests/mpi/hang.py 1 sleep 3``: rank 1 sleeps and never calls MPI; the
others wait in an Allreduce, and after 3 s their watchdogs print and abort the job.

Every wait of a job is watched, from its first collective to its last: each call of
mpipar.mpi.comm, and the bare mpi4py calls around them (the grid's Split, the shared-memory
split that counts a machine's ranks) through :func:`watched`; once the watchdog runs, the ranks
meet in a watched barrier before MPI_Finalize (:func:`_finalize`), where no watchdog could act.
The watchdog cannot tell a hung partner from a slow one, so ``--timeout``
must exceed the longest time a rank may legitimately wait for the others (an evaluation, a
save).
"""

import atexit
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager

from mpi4py import MPI

ABORT_GRACE = 1.0  # seconds between a failing rank's message and MPI_Abort
INTERRUPT_WAIT = 2.0  # seconds more the other ranks wait for rank 0 to end an interrupted job
HUNG = 124  # exit code of a job ended by the watchdog (coreutils' timeout uses it too)
RECENT = 16  # calls the flight recorder keeps
LOOK_S = 0.5  # seconds between two looks of the watchdog
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a rank ended by one of these says so


class Flight:
    """This rank's flight recorder: its last communication calls, and the one it waits in now.

    ``recent`` holds ``(MPI.Wtime(), comm name, op, detail, what)`` per completed or posted call;
    ``waiting`` is ``(since, comm name, op, detail, what)`` while the main thread is blocked in
    an MPI call (set and cleared by :func:`mpipar.mpi.comm.wait` and by the calls that go straight
    to MPI's blocking twin), else None. A blocking Send or Recv that goes straight to MPI reads
    no clock (a clock call costs a twentieth of an 8-byte message, on its critical path): its
    ``since`` and its time in ``recent`` are None, the watchdog times it from when it first
    sees it (at most one look, half a second, late), and its detail is the partner's rank,
    which :func:`_call` writes out. ``recent`` is a deque of fixed length: a ring kept in C,
    one append per call, so the recorder costs nothing to trim.
    """

    __slots__ = ("recent", "waiting", "timeout")  # set twice per blocking call: a slot is quicker

    def __init__(self):
        self.recent = deque(maxlen=RECENT)
        self.waiting = None
        self.timeout = None  # seconds, once start_watchdog has been called


FLIGHT = Flight()
_ending = threading.Lock()  # taken by whoever ends this process (exception, Ctrl-C, watchdog)
_started = set()  # the threads started so far ("interrupts", "watchdog")
_looking = threading.Lock()  # held by a look of the watchdog, and by MPI_Finalize


def _write(lines):
    """Write lines prefixed by the world rank with one unbuffered write (they stay together,
    and nothing waits in a Python buffer when the process ends)."""
    rank = "?" if MPI.Is_finalized() else MPI.COMM_WORLD.Get_rank()  # a signal after the end
    os.write(2, "".join(f"[rank {rank}] {line}\n" for line in lines).encode())


def refuse(message, code=2):
    """Exit with a clear message (printed once, by world rank 0) and a non-zero code.
    Every rank calls this on the same bad input, so no rank is left waiting."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(code)


def env_choice(name, allowed):
    """The value of an environment variable that must be one of ``allowed`` (unset or empty:
    None); anything else is refused on every rank, since every rank sees the same value."""
    value = os.environ.get(name) or None
    if value is not None and value not in allowed:
        refuse(f"{name}={value!r}: expected {' or '.join(allowed)}, or unset")
    return value


def abort(code):
    """MPI_Abort: the launcher kills every process of the job, which ends with ``code``.

    With MPICH's launcher, MPI_Abort returns (the kill comes a moment later): exit at once, so
    that nothing more of this rank runs (a traceback, MPI_Finalize) meanwhile."""
    if not MPI.Is_finalized():  # after MPI_Finalize (a signal at the very end) only exit
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


# ----------------------------------------------------------------------------- 1. exceptions
def install_excepthook():
    """On an uncaught exception, print it with the rank and abort every rank of the job.

    Without this, the other ranks wait forever for a message the dead rank will never send.
    SystemExit (argparse errors, clean refusals) is not an exception here: every rank raises it
    on the same bad input and exits with its code on its own. KeyboardInterrupt is Ctrl-C, not
    a failure: :func:`interrupted`.
    """

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            interrupted()
        with _ending:
            _write(["".join(traceback.format_exception(kind, value, tb))])
            # MPI_Abort makes the launcher kill every process, its own output forwarders too:
            # give them time to pass the traceback on, or it is lost (1 crash in 10 under load).
            time.sleep(ABORT_GRACE)
            abort(1)

    sys.excepthook = hook
    _watch_interrupts()


# ----------------------------------------------------------------------------- 2. Ctrl-C
def interrupted():
    """Ctrl-C: world rank 0 says so in one line and aborts the job with 130 (128 + SIGINT).

    mpirun forwards SIGINT to every rank. Each one ending itself would not do: the launcher
    kills the others as soon as one rank exits, and reports a killed rank as a "BAD
    TERMINATION" with a random exit code. MPI_Abort is the one end it reports cleanly, with our
    code. So the other ranks wait for rank 0's abort, and abort themselves only if it never
    comes (rank 0 stuck in a long C call)."""
    with _ending:  # the excepthook and the interrupt thread may both get here: one ends it
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        if MPI.COMM_WORLD.Get_rank() == 0:
            os.write(2, b"interrupted (Ctrl-C): stopping every rank\n")
            time.sleep(ABORT_GRACE)  # as in install_excepthook: let the launcher forward it
        else:  # rank 0's abort normally ends this rank during this sleep
            time.sleep(ABORT_GRACE + INTERRUPT_WAIT)
        abort(130)


def _watch_interrupts():
    """Python turns SIGINT into KeyboardInterrupt only between bytecodes of the main thread, so
    a rank blocked inside MPI's own Wait (the "spin" wait) never sees it. Python's C handler
    also writes the signal number to a wakeup pipe; this thread reads it and ends the rank
    itself when the main thread is blocked in MPI."""
    if "interrupts" in _started or threading.current_thread() is not threading.main_thread():
        return
    _started.add("interrupts")
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)

    for sig in ENDING_SIGNALS:
        signal.signal(sig, lambda signum, frame: terminated(signum))

    def watch():
        while True:
            got = os.read(read_fd, 64)
            if signal.SIGINT in got and FLIGHT.waiting is not None:
                interrupted()
            for sig in ENDING_SIGNALS:
                if sig in got:
                    terminated(sig)

    threading.Thread(target=watch, name="mpipar-interrupts", daemon=True).start()


# ----------------------------------------------------------------------------- 5. SIGTERM, SIGHUP
def terminated(signum):
    """SIGTERM or SIGHUP to one rank (``kill PID``, a closed terminal, a batch system's limit):
    it says in one line that it was ended and by which signal, then aborts the job with the
    code the signal would have given (128 + its number). Called by the
    signal's handler, or by the interrupt thread while the main thread is blocked inside MPI.
    SIGKILL (``kill -9``) cannot be caught: there only the launcher speaks, naming the PID."""
    with _ending:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        name = signal.Signals(signum).name
        _write([f"ended by {name} (signal {signum}): stopping the job"])
        time.sleep(ABORT_GRACE)  # as in install_excepthook: let the launcher forward the line
        abort(128 + signum)  # a rank that simply exits is reported as some other rank's kill


# ----------------------------------------------------------------------------- 3. hangs
@contextmanager
def watched(op, detail, what="", name="world"):
    """Run a bare blocking MPI call (one that mpipar.mpi.comm does not make) where the watchdog
    sees it, as it sees every call of comm: ``with watched("Split", "all ranks"): ...``."""
    FLIGHT.waiting = (MPI.Wtime(), name, op, detail, what)
    try:
        yield
    finally:
        FLIGHT.waiting = None
    FLIGHT.recent.append((MPI.Wtime(), name, op, detail, what))


def _finalize():
    """The end of the job (an atexit function): every rank meets in a watched barrier, then
    calls MPI_Finalize. MPI_Finalize waits for every rank too, but there no watchdog can act (MPI
    refuses every call once it has begun, MPI_Abort included), so a rank stopped before the end
    is caught in the barrier, by the same limit as any other wait."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        request = MPI.COMM_WORLD.Ibarrier()
        with watched("Barrier", "all ranks", "the end of the job, before MPI_Finalize"):
            while not request.Test():
                time.sleep(1e-3)
        with _looking:  # not while the watchdog reads MPI's clock: it stops at its next look
            MPI.Finalize()


def start_watchdog(seconds):
    """End the job when this rank waits longer than ``seconds`` inside one MPI call.

    A daemon thread wakes every ``LOOK_S`` seconds and looks at :data:`FLIGHT`; a look and
    MPI_Finalize never overlap (once MPI is finalized, even its clock may not be read, and the
    thread ends at its next look). ``seconds`` None or
    <= 0: no watchdog. mpi4py initialises MPI with MPI_THREAD_MULTIPLE, so the thread may call
    MPI_Abort while the main thread is inside MPI."""
    if seconds is None or seconds <= 0:
        return
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("the watchdog calls MPI_Abort from a thread: it needs "
                           "MPI_THREAD_MULTIPLE (mpi4py's default)")
    FLIGHT.timeout = seconds
    if "watchdog" in _started:
        return
    _started.add("watchdog")
    atexit.register(_finalize)

    def watch():
        seen, since = None, 0.0  # the call last seen, and since when it waits
        while True:
            time.sleep(min(LOOK_S, FLIGHT.timeout / 4))
            with _looking:
                if MPI.Is_finalized():  # the job has ended: no MPI call is allowed any more
                    return
                waiting = FLIGHT.waiting
                if waiting is not seen:  # another call (a new tuple each; seen keeps the last)
                    seen = waiting
                    since = MPI.Wtime() if waiting is None or waiting[0] is None else waiting[0]
                if waiting is not None and MPI.Wtime() - since > FLIGHT.timeout:
                    _hung(waiting, since, FLIGHT.timeout)

    threading.Thread(target=watch, name="mpipar-watchdog", daemon=True).start()


def _call(name, op, detail, what):
    if isinstance(detail, int):  # a blocking Send or Recv records its partner's rank alone
        detail = f"{'->' if op == 'Send' else '<-'} rank {detail}"
    return f"{op} on {name or '?'}: {detail}" + (f"  ({what})" if what else "")


def hung_lines(waiting, since, seconds, recent, now):
    """What the watchdog says: the call ``waiting`` (waited in since ``since``), and the
    ``recent`` calls, each with its time before ``now`` (none for a direct Send or Recv)."""
    lines = [f"watchdog: waited {now - since:.1f} s (limit {seconds:g} s) in {_call(*waiting[1:])}",
             "  no answer: another rank is stopped, hung, crashed or far behind; aborting the job",
             f"  its last {len(recent)} communication calls, oldest first (seconds before now):"]
    return lines + [f"  {'' if t is None else f'{t - now:9.3f} s':>11}  {_call(*c)}"
                    for t, *c in recent]


def _hung(waiting, since, seconds):
    """Say what this rank waits for and what it did last, then abort the job."""
    recent = list(FLIGHT.recent)  # one C call: atomic under the GIL
    with _ending:
        _write(hung_lines(waiting, since, seconds, recent, MPI.Wtime()))
        time.sleep(ABORT_GRACE)  # as in install_excepthook: let the launcher forward the lines
        abort(HUNG)
