"""mpirun -n P python tests/mpi/clip_mistake.py FLAGS: the tensor-parallel trainer with the
classic clipping bug: every rank counts the replicated tensors in the global norm."""

import math
import sys

from mpipar import train
from mpipar.runner import clip


def norm_counting_replicas_everywhere(params, groups):
    mine = sum(float((p.grad * p.grad).sum()) for p in params)  # the bug: no replica skipped
    return math.sqrt(clip.summed(mine, groups))


clip.global_norm = norm_counting_replicas_everywhere
train.main("tensor_parallel", sys.argv[1:])
