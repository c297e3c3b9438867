"""mpirun -n 2 python lessons/code/00_deadlock.py [--broken [--ssend]]

Lesson 0, part 3: a deadlock made on purpose, and two ways out.

Both ranks call Send first, then Recv. MPI copies a small message into a buffer and returns
from Send at once ("eager"); a large one waits in Send until the other rank receives it
("rendezvous"). Both ranks then wait in Send for a Recv that neither reaches: a deadlock.

--broken: double the message from 8 bytes until that happens; the last line printed names the
size that hangs. Run it under `timeout`, which ends it. --ssend: use Ssend, a send that always
waits for its receive: it hangs at the first size. Without a flag: the fixes, Sendrecv and
Isend/Irecv, with a message of 8 MiB, far above the eager limit.
"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run with mpirun -n 2"
other = 1 - rank


def everyone_sends_first(out, back, send):
    send(out, dest=other)  # both ranks are here at once...
    comm.Recv(back, source=other)  # ...and only get here if MPI buffered the message


if "--broken" in sys.argv:
    send = comm.Ssend if "--ssend" in sys.argv else comm.Send
    n_bytes = 8
    while n_bytes <= 1 << 26:  # up to 64 MiB: far beyond any eager limit
        out, back = np.full(n_bytes // 8, float(rank)), np.empty(n_bytes // 8)
        if rank == 0:
            print(f"{n_bytes:>9} bytes: ", end="", flush=True)
        everyone_sends_first(out, back, send)
        if rank == 0:
            print("passed", flush=True)
        n_bytes *= 2
    sys.exit(0)  # no deadlock at any size: the exchange does not rely on MPI's buffering

n = 1 << 20  # 1,048,576 float64 values: 8 MiB
out, back = np.full(n, float(rank)), np.empty(n)

# Fix 1: Sendrecv. MPI posts the send and the receive together, so neither waits on the other.
comm.Sendrecv(out, dest=other, recvbuf=back, source=other)
assert (back == other).all()
if rank == 0:
    print(f"Sendrecv of {out.nbytes:,} bytes each way: passed", flush=True)

# Fix 2: post both without waiting (Isend, Irecv), then wait for both.
back[:] = -1
requests = [comm.Irecv(back, source=other), comm.Isend(out, dest=other)]
MPI.Request.Waitall(requests)
assert (back == other).all()
if rank == 0:
    print(f"Isend/Irecv of {out.nbytes:,} bytes each way: passed", flush=True)
