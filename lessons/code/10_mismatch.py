"""mpirun -n 4 python lessons/code/10_mismatch.py --timeout 3

Lesson 10: mismatched collectives. Every rank must call the same collectives on a
communicator in the same order. Here rank 0 calls Allreduce and then Bcast; the other ranks
call Bcast and then Allreduce. MPI cannot tell: each rank waits in a different call for the
others, forever. The watchdog (--timeout S) ends the job and shows each rank's call.
"""

import argparse

import numpy as np

from mpipar.mpi import comm as C

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=0, help="watchdog limit, seconds")
args = parser.parse_args()
C.install_excepthook()
C.start_watchdog(args.timeout)
C.choose_wait()  # as the runner does: how a rank waits on this machine
world = C.world()

weights, grads, lr = np.ones(1000), np.ones(1000), np.zeros(1)
world.Bcast(weights, root=0, what="the weights")  # every rank agrees on this one
if world.rank == 0:
    world.Allreduce(grads, what="the gradients")
    world.Bcast(lr, root=0, what="the learning rate")
else:
    world.Bcast(lr, root=0, what="the learning rate")
    world.Allreduce(grads, what="the gradients")
C.log("both collectives done")
