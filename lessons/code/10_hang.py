"""mpirun -n 4 python lessons/code/10_hang.py [--timeout S] [--stacks S]

Lesson 10: a training loop in which rank 2 stops answering at step 3, the way a bug would
(it waits for a condition that never comes true). The other ranks then wait in the step's
Allreduce forever. Two ways to find out who hangs, and where:

--timeout S: mpipar's watchdog. A rank that waits longer than S seconds inside one call
  prints that call and its last communication calls, then ends the job (exit code 124).
--stacks S: Python's faulthandler. S seconds after the first Bcast every rank prints the stack of
  each of its threads, whatever it is doing, and carries on: the hung rank shows the line it
  is stuck on. Rank r prints 0.5 r seconds later than rank 0, so that the dumps do not mix.

Every rank prints its pid; `kill -USR1 PID` prints that rank's stack at any time, without
stopping it (faulthandler.register).
"""

import argparse
import faulthandler
import os
import signal
import time

import numpy as np

from mpipar.mpi import comm as C

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=0, help="watchdog limit, seconds")
parser.add_argument("--stacks", type=float, default=0, help="dump every stack after S s")
args = parser.parse_args()

faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: print this rank's stack, carry on
C.install_excepthook()
C.start_watchdog(args.timeout)
C.choose_wait()  # as the runner does: how a rank waits on this machine
world = C.world()
os.write(1, f"rank {world.rank} pid {os.getpid()}\n".encode())  # one write: lines stay whole


def wait_for_data_loader():
    """The bug: on rank 2 at step 3 the condition never becomes true."""
    while world.rank == 2 and step == 3:
        time.sleep(0.1)


weights = np.ones(1000)
world.Bcast(weights, root=0, what="the weights")
if args.stacks > 0:  # from here on every rank has started: count the seconds from now
    faulthandler.dump_traceback_later(args.stacks + 0.5 * world.rank)
for step in range(5):
    wait_for_data_loader()
    grads = np.full(1000, float(world.rank))
    world.Allreduce(grads, what=f"gradients of step {step}")
    C.log(f"step {step} done")
