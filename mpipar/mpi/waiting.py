"""How a rank waits for an MPI request to complete: the strategies ``MPIPAR_WAIT`` names.

:func:`mpipar.mpi.comm.wait` completes every request through one of these (``comm.WAIT`` names
it). Each takes an mpi4py request and a status (or None) and returns once the request has
completed. MPICH moves messages only inside MPI calls, so every strategy keeps calling MPI
(``Test``); they differ in what a rank does between two calls:

- ``spin``: MPI's own ``Wait``, a busy loop in C. The lowest latency when every rank has its
  own core; with more ranks than cores it takes the core from the rank it waits for.
- ``yield``: ``Test``, then ``os.sched_yield()``, again and again: the core goes to another
  runnable process at once, but a rank that waits long still burns its share of the CPU.
- ``sleep``: ``Test``, then sleep 10 us doubling up to 200 us (the kernel's timer slack adds
  about 50 us to each): a waiting rank uses almost no CPU, and a rank that wakes from a sleep
  gets a core back sooner than one that yielded (the scheduler favours a waking task).
- ``backoff``: poll for ``SPIN_S`` (a message that is about to arrive costs no sleep), then
  poll and yield until ``YIELD_S`` (a short wait hands the core to the rank it waits for and
  gets it back at once), then as ``sleep`` (a long wait, a pipeline bubble or a late rank,
  leaves the CPU free).

Without ``MPIPAR_WAIT`` (:func:`default`), a job whose ranks on one machine outnumber its
cores uses ``DEFAULT_OVERSUBSCRIBED`` ("backoff"), or ``LONG_WAITS`` ("sleep") for a pipeline,
whose stages wait a micro-batch's compute, milliseconds, at a time; any other job ``spin``.

Measured by ``python -m mpipar.tools.bench wait`` (each scheme's trainer on 4 ranks on 2
cores, the strategies interleaved round by round; ``plots/wait.csv`` and the speed section of
``plots/REPORT.md`` hold its latest run). What the choices rest on: a sleeping-only wait
oversleeps the short waits of the small models, so backoff yields first, for up to ``YIELD_S``
(long enough that a wait of a slower spell does not fall into sleeping and wake late); on a
machine loaded with other work a sleeping rank leaves the core to the rank it waits for, which
a spinning or yielding one holds; a pipeline stage waits a micro-batch's compute at a time, and
yielding through that burns the core its neighbour computes on, so a pipeline sleeps.
"""

import os
import time

SPIN_S = 10e-6  # seconds of polling before backoff yields
YIELD_S = 3e-3  # seconds after which backoff stops yielding and sleeps
SLEEP_MIN_S, SLEEP_MAX_S = 10e-6, 200e-6  # backoff's and sleep's sleeps: first and longest


def spin(request, status):
    request.Wait(status)


def sched_yield(request, status):
    while not request.Test(status):
        os.sched_yield()


def sleep(request, status):
    delay = SLEEP_MIN_S
    while not request.Test(status):
        time.sleep(delay)
        delay = min(2 * delay, SLEEP_MAX_S)


def backoff(request, status):
    start = time.perf_counter()
    while time.perf_counter() - start < SPIN_S:
        if request.Test(status):
            return
    while time.perf_counter() - start < YIELD_S:  # hand the core to the rank we wait for
        if request.Test(status):
            return
        os.sched_yield()
    sleep(request, status)


STRATEGIES = {"spin": spin, "backoff": backoff, "yield": sched_yield, "sleep": sleep}
DEFAULT_OVERSUBSCRIBED, LONG_WAITS = "backoff", "sleep"


def default(oversubscribed, long_waits=False):
    """The strategy a job uses when ``MPIPAR_WAIT`` names none: ``oversubscribed`` when its
    ranks outnumber the cores of their machine, ``long_waits`` for a pipeline's stages."""
    if not oversubscribed:
        return "spin"
    return LONG_WAITS if long_waits else DEFAULT_OVERSUBSCRIBED
