"""mpirun -n 4 python tests/mpi/wait_default.py: how a rank waits when MPIPAR_WAIT names no
strategy: backoff when the ranks outnumber the cores, spin when not, and sleep for a pipeline's
stages when they outnumber them; MPIPAR_WAIT, when given, for every scheme."""

import os

from mpipar import serial, train
from mpipar.mpi import comm, waiting
from mpipar.mpi.grid import Grid

given = os.environ.get("MPIPAR_WAIT") or None  # unset or empty: none given
over = comm.OVERSUBSCRIBED
assert comm.WAIT == (given or ("backoff" if over else "spin")), comm.WAIT
a = train.parse_args("pipeline", ["--model", "mlp", "--quiet", "--steps", "1"])
train.trainer_class("pipeline", a)(serial.Task(a), Grid(a.dp, a.tp, a.pp), a)
assert comm.WAIT == (given or ("sleep" if over else "spin")), comm.WAIT
assert waiting.default(True, long_waits=True) == waiting.LONG_WAITS == "sleep"
if comm.world().rank == 0:
    print(f"waits: {comm.WAIT} (oversubscribed: {over}, MPIPAR_WAIT: {given})", flush=True)
