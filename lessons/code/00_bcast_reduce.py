"""mpirun -n 4 python lessons/code/00_bcast_reduce.py

Lesson 0, part 4: Bcast and Reduce written by hand from Send and Recv, two ways each.

Linear: the root sends to (or receives from) every other rank in turn: p - 1 rounds.
Binomial tree: the root first sends half-way round (to the rank 2**(ceil(log2 p) - 1) away),
and in each later round every rank that has the data sends it half as far as the round
before, so the number of ranks that have it doubles each round: ceil(log2 p) rounds. (When p
is not a power of two, a send to a rank past p - 1 is skipped, and the sender goes on to its
next partner a round early.) Reduce
is the same tree run backwards, adding on the way: the nearest partners first. Each is
checked against MPI's own Bcast and Reduce.
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
count = {"sent": 0, "received": 0}  # this rank's messages: what the printout compares


def send(buf, dest):
    count["sent"] += 1
    comm.Send(buf, dest=dest)


def recv(buf, source):
    count["received"] += 1
    comm.Recv(buf, source=source)


def bcast_linear(buf, root=0):
    if rank == root:
        for r in range(p):
            if r != root:
                send(buf, r)
    else:
        recv(buf, root)


def bcast_tree(buf, root=0):
    me = (rank - root) % p  # my rank counted from the root: the root is 0
    mask = 1
    while mask < p:  # receive once, from the rank that has my lowest set bit cleared
        if me & mask:
            recv(buf, (me - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then pass it on: to me + 2**k for each k below that bit
        if me + mask < p:
            send(buf, (me + mask + root) % p)
        mask >>= 1


def reduce_linear(sendbuf, recvbuf, root=0):
    if rank == root:
        recvbuf[:] = sendbuf
        part = np.empty_like(sendbuf)
        for r in range(p):
            if r != root:
                recv(part, r)
                recvbuf += part
    else:
        send(sendbuf, root)


def reduce_tree(sendbuf, recvbuf, root=0):
    me = (rank - root) % p
    total, part = sendbuf.copy(), np.empty_like(sendbuf)
    mask = 1
    while mask < p:  # the broadcast's tree, leaves first: add the children, send to the parent
        if me & mask:
            send(total, (me - mask + root) % p)
            break
        if me + mask < p:
            recv(part, (me + mask + root) % p)
            total += part
        mask <<= 1
    if rank == root:
        recvbuf[:] = total


def slowest(seconds):
    return comm.allreduce(seconds, op=MPI.MAX)  # one float: the pickled call is fine


def timed(fn, *args, repeats=5):
    """Median over repeats of the slowest rank's time."""
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = MPI.Wtime()
        fn(*args)
        times.append(slowest(MPI.Wtime() - t0))
    return float(np.median(times))


n = 1 << 17  # 131,072 float64 values: 1 MiB
rng = np.random.default_rng(rank)
mine = rng.integers(-1000, 1000, n).astype(np.float64)  # integers: every sum order is exact
root_data = np.random.default_rng(99).integers(-1000, 1000, n).astype(np.float64)

results = {}  # name: (result, what each rank sent (bcast) or received (reduce))
for name, fn in [("linear", bcast_linear), ("tree", bcast_tree)]:
    buf = root_data.copy() if rank == 0 else np.zeros(n)
    count.update(sent=0, received=0)
    fn(buf)
    results[f"bcast {name}"] = (buf, comm.gather(count["sent"], root=0))
for name, fn in [("linear", reduce_linear), ("tree", reduce_tree)]:
    out = np.zeros(n)
    count.update(sent=0, received=0)
    fn(mine, out)
    results[f"reduce {name}"] = (out, comm.gather(count["received"], root=0))

want_bcast = root_data.copy() if rank == 0 else np.zeros(n)
comm.Bcast(want_bcast, root=0)
want_reduce = np.zeros(n)
comm.Reduce(mine, want_reduce, op=MPI.SUM, root=0)

times = {
    "bcast linear": timed(bcast_linear, np.zeros(n)),
    "bcast tree": timed(bcast_tree, np.zeros(n)),
    "bcast MPI": timed(comm.Bcast, np.zeros(n)),
    "reduce linear": timed(reduce_linear, mine, np.zeros(n)),
    "reduce tree": timed(reduce_tree, mine, np.zeros(n)),
    "reduce MPI": timed(comm.Reduce, mine, np.zeros(n)),
}

for key, (got, _) in results.items():  # every rank checks, before anything is printed
    if key.startswith("bcast"):
        assert np.array_equal(got, want_bcast), key
    elif rank == 0:
        assert np.array_equal(got, want_reduce), key

if rank == 0:
    print(f"{p} ranks, {n * 8:,} bytes")
    for key, (_, counts) in results.items():
        verb = "sent" if key.startswith("bcast") else "received"
        print(f"{key:<14} equals MPI's: yes   messages {verb} by each rank: {counts}")
    for key, t in times.items():
        print(f"{key:<14} {t * 1e3:8.2f} ms")

# -- the checks: the counts (the values are checked before the printout says they are equal)
if rank == 0:
    for key, (_, counts) in results.items():
        assert sum(counts) == p - 1, key  # every rank but the root gets (gives) the data once
    for op in ("bcast", "reduce"):  # what the root sends or receives: p - 1, or ceil(log2 p)
        assert results[f"{op} linear"][1][0] == p - 1
        assert results[f"{op} tree"][1][0] == (p - 1).bit_length()
