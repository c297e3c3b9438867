"""mpirun -n 4 python tests/mpi/comm_checks.py: comm's counting, checks and results."""

import numpy as np
from mpi4py import MPI

from mpipar.mpi import comm as C
from mpipar.mpi import direct, waiting

C.install_excepthook()
w = C.world()
p, r = w.size, w.rank
n = 1000  # float64 elements

# Allreduce: the sum, and n*8 bytes counted each way
a = np.full(n, r + 1.0)
w.Allreduce(a)
assert np.all(a == p * (p + 1) / 2), a[:3]
assert w.stats["Allreduce"]["calls"] == 1 and w.stats["Allreduce"]["sent"] == 8 * n

# Bcast: root counts (p-1) n bytes sent, each other rank n received
b = np.arange(n, dtype=np.float64) if r == 0 else np.zeros(n)
w.Bcast(b, root=0)
assert np.array_equal(b, np.arange(n))
expect = (w.stats["Bcast"]["sent"], w.stats["Bcast"]["recv"])
assert expect == (((p - 1) * 8 * n, 0) if r == 0 else (0, 8 * n)), expect

# Reduce
out = np.zeros(n)
w.Reduce(np.full(n, float(r)), out, root=0)
if r == 0:
    assert np.all(out == sum(range(p))) and w.stats["Reduce"]["recv"] == (p - 1) * 8 * n
else:
    assert w.stats["Reduce"]["sent"] == 8 * n

# Scatterv of 10 rows over p ranks, uneven
counts = C.split_rows(10, p)
full = np.arange(10 * 3, dtype=np.float64).reshape(10, 3)
mine = np.empty((counts[r], 3))
w.Scatterv(full if r == 0 else None, counts, mine, root=0)
start = sum(counts[:r])
assert np.array_equal(mine, full[start:start + counts[r]])
back = np.zeros((10, 3)) if r == 0 else None
w.Gatherv(mine, counts, back, root=0)
if r == 0:
    assert np.array_equal(back, full)

# Allgather and Reduce_scatter
g = np.empty((p, 2))
w.Allgather(np.full((1, 2), float(r)), g)
assert np.array_equal(g[:, 0], np.arange(p))
rs = np.empty(2)
w.Reduce_scatter(np.ones(2 * p), rs)
assert np.all(rs == p)

# Point to point in a ring with Sendrecv: one message each, counted
w.reset_stats()
recv = np.empty(5)
w.Sendrecv(np.full(5, float(r)), (r + 1) % p, recv, (r - 1) % p)
assert np.all(recv == (r - 1) % p)
assert dict(w.stats["Sendrecv"]) == {"calls": 1, "sent": 40, "recv": 40, "messages": 1}

# A transposed view is refused before MPI sees it, on every rank
m = np.arange(12.0).reshape(3, 4)
for call in (lambda: w.Send(m.T, (r + 1) % p), lambda: w.Allreduce(m[:, ::2]),
             lambda: w.Bcast(m.T)):
    try:
        call()
    except ValueError as err:
        assert "non-contiguous" in str(err)
    else:
        raise AssertionError("a non-contiguous array was sent")
assert w.total("messages") == 1  # the refused sends were not counted

# The blocking Send and Recv that go straight to MPI (MPIPAR_WAIT=spin): a strided 1-D view,
# which they hand to MPI unchecked, and a transposed one are refused with the same words and
# not counted; what they move is counted in stats like every call (plain counters, folded in
# when stats is read): DirectComm, what a spinning rank gets
C.WAIT, strided = "spin", np.arange(8.0)[::2]
reference, w = w, direct.communicator(MPI.COMM_WORLD, "world")
assert type(w) is direct.DirectComm and type(reference) is C.Comm, (type(w), type(reference))
for call in (lambda: w.Send(strided, (r + 1) % p), lambda: w.Recv(strided, (r - 1) % p),
             lambda: w.Send(m.T, (r + 1) % p), lambda: w.Recv(m.T, (r - 1) % p)):
    try:
        call()
    except ValueError as err:
        assert "non-contiguous" in str(err), err
    else:
        raise AssertionError("a strided view went to MPI")
for k in range(3):  # a ring: even ranks send first, odd ranks receive first
    out, got = np.full(k + 1, float(r)), np.empty(k + 1)
    if r % 2 == 0:
        w.Send(out, (r + 1) % p)
        w.Recv(got, (r - 1) % p)
    else:
        w.Recv(got, (r - 1) % p)
        w.Send(out, (r + 1) % p)
    assert np.all(got == (r - 1) % p), got
assert dict(w.stats["Send"]) == {"calls": 3, "sent": 48, "recv": 0, "messages": 3}, w.stats
assert dict(w.stats["Recv"]) == {"calls": 3, "sent": 0, "recv": 48, "messages": 0}, w.stats
w.reset_stats()
assert not w.stats and w.total("messages") == 0
C.WAIT, w = "backoff", reference

# A message of the wrong size is an error, not a silent partial receive
if r == 0:
    w.Send(np.zeros(3), 1, tag=9)
elif r == 1:
    try:
        w.Recv(np.zeros(4), 0, tag=9)
    except ValueError as err:
        assert "got 24 bytes" in str(err), err
    else:
        raise AssertionError("a short message was accepted")
