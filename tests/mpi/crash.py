"""One rank raises while the others wait in a collective: the whole job must end."""

import sys
import time

import numpy as np

from mpipar.mpi import comm as C

C.install_excepthook()
w = C.world()
if w.rank == int(sys.argv[1]):
    print(f"failing at {time.time():.3f}", flush=True)  # the test times the end from here
    raise RuntimeError(f"deliberate failure on rank {w.rank}")
w.Allreduce(np.ones(4))  # the others wait here for a rank that is gone
print("unreachable", flush=True)
