"""mpirun -n 4 python tests/mpi/interrupt.py WHERE, then Ctrl-C: one line, exit code 130.

Every rank prints "ready" and then runs until interrupted: WHERE is ``compute`` (every rank in
a Python loop, where SIGINT becomes KeyboardInterrupt at once) or ``mpi`` (rank 0 blocked in
an Allreduce that the others never join; with MPIPAR_WAIT=spin it is blocked inside MPI's own
Wait, where Python cannot raise KeyboardInterrupt, so comm's interrupt thread must end it).
"""

import os
import sys
import time

import numpy as np

from mpipar.mpi import comm as C

C.install_excepthook()
w = C.world()
w.Barrier()
os.write(1, f"rank {w.rank} ready\n".encode())
if sys.argv[1] == "mpi" and w.rank == 0:
    w.Allreduce(np.ones(4), what="never joined")
x = np.ones(100)
while True:  # a long computation
    x = np.sin(x)
    time.sleep(0.001)
