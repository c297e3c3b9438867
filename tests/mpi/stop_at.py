"""mpirun -n 4 python tests/mpi/stop_at.py MOMENT FLAGS...: one rank stops itself (SIGSTOP) at
MOMENT of a data-parallel run with FLAGS; the others' watchdogs must end the job.

MOMENT names where the stop comes, from the job's first collective to its last:

- ``paths``: rank 1, before the check of the output paths (rank 0 waits for nobody there,
  then the others wait in the bcast of its verdict);
- ``machine``: rank 1, in the shared-memory split that counts the ranks of a machine;
- ``grid``: rank 1, in the Split that carves the process grid;
- ``write``: rank 1, writing its file of a checkpoint (rank 0 waits in the gather);
- ``rename``: rank 0, renaming a checkpoint into place (the others wait in the barrier);
- ``load``: rank 0, checking the checkpoint it resumes from (the others wait in the bcast);
- ``finalize``: rank 1, after training, before MPI_Finalize (the others wait in it).

Every rank prints its pid first, so that a test can check that no process outlives the job.
"""

import contextlib
import os
import signal
import sys

from mpi4py import MPI

from mpipar import train
from mpipar.engine import backend as B
from mpipar.mpi import grid
from mpipar.runner import checkpoint

moment, flags = sys.argv[1], sys.argv[2:]
rank = MPI.COMM_WORLD.Get_rank()
os.write(1, f"rank {rank} pid {os.getpid()}\n".encode())


def stop():
    os.kill(os.getpid(), signal.SIGSTOP)


def stopping(f):
    def stopped(*args, **kwargs):
        stop()
        return f(*args, **kwargs)
    return stopped


@contextlib.contextmanager
def stopping_in_split(op, *args):
    if op == "Split":
        stop()
    yield


STOPS = {  # moment: (the rank that stops, the module, the name of what it stops in)
    "paths": (1, train, "check_paths"), "machine": (1, B, "on_this_machine"),
    "grid": (1, grid, "watched"), "write": (1, checkpoint, "_fsynced"),
    "rename": (0, checkpoint, "_sync_dir"), "load": (0, checkpoint, "inspect"),
}
if moment in STOPS:
    who, module, name = STOPS[moment]
    if rank == who:
        setattr(module, name, stopping_in_split if moment == "grid" else
                stopping(getattr(module, name)))
elif moment != "finalize":
    raise SystemExit(f"unknown moment {moment!r}: {', '.join(STOPS)} or finalize")
train.main("data_parallel", flags)
if moment == "finalize" and rank == 1:
    stop()
print(f"rank {rank} past the run", flush=True)  # unreachable, but at moment finalize
