"""mpirun -n P python tests/mpi/ring_check.py: the hand-written ring allreduce, chunk by chunk,
with a diagnosis a learner can act on (the student track's direct check of ring-allreduce).

Rank r's buffer holds 2^r (i + 1) at index i, so a sum over any set S of ranks is
(sum of 2^s over S) (i + 1): every value a rank sends or ends with says which ranks'
contributions it holds. Its n = 4P + 1 values do not cut evenly (chunks of 5, 4, 4, 4 on 4
ranks). Every call ring_allreduce makes is recorded. Rank 0 prints one line, ``ring check:
passed`` or what is wrong: the buffer never changed, 1/P of the sum, another call than
Sendrecv, the wrong number of messages, the first rank and chunk whose sum is wrong (and which
ranks it holds), the first send that differs from the ring of ``ring_allreduce``'s docstring
(rank, phase, step, the chunk it sent and the one it should have), or ranks that disagree;
the exit code is 1 when something is wrong.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpipar import data_parallel as DP
from mpipar.mpi import comm as C

WATCHDOG = 20  # seconds one call may wait: a deadlock ends named by its rank and call

C.install_excepthook()
C.start_watchdog(WATCHDOG)
world = C.world()
P, r = world.size, world.rank
N = 4 * P + 1
INDEX = np.arange(1, N + 1, dtype=np.float64)


class Recording:
    """The communicator ring_allreduce gets: every call recorded, each Sendrecv's send copied."""

    def __init__(self, comm):
        self.comm, self.size, self.rank, self.calls = comm, comm.size, comm.rank, []

    def Sendrecv(self, sendbuf, dest, recvbuf, source, tag=0, what=""):
        self.calls.append(("Sendrecv", dest, source, np.array(sendbuf, copy=True)))
        return self.comm.Sendrecv(sendbuf, dest, recvbuf, source, tag=tag, what=what)

    def __getattr__(self, name):  # any other MPI call: recorded, then made
        if name[:1].isupper() and not name.startswith("Get_"):
            self.calls.append((name, None, None, None))
        return getattr(self.comm, name)


def ranks_in(values, lo):
    """Which ranks' contributions ``values`` (starting at index ``lo``) hold, or None."""
    mask = values / INDEX[lo:lo + values.size]
    if values.size == 0 or not np.all(mask == mask[0]) or mask[0] != int(mask[0]) \
            or not 0 <= mask[0] < 2 ** P:
        return None
    return [s for s in range(P) if int(mask[0]) >> s & 1]


def named(ranks):
    if not ranks:
        return "no rank's values"
    return f"the values of rank{'s' * (len(ranks) > 1)} " + ", ".join(map(str, ranks))


def reference_sends():
    """What the ring of ring_allreduce's docstring sends: per rank, per call, (lo, ranks held)."""
    bounds = np.cumsum([0] + [c.size for c in np.array_split(INDEX, P)])
    held = [[{s} for _ in range(P)] for s in range(P)]  # rank s, chunk j: the ranks summed in
    sends = [[] for _ in range(P)]
    for phase in ("reduce-scatter", "allgather"):
        for k in range(P - 1):
            out = [(s - k) % P if phase == "reduce-scatter" else (s + 1 - k) % P
                   for s in range(P)]
            for s in range(P):
                sends[s].append((phase, k + 1, out[s], sorted(held[s][out[s]])))
            for s in range(P):  # rank s receives its left neighbour's chunk
                j = out[(s - 1) % P]
                left = held[(s - 1) % P][j]
                held[s][j] = held[s][j] | left if phase == "reduce-scatter" else set(left)
    return bounds, sends


def first_wrong_send(calls, bounds, sends):
    """The first send of this rank that is not the ring's, as a sentence, or None."""
    for (_, dest, source, sent), (phase, k, j, ranks) in zip(calls, sends[r]):
        if (dest, source) != ((r + 1) % P, (r - 1) % P):
            return (f"rank {r}, {phase} step {k}: Sendrecv to rank {dest} from rank {source}; "
                    f"the ring sends to the right neighbour ({(r + 1) % P}) and receives from "
                    f"the left ({(r - 1) % P})")
        lo, hi = bounds[j], bounds[j + 1]
        if sent.size == hi - lo and ranks_in(sent, lo) == ranks:
            continue
        if sent.size == hi - lo:  # the right chunk, some elements wrong: the first of them
            want = sum(2.0 ** s for s in ranks) * INDEX[lo:hi]
            e = int(np.flatnonzero(sent != want)[0])
            held = ranks_in(sent[e:e + 1], lo + e)
            return (f"rank {r}, {phase} step {k}: sent chunk {j}, but its element {lo + e} "
                    f"holds {named(held) if held is not None else repr(sent[e])}; the ring's "
                    f"holds {named(ranks)}")
        what = next((f"chunk {i} holding {named(ranks_in(sent, bounds[i]))}" for i in range(P)
                     if sent.size == bounds[i + 1] - bounds[i] and ranks_in(sent, bounds[i])
                     is not None), f"{sent.size} values that are no chunk of the buffer")
        return (f"rank {r}, {phase} step {k}: sent {what}; the ring sends chunk {j} holding "
                f"{named(ranks)}")
    return None


def diagnose(results, calls, wrong_sends):
    total = (2 ** P - 1) * INDEX
    if all(np.array_equal(res, 2.0 ** s * INDEX) for s, res in enumerate(results)):
        return "the buffer never changed: write the sum into buf in place (its chunks are views)"
    if all(np.allclose(res, total / P) for res in results):
        return f"your result is 1/P of the sum (the mean over {P} ranks): the ring sums"
    other = sorted({name for rank_calls in calls for name, *_ in rank_calls} - {"Sendrecv"})
    if other:
        return f"ring_allreduce called {', '.join(other)}: write the ring from Sendrecv alone"
    counts = [len(c) for c in calls]
    if counts != [2 * (P - 1)] * P:
        return (f"Sendrecv calls per rank {counts}: the ring makes 2(P-1) = {2 * (P - 1)}, "
                f"P-1 to reduce-scatter and P-1 to allgather")
    chunk_of = np.concatenate([[j] * c.size for j, c in enumerate(np.array_split(INDEX, P))])
    for s, res in enumerate(results):
        wrong = np.flatnonzero(res != total)
        if wrong.size:
            e = wrong[0]
            held = ranks_in(res[e:e + 1], e)
            why = named(held) if held is not None else f"{res[e]!r}, no sum of ranks"
            step = next((w for w in wrong_sends if w), "")
            return (f"rank {s}, chunk {chunk_of[e]}, element {e} holds {why}, not the sum of "
                    f"all {P}" + (f"; first wrong send: {step}" if step else ""))
    if any(not np.array_equal(res, results[0]) for res in results):
        return "the ranks disagree"
    return None


buf = 2.0 ** r * INDEX
recording = Recording(world)
DP.ring_allreduce(recording, buf)
bounds, sends = reference_sends()
sendrecvs = [c for c in recording.calls if c[0] == "Sendrecv"]
mine = (buf, [c[0] for c in recording.calls], first_wrong_send(sendrecvs, bounds, sends))
gathered = MPI.COMM_WORLD.gather(mine, root=0)  # the checker's own message, not the exercise's
if r == 0:
    results, names, wrong = zip(*gathered)
    problem = diagnose(list(results), [[(n,) for n in ns] for ns in names], list(wrong))
    print(f"ring check: {problem or 'passed'} (on {P} ranks, {N} values)", flush=True)
    sys.exit(1 if problem else 0)
