"""The process grid: DP x TP x PP communicators carved from COMM_WORLD with Split.

Rank layout (documented, and the same in every scheme): tensor-parallel ranks vary fastest,
then pipeline stages, then data-parallel replicas::

    world_rank = dp * (PP * TP) + pp * TP + tp

so a tensor-parallel group (which talks most: several allreduces per layer) is a run of
neighbouring ranks, which sit on the same node in a real cluster; pipeline neighbours come next
and data-parallel replicas (one allreduce per step) are the farthest apart.

Each scheme takes its communicator from here (``grid.dp_comm``, ``grid.tp_comm``,
``grid.pp_comm``), never COMM_WORLD, so the hybrid scheme can combine all three.

Run ``mpirun -n 8 python -m mpipar.mpi.grid --dp 2 --tp 2 --pp 2`` to print a layout (``--cp 2``:
with context-parallel groups of 2 replicas carved from each dp group, as the hybrid does).
"""

import argparse

from mpi4py import MPI

from mpipar.mpi import comm
from mpipar.mpi.comm import install_excepthook, refuse
from mpipar.mpi.direct import communicator
from mpipar.mpi.explain import say
from mpipar.mpi.failure import watched


def layouts(n):
    """Every (dp, tp, pp) whose product is n."""
    return [(d, t, n // (d * t)) for d in range(1, n + 1) if n % d == 0
            for t in range(1, n // d + 1) if (n // d) % t == 0]


class Grid:
    def __init__(self, dp=1, tp=1, pp=1, mpi_comm=None):
        mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        n = mpi_comm.Get_size()
        if dp * tp * pp != n:
            valid = ", ".join(f"--dp {d} --tp {t} --pp {p}" for d, t, p in layouts(n))
            refuse(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}, but the job has {n} ranks. "
                   f"Layouts for {n} ranks: {valid}")
        if comm.WAIT is None:  # a job without the runner: the default way to wait
            comm.choose_wait()
        self.world = communicator(mpi_comm, "world")
        self.dp_size, self.tp_size, self.pp_size = dp, tp, pp
        rank = self.world.rank
        self.dp_rank, rest = divmod(rank, pp * tp)
        self.pp_rank, self.tp_rank = divmod(rest, tp)
        # Split(color, key): ranks with the same color form a group, ordered by key.
        def split(color, key, name):
            with watched("Split", "all ranks", f"the {name} groups"):
                return communicator(mpi_comm.Split(color, key), name)

        # no context parallelism unless a scheme carves cp groups from dp_comm
        # (split_context): every replica then takes its own rows
        self.cp_rank, self.cp_size = 0, 1
        self.data_rank, self.data_size = self.dp_rank, dp
        self.tp_comm = split(self.dp_rank * pp + self.pp_rank, self.tp_rank, "tp")
        self.pp_comm = split(self.dp_rank * tp + self.tp_rank, self.pp_rank, "pp")
        self.dp_comm = split(self.pp_rank * tp + self.tp_rank, self.dp_rank, "dp")

    def split_context(self, cp):
        """Split ``dp_comm`` (the ranks that hold the same layers) into context-parallel groups
        of ``cp`` consecutive ranks (``cp_comm``), which take the same rows and split their
        tokens (:mod:`mpipar.context_parallel`), and give each rank its index among the
        ``dp_size // cp`` data-parallel groups, which take different rows."""
        r = self.dp_comm.rank
        with watched("Split", "all ranks", "the cp groups"):
            self.cp_comm = communicator(self.dp_comm.mpi.Split(r // cp, r % cp), "cp")
        self.cp_rank, self.cp_size = self.cp_comm.rank, self.cp_comm.size
        self.data_rank, self.data_size = r // cp, self.dp_comm.size // cp

    @staticmethod
    def rank_of(dp, pp, tp, sizes):
        """World rank of coordinate (dp, pp, tp) in a grid of sizes (DP, TP, PP)."""
        _, TP, PP = sizes
        return dp * (PP * TP) + pp * TP + tp

    def describe(self):
        """One line per rank (gathered to rank 0): coordinate and group members."""
        def members(comm):
            return comm.allgather_obj(self.world.rank)

        line = (f"rank {self.world.rank}: dp={self.dp_rank} tp={self.tp_rank} pp={self.pp_rank}"
                f"   tp group {members(self.tp_comm)}   pp group {members(self.pp_comm)}"
                f"   dp group {members(self.dp_comm)}")
        if self.cp_size > 1:  # cp groups carved from the dp group (mpipar.context_parallel)
            line += f"   cp group {members(self.cp_comm)}"
        lines = self.world.gather_obj(line)
        return "\n".join(lines) if lines else None


def main(argv=None):
    install_excepthook()
    ap = argparse.ArgumentParser(prog="python -m mpipar.mpi.grid",
                                 description="Print the rank layout.")
    ap.error = lambda message: refuse(f"{message} (see --help)")
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1,
                    help="context-parallel groups of cp replicas inside each dp group")
    args = ap.parse_args(argv)
    for flag in ("dp", "tp", "pp", "cp"):  # 0 would divide by zero below, a negative mislead
        size = getattr(args, flag)
        if size is not None and size < 1:
            refuse(f"--{flag} must be at least 1, got {size}")
    n = MPI.COMM_WORLD.Get_size()
    dp = args.dp if args.dp is not None else max(n // (args.tp * args.pp), 1)
    if dp % args.cp:
        refuse(f"--cp {args.cp} must divide the {dp} data-parallel replicas")
    grid = Grid(dp, args.tp, args.pp)
    if args.cp > 1:
        grid.split_context(args.cp)
    text = grid.describe()
    if text:
        say(text)


if __name__ == "__main__":
    main()
