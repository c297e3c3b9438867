"""mpirun -n 4 python tests/mpi/hang.py RANK HOW SECONDS: RANK hangs; the watchdog ends the job.

HOW is ``sleep`` (RANK sleeps forever and never enters MPI: an endless loop) or ``stop`` (RANK
stops itself with SIGSTOP, as a debugger or Ctrl-Z would). The other ranks wait for it in an
Allreduce (or, with ``sleep-pickled``, in a pickled bcast); after SECONDS their watchdogs print
what they waited for and their last calls, and abort the job. Every rank prints its pid first,
so that a test can check that no process of the job outlives it.

HOW ``term`` or ``hup``: rank 0 sends RANK SIGTERM or SIGHUP while RANK waits inside MPI for a
message that never comes: RANK must say so and end the job.

HOW ``slow``: RANK is late by 0.4 SECONDS before each of 8 Allreduces. The others wait longer
than SECONDS in all, but never that long in one call: the job must finish ("done").
"""

import os
import signal
import sys
import time

import numpy as np

from mpipar.mpi import comm as C

hung, how, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
C.install_excepthook()
C.start_watchdog(seconds)
w = C.world()
os.write(1, f"rank {w.rank} pid {os.getpid()}\n".encode())  # one write: lines never merge

# a few calls for the flight recorder to show
x = np.ones(8)
w.Bcast(x, root=0, what="the weights")
for step in range(3):
    w.Allreduce(x, what=f"gradients of step {step}")
ring = w.Irecv(np.empty(8), (w.rank - 1) % w.size, what="a ring message")
w.Isend(x, (w.rank + 1) % w.size, what="a ring message").wait()
ring.wait()
w.Barrier()

if how in ("term", "hup"):  # RANK is sent the signal by rank 0, while it waits inside MPI
    sig = signal.SIGTERM if how == "term" else signal.SIGHUP
    pids = w.allgather_obj(os.getpid(), what="the pids")
    if w.rank == hung:
        w.Recv(np.empty(8), (hung + 1) % w.size, what="a message that never comes")
    elif w.rank == 0:
        time.sleep(0.5)
        os.kill(pids[hung], sig)
    while True:
        time.sleep(1)
if how == "slow":
    for step in range(8):
        if w.rank == hung:
            time.sleep(0.4 * seconds)
        w.Allreduce(x, what=f"gradients of step {4 + step}")
    print(f"rank {w.rank} done", flush=True)
    sys.exit(0)
if w.rank == hung:
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:  # hung: never calls MPI again
        time.sleep(1)
elif how == "sleep-pickled":
    w.bcast_obj({"step": 4}, root=hung, what="the step number")
else:
    w.Allreduce(x, what="gradients of step 3")  # the others wait here for the hung rank
print("unreachable", flush=True)
