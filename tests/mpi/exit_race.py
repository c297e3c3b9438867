"""mpirun -n 4 python tests/mpi/exit_race.py: a job whose watchdog looks every 0.1 ms ends
cleanly. The watchdog thread keeps calling MPI (the clock) until the process is gone; one look
between MPI_Finalize and the exit once ended a job with "Attempting to use an MPI routine
after finalizing MPICH" and exit code 1 (on a loaded machine, 1 run in about 20)."""

import numpy as np

from mpipar.mpi import comm as C
from mpipar.mpi import failure

failure.LOOK_S = 1e-4  # the watchdog's look, every 0.1 ms instead of every 0.5 s
C.install_excepthook()
C.start_watchdog(600)
w = C.world()
x = np.ones(4)
for step in range(3):
    w.Allreduce(x, what=f"step {step}")
print(f"rank {w.rank} done", flush=True)
