"""mpirun -n 4 python tests/mpi/ring_mistakes.py KIND: ring_check.py against a planted mistake
in the ring (the learner's slips it must name): ``mean`` divides the sum by P, ``copy`` sums a
copy and leaves ``buf`` alone, ``allreduce`` calls MPI's, ``skip`` forgets the last
reduce-scatter addition, ``left`` sends to the left neighbour and receives from the right."""

import runpy
import sys
from pathlib import Path

import numpy as np

from mpipar import data_parallel as DP

KIND = sys.argv[1]
reference = DP.ring_allreduce


def planted(dp_comm, buf, what="buffer"):
    p, r = dp_comm.size, dp_comm.rank
    if KIND == "mean":
        reference(dp_comm, buf)
        buf /= p
        return buf
    if KIND == "copy":
        return reference(dp_comm, buf.copy())
    if KIND == "allreduce":
        dp_comm.Allreduce(buf)
        return buf
    chunks = np.array_split(buf, p)
    right, left = ((r - 1) % p, (r + 1) % p) if KIND == "left" else ((r + 1) % p, (r - 1) % p)
    incoming = np.empty(chunks[0].size)
    for k in range(p - 1):
        mine = chunks[(r - k - 1) % p]
        got = incoming[:mine.size]
        dp_comm.Sendrecv(chunks[(r - k) % p], right, got, left)
        if not (KIND == "skip" and k == p - 2):
            mine += got
    for k in range(p - 1):
        dp_comm.Sendrecv(chunks[(r + 1 - k) % p], right, chunks[(r - k) % p], left)
    return buf


DP.ring_allreduce = planted
sys.argv = [sys.argv[0]]
runpy.run_path(str(Path(__file__).with_name("ring_check.py")), run_name="__main__")
