"""mpirun -n 2 python -X faulthandler lessons/code/10_segfault.py

Lesson 10: rank 1 reads memory at address 0, as a bug in C code would. The process dies of a
segmentation fault at once, with no Python traceback; rank 0 waits for it in a Barrier until
the launcher ends the job. With -X faulthandler (or PYTHONFAULTHANDLER=1) the dying rank first
prints its Python stack: the line that called into the C code.
"""

import ctypes

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    ctypes.string_at(0)  # read address 0: a segmentation fault
comm.Barrier()
