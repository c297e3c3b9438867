"""Where the process grid's groups sit on the hosts of an emulated cluster (mpipar.tools.cluster).

    python -m mpipar.tools.cluster --hosts 2 mpirun -n 4 python tests/mpi/cluster_layout.py 2 2 1

Arguments: dp tp pp. With 2 ranks per host and tp 2, every tensor-parallel group (the most
talkative) stays inside one host, and the data-parallel or pipeline groups cross the link,
because world_rank = dp * (PP * TP) + pp * TP + tp and mpirun fills a host with a block of ranks.
"""

import sys

from mpi4py import MPI

from mpipar.mpi.comm import install_excepthook
from mpipar.mpi.grid import Grid

install_excepthook()
dp, tp, pp = map(int, sys.argv[1:4])
grid = Grid(dp, tp, pp)
host = MPI.Get_processor_name()
hosts = {name: set(comm.allgather_obj(host)) for name, comm in
         (("tp", grid.tp_comm), ("pp", grid.pp_comm), ("dp", grid.dp_comm))}
assert len(hosts["tp"]) == 1, f"rank {grid.world.rank}: tp group on hosts {hosts['tp']}"
crossing = "dp" if dp > 1 else "pp"
assert len(hosts[crossing]) > 1, f"rank {grid.world.rank}: {crossing} group on {hosts[crossing]}"
every = grid.world.allgather_obj(host)
if grid.world.rank == 0:
    print(f"layout ok: ranks on {every}; tp groups inside a host, {crossing} groups across")
