"""mpirun -n P python tests/mpi/clip_mistake.py FLAGS: the tensor-parallel trainer with the
classic clipping bug: every rank counts the replicated tensors in the global norm."""

import math
import sys

from mpipar import train
from mpipar.runner import clip


def split_norm_counting_replicas_everywhere(tp_comm, groups):
    def norm(params):
        return math.sqrt(clip.summed(clip.sum_of_squares(params), groups))  # the bug
    return norm


clip.split_norm = split_norm_counting_replicas_everywhere
train.main("tensor_parallel", sys.argv[1:])
