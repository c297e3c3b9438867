"""How a rank waits for an MPI request to complete: the strategies ``MPIPAR_WAIT`` names.

:func:`mpipar.comm.wait` completes every request through one of these (``comm.WAIT`` names
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
  as ``sleep``.

Without ``MPIPAR_WAIT``, a job whose ranks on one machine outnumber its cores uses
``DEFAULT_OVERSUBSCRIBED`` ("backoff"), any other job ``spin``.

Measured: median step time in ms (range over 4 rounds) of each scheme with its default flags
on 4 ranks on 2 cores, the strategies interleaved round by round in one job, on a machine
also running other work (load average about 4). "yield, sleep" polls 20 us, yields until
200 us, then sleeps 50 us doubling to 200 us:

    scheme            spin          yield         sleep         backoff       yield, sleep
    dp --sync master   9.0 ( 5-13)   9.5 ( 5-11)   7.8 ( 6-9)    8.3 ( 8-15)   8.8 ( 8-11)
    dp allreduce       7.5 ( 6-10)   7.8 ( 7-10)   7.4 ( 6-10)   8.1 ( 5-12)   8.1 ( 7-10)
    dp ring           16.3 (12-18)  11.1 (10-16)   7.3 ( 5-10)   5.0 ( 5-9)    8.8 ( 8-12)
    tensor_parallel    6.6 ( 5-8)    5.6 ( 4-8)    4.9 ( 4-6)    5.7 ( 5-7)    5.1 ( 4-6)
    pipeline          86.7 (69-127) 75.7 (69-112) 70.3 (65-80)  70.8 (63-75)  70.5 (59-74)
    hybrid            41.7 (41-54)  42.8 (41-56)  38.5 (34-40)  36.6 (36-37)  38.5 (34-41)

Spinning and yielding keep a core busy that the rank being waited for needs. The sleeping
strategies win or tie everywhere, and about equal each other; backoff is ahead where waits are
short and many (the ring's Sendrecvs). With more other work on the machine (load average 16
to 20) the gap grows: dp master 28.8 ms spin, 24.4 yield, 17.2 sleep, 18.4 backoff; dp ring
45.2, 48.4, 23.5, 19.7. MPI's own Wait with MPICH's progress throttle
(``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1``, a usleep(1) after 100 idle polls, set for the whole
job at launch) was no better than plain spinning (72 ms against 68 for dp master, loaded).

Data parallelism (``--sync allreduce``) on 4 ranks on 2 cores against the same global batch on
2 ranks, in one job (ranks 0 and 1 alone, then all four, round by round): with the default
MLP and batch 64, 2 ranks take 2.4 ms a step and 4 ranks 3.6x that with spin (2.5-5.6), 4.1x
yield, 3.1x sleep (1.9-3.5), 3.0x backoff (1.9-4.2): at this size each replica's fixed work
(optimizer, Python) dominates, and 4 replicas on 2 cores do twice as much of it. With the dp
benchmark's MLP (2.2 M parameters, batch 1024) the compute dominates: 4 ranks 0.98x the
2-rank step with spin (0.84-1.09), 0.83x with sleep and with backoff (0.81-0.85).
"""

import os
import time

SPIN_S = 10e-6  # seconds of polling before backoff's first sleep
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
    sleep(request, status)


STRATEGIES = {"spin": spin, "backoff": backoff, "yield": sched_yield, "sleep": sleep}
DEFAULT_OVERSUBSCRIBED = "backoff"
