"""mpirun -n 4 python lessons/code/00_ranks.py | sort

Lesson 0, part 1: ranks and communicators. mpirun starts 4 copies of this program. Each copy
asks COMM_WORLD (the communicator of the whole job) for its rank and the size; then the
world splits into two smaller communicators, the even ranks and the odd ranks. `sort` puts
the lines that the four ranks print in any order into one order.
"""

import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
# one write per line: lines that several ranks write at once then stay whole
sys.stdout.write(f"hello from rank {rank} of {size}\n")  # in an order that changes every run
sys.stdout.flush()

# Split: ranks with the same color end up in the same new communicator, ordered by key
color = rank % 2
half = world.Split(color=color, key=rank)
line = (f"world rank {rank}: {('even', 'odd')[color]} group, "
        f"rank {half.Get_rank()} of {half.Get_size()}")
lines = world.gather(line, root=0)  # a few words: the pickled (lower-case) call is fine here
if rank == 0:  # one write too: print() writes the text and its newline apart when unbuffered
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()

assert half.Get_rank() == rank // 2
assert half.Get_size() == (size + 1 - color) // 2
half.Free()
