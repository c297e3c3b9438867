"""mpirun -n 4 python tests/mpi/idle_wait.py: ranks waiting for a late rank leave the CPU free.

Rank 0 computes for a while before it broadcasts; the others wait in Bcast and in Recv. With
4 ranks on 2 cores, the waiting ranks must not spin: their CPU time while waiting stays small.
"""

import time

import numpy as np

from mpipar.mpi import comm as C

C.install_excepthook()
C.choose_wait()  # as the runner does: the default for this machine, or MPIPAR_WAIT
w = C.world()
LATE = 1.0  # seconds rank 0 keeps everyone waiting

buf = np.zeros(1000)
if w.rank == 0:
    time.sleep(LATE)
    buf[:] = 1.0
cpu0, wall0 = time.process_time(), time.perf_counter()
w.Bcast(buf, root=0)
if w.rank == 0:
    time.sleep(LATE)
    for dest in range(1, w.size):
        w.Send(buf, dest)
else:
    w.Recv(buf, 0)
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
assert np.all(buf == 1.0)
if w.rank != 0:
    assert wall > 1.5 * LATE, wall  # it really waited
    share = cpu / wall
    print(f"rank {w.rank}: waited {wall:.2f} s using {cpu:.3f} s of CPU ({share:.1%}), "
          f"wait mode {C.WAIT}", flush=True)
    assert share < 0.25, f"rank {w.rank} burned {share:.0%} of a core while waiting ({C.WAIT})"