try:  # the ring's call too: every rank sends 3 values where 5 are expected
    w.Sendrecv(np.zeros(3), (r + 1) % p, np.zeros(5), (r - 1) % p, tag=10)
except ValueError as err:
    assert f"Sendrecv from {(r - 1) % p}: got 24 bytes" in str(err) and "expects 40" in str(err)
else:
    raise AssertionError("a short message was accepted by Sendrecv")

w.Barrier()
if r == 0:
    print("comm checks passed", flush=True)

# A receive polled with test() to completion keeps its status: the size check still works
w.Barrier()
if r == 0:
    w.Send(np.arange(6.0), 1, tag=5)
elif r == 1:
    got = np.empty(6)
    req = w.Irecv(got, 0, tag=5)
    while not req.test():
        pass
    req.wait()
    assert np.array_equal(got, np.arange(6.0)), got
w.Barrier()
if r == 0:
    print("non-blocking checks passed", flush=True)


def refused(call, *words):
    """``call()`` raises a ValueError whose line holds every one of ``words``."""
    try:
        call()
    except ValueError as err:
        assert all(word in str(err) for word in words), (words, err)
    else:
        raise AssertionError(f"accepted: {words}")


# Every receive checks what arrived: a message longer than its buffer (MPI's truncation error,
# as one line), a posted receive completed by wait() or by test(), the spinning rank's direct
# Recv, and the ring's Sendrecv
if r == 0:
    for k in range(4):
        w.Send(np.zeros(6), 1, tag=20 + k)
    w.Send(np.zeros(4), 1, tag=24)
elif r == 1:
    refused(lambda: w.Recv(np.zeros(4), 0, tag=20), "Recv from 0", "longer than the 32 bytes")
    refused(lambda: w.Irecv(np.zeros(4), 0, tag=21).wait(), "longer than the 32 bytes")
    req = w.Irecv(np.zeros(4), 0, tag=22)
    refused(lambda: [req.test() for _ in iter(int, 1)], "longer than the 32 bytes")
    C.WAIT = "spin"
    spinning = direct.communicator(MPI.COMM_WORLD, "world")
    assert type(spinning) is direct.DirectComm, type(spinning)
    refused(lambda: spinning.Recv(np.zeros(4), 0, tag=23), "Recv from 0", "longer than the 32")
    C.WAIT = "backoff"
    refused(lambda: w.Irecv(np.zeros(6), 0, tag=24).wait(), "got 32 bytes", "expects 48")
refused(lambda: w.Sendrecv(np.zeros(6), (r + 1) % p, np.zeros(5), (r - 1) % p, tag=25),
        f"Sendrecv from {(r - 1) % p}: got a message longer than the 40 bytes")

# The gathers and scatters with counts move exactly the rows the counts name: a rank whose
# array disagrees with its count (every rank here), a root whose buffer disagrees with their
# sum (the root alone calls: nothing reaches MPI), and a reduce-scatter of uneven blocks
refused(lambda: w.Gatherv(np.zeros((3, 2)), [2] * p, None), f"rank {r}'s array has 3 rows, "
        "the counts say 2")
refused(lambda: w.Scatterv(None, [2] * p, np.zeros((3, 2))), f"rank {r}'s buffer has 3 rows")
refused(lambda: w.Reduce_scatter(np.zeros(p + 1), np.zeros(1)),
        f"{p + 1} rows do not split into {p} equal blocks")
if r == 0:
    refused(lambda: w.Gatherv(np.zeros((2, 2)), [2] * p, np.zeros((2 * p + 1, 2))),
            "root 0's buffer has", f"the counts say {2 * p}")
    refused(lambda: w.Gatherv(np.zeros((2, 2)), [2] * p, np.zeros((2 * p, 3))),
            "rows of shape (3,) float64, the other side's are (2,) float64")
    refused(lambda: w.Scatterv(np.zeros((2 * p - 1, 2)), [2] * p, np.zeros((2, 2))),
            "root 0's array has", f"the counts say {2 * p}")
w.Barrier()
if r == 0:
    print("count checks passed", flush=True)

# Every way of waiting (MPIPAR_WAIT) completes blocking and posted calls alike, each through
# the communicator a rank waiting so gets (DirectComm for spin)
for mode in waiting.STRATEGIES:
    C.WAIT = mode
    w = direct.communicator(MPI.COMM_WORLD, "world")
    a = np.full(3, float(r))
    w.Allreduce(a)
    got = np.empty(2)
    w.Sendrecv(np.full(2, float(r)), (r + 1) % p, got, (r - 1) % p)
    req = w.Irecv(np.empty(1), (r - 1) % p, tag=7)
    w.Send(np.full(1, float(r)), (r + 1) % p, tag=7)
    req.wait()
    assert np.all(a == sum(range(p))) and np.all(got == (r - 1) % p), mode
    assert set(w.stats) == {"Allreduce", "Sendrecv", "Recv", "Send"}, (mode, set(w.stats))
w.Barrier()
if r == 0:
    print(f"waiting checks passed: {', '.join(waiting.STRATEGIES)}", flush=True)
