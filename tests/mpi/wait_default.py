"""mpirun -n 4 python tests/mpi/wait_default.py: how a rank waits when MPIPAR_WAIT names no
strategy: backoff when the ranks outnumber the cores, spin when not, and sleep for a pipeline's
stages when they outnumber them; MPIPAR_WAIT, when given, for every scheme. Nothing is chosen
at import (no collective there): the runner chooses, or the grid where the runner did not."""

import os

from mpipar import train
from mpipar.engine import backend as B
from mpipar.mpi import comm, waiting
from mpipar.mpi.grid import Grid

given = os.environ.get("MPIPAR_WAIT") or None  # unset or empty: none given
assert comm.WAIT == given, comm.WAIT  # at import: only what MPIPAR_WAIT names
over = B.on_this_machine()[1] > B.cores()
Grid(dp=comm.world().size)
assert comm.WAIT == (given or ("backoff" if over else "spin")), comm.WAIT
train.main("pipeline", ["--model", "mlp", "--quiet", "--steps", "1", "--timeline", "none"])
assert comm.WAIT == (given or ("sleep" if over else "spin")), comm.WAIT
assert waiting.default(True, long_waits=True) == waiting.LONG_WAITS == "sleep"
if comm.world().rank == 0:
    print(f"waits: {comm.WAIT} (oversubscribed: {over}, MPIPAR_WAIT: {given})", flush=True)
