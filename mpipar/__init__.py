"""mpipar: data, tensor and pipeline parallel training, written step by step in explicit MPI.

The schemes stand at the front door, in reading order:
    serial            the reference trainer every scheme must reproduce (no MPI)
    data_parallel     replicas and their gradient sums; zero: ZeRO-2 and ZeRO-3
    tensor_parallel   Megatron's column- and row-parallel layers
    pipeline          stages run by one schedule interpreter
    hybrid            data x tensor x pipeline on one process grid
    train             the runner every scheme hands over to
The rooms, arrows pointing one way (tools -> schemes -> runner -> parts -> mpi -> engine):
    engine/   backend, parameters, nn, optim, data: one process, no MPI
    mpi/      comm (the only place arrays meet MPI) and what surrounds a call
    parts/    schedules, the stage plan, tensor- and sequence-parallel layers
    runner/   flags, checkpoints, clipping, recomputation, the memory ledger
    tools/    benchmarks, the report, the cost model, figures, cluster, student track
"""

__version__ = "0.1.0"
