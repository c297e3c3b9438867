"""mpirun -n 4 python tests/mpi/idle_wait.py: ranks waiting for a late rank leave the CPU free.

Rank 0 computes for a while before it broadcasts; the others wait in Bcast and in Recv. With
4 ranks on 2 cores, the waiting ranks must not spin: they give up their core (a voluntary
context switch: a sleep) again and again while they wait, where a spinning rank never does.
"""

import resource
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
cpu0, wall0, gave0 = time.process_time(), time.perf_counter(), resource.getrusage(
    resource.RUSAGE_SELF).ru_nvcsw
w.Bcast(buf, root=0)
if w.rank == 0:
    time.sleep(LATE)
    for dest in range(1, w.size):
        w.Send(buf, dest)
else:
    w.Recv(buf, 0)
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
gave = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - gave0
assert np.all(buf == 1.0)
if w.rank != 0:
    assert wall > 1.5 * LATE, wall  # it really waited
    share = cpu / wall
    print(f"rank {w.rank}: waited {wall:.2f} s using {cpu:.3f} s of CPU ({share:.1%}), "
          f"wait mode {C.WAIT}, gave up its core {gave} times", flush=True)
    # whether it gave up its core (a sleep; a spin or a yield never blocks), not how much CPU it
    # got: a spinning rank on a busy machine gets little, an idle one all of a core
    assert gave >= 10, f"rank {w.rank} burned its core while waiting ({C.WAIT}): it gave it " \
        f"up {gave} times in {wall:.1f} s"
