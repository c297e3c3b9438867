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

Measured by ``python -m mpipar.tools.bench wait`` (``plots/wait.csv`` and the report's speed
section hold its latest run; the figures here are from single runs of it): each scheme's
trainer on 4 ranks on 2 cores, the strategies interleaved round by round. On a
quiet machine, with a sleeping-only backoff (poll 10 us, then sleep), the small default models
took 3x longer a step than spinning or yielding (dp allreduce 4.9 ms against 1.4 and 1.9;
tensor_parallel 3.3 against 1.5 and 1.0): each short wait overslept. Yielding first for up to
1 ms brought backoff level with them (dp allreduce 1.9 ms, spin 2.0, yield 1.9; pipeline 43.8,
spin 58.0, yield 42.5), while a wait longer than 1 ms still sleeps. On a machine loaded with
other work (load average 16 to 20), sleeping beat spinning and yielding (dp master 17.2 ms
sleep, 28.8 spin, 24.4 yield): there the rank waited for needs the core the spinner holds.

Later, on the same kind of machine in a slower spell, a 1 ms yield was too short: backoff took
7.3 ms a step of dp allreduce (100 steps, median of 3 rounds) against 1.9 yielding, and 1.7 ms
of tensor_parallel against 1.4. A wait there outlasted 1 ms, slept, and the rank woke late,
which made the next wait longer. Yielding for up to 3 ms (``YIELD_S``): dp allreduce 1.8 ms,
tensor_parallel 1.3; the pipeline within its noise of every other setting (53 to 77 ms).
The pipeline sleeps instead: its waits are long, and yielding through them burns the core its
neighbour computes on. The main job (the GPT pipeline) on 4 ranks, 20 steps, two runs each:
sleep 52.6 and 55.6 ms a step with 92 and 96 ms of CPU time over the ranks; backoff 62.0 and
63.4 ms with 117 and 121 ms of CPU; yield 70.8 and 67.1 ms with 141 and 133. (On 2 ranks, a
core each, spin: 45 ms.) ``bench wait`` has preferred sleep for it in every run.
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
