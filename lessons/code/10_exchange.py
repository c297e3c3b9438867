"""mpirun -n 2 python lessons/code/10_exchange.py [--sendrecv] [--timeout S]

Lesson 10: "everyone sends first". Rank 0 and rank 1 swap 100 values: each calls Send, then
Recv. MPI buffers a message that small, so it passes, and would pass every test. Run it with
MPIPAR_SSEND=1 (every mpipar send waits for its receive, at any size) and it deadlocks at
once: the watchdog (--timeout S) names the Send. --sendrecv swaps with Sendrecv instead.
"""

import argparse

import numpy as np

from mpipar.mpi import comm as C

parser = argparse.ArgumentParser()
parser.add_argument("--sendrecv", action="store_true", help="the fix")
parser.add_argument("--timeout", type=float, default=0, help="watchdog limit, seconds")
args = parser.parse_args()
C.install_excepthook()
C.start_watchdog(args.timeout)
C.choose_wait()  # as the runner does: how a rank waits on this machine
world = C.world()
assert world.size == 2, "run with mpirun -n 2"
other = 1 - world.rank

mine, theirs = np.full(100, float(world.rank)), np.empty(100)
if args.sendrecv:
    world.Sendrecv(mine, other, theirs, other, what="the swap")
else:
    world.Send(mine, other, what="the swap")  # both ranks send first...
    world.Recv(theirs, other, what="the swap")  # ...and receive second
assert (theirs == other).all()
C.log(f"swapped {mine.nbytes} bytes: done ({'Sendrecv' if args.sendrecv else 'Send, Recv'}, "
      f"MPIPAR_SSEND={C.SSEND:d})")
