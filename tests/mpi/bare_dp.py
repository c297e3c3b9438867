"""mpirun -n P python tests/mpi/bare_dp.py: bench wait's floor (:class:`BareDP`) does the
data-parallel step's arithmetic. From the same start, 3 steps of it and 3 of the allreduce
trainer give the same losses and parameters (relative 1e-10, float64), and the trainer it
copied its parameters from is left alone while it runs."""

import numpy as np

from mpipar import serial, train
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.tools.bench.wait import BareDP

C.install_excepthook()
B.use("numpy", "float64")
args = train.parse_args("data_parallel", ["--sync", "allreduce", "--dtype", "float64",
                                          "--batch-size", "30", "--quiet"])
trainer = train.trainer_class("data_parallel", args)(serial.Task(args), Grid(args.dp), args)
start = [p.data.copy() for p in trainer.params]
bare = BareDP(trainer)
bare_losses = [bare.step(step) for step in range(3)]
assert all(np.array_equal(p.data, s) for p, s in zip(trainer.params, start)), "trainer touched"
losses = [trainer.step(step) for step in range(3)]
assert not np.array_equal(trainer.params[0].data, start[0]), "3 steps moved no weight"
np.testing.assert_allclose(bare_losses, losses, rtol=1e-10)
named = dict(trainer.model.named_parameters())
ws = [p.data for name, p in named.items() if name.endswith(".W")]
bs = [p.data for name, p in named.items() if name.endswith(".b")]
assert len(ws) == len(bare.Ws) == 3 and len(bs) == len(bare.bs) == 3
for mine, theirs in zip(ws + bs, bare.Ws + bare.bs):
    np.testing.assert_allclose(theirs, mine, rtol=1e-10, atol=1e-13)
if C.world().rank == 0:
    print(f"bare dp equals the trainer on {C.world().size} ranks, losses {bare_losses}")
