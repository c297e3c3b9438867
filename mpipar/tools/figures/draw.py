"""What every picture of :mod:`mpipar.tools.figures` shares: matplotlib set up headless, colours,
numbers rounded for hashing, and two stand-ins that let a picture run the real code without
MPI (threads for ranks; a communicator that records the colours of its Splits)."""

import queue
import threading
from types import SimpleNamespace

import numpy as np

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
PART_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#8172B3"}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path):
    fig.savefig(path, dpi=100, bbox_inches="tight")
    pyplot().close(fig)


def rounded(x):
    """Numbers as drawn, rounded so a last-bit difference between NumPy builds hashes the same."""
    return round(float(x), 6) + 0.0  # + 0.0: -0.0 (a masked product) hashes as 0.0


# ----------------------------------------------------------------------------- stand-in ranks
class ThreadRanks:
    """P threads standing in for P ranks, each running ``fn(comm)``. The comm offers the calls
    the pictured functions make, with MPI's meaning: the calls every rank makes together,
    Sendrecv, Allreduce, Alltoall, Scatter, Gather, Allgather and Reduce_scatter (equal blocks,
    SUM), in which every rank posts a copy of its buffer, waits for the others (a barrier),
    then reads what it is owed; and Send and Recv between two ranks. ``on_send(rank,
    sendbuf)``, when set, sees each Sendrecv before the exchange. Irecv then Isend, posted by
    every rank in that order (a ring's next block), exchange at the Isend; their requests'
    ``wait`` has nothing left to do.

    ``sends`` lists every Send as (round, source, dest), a round being the time of one message:
    a Send leaves in the round after the sender's previous Send or the round its last Recv's
    message left in, whichever is later, so a broadcast tree's rounds can be read off it."""

    def __init__(self, size, on_send=None):
        self.size, self.on_send, self.box, self.allreduces = size, on_send, {}, []
        self.receives = {r: [] for r in range(size)}  # each rank's posted Irecvs, in order
        self.barrier = threading.Barrier(size, timeout=30)
        # one queue per ordered pair, made up front: threads never race to create one
        self.mail = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.clock, self.sends = [0] * size, []

    def run(self, fn):
        results, errors = [None] * self.size, []

        def body(rank):
            try:
                results[rank] = fn(SimpleNamespace(rank=rank, size=self.size,
                                                   Sendrecv=self._sendrecv(rank),
                                                   Irecv=self._irecv(rank),
                                                   Isend=self._isend(rank),
                                                   Allreduce=self._allreduce(rank),
                                                   Alltoall=self._alltoall(rank),
                                                   Scatter=self._scatter(rank),
                                                   Gather=self._gather(rank),
                                                   Allgather=self._allgather(rank),
                                                   Reduce_scatter=self._reduce_scatter(rank),
                                                   Send=self._send(rank),
                                                   Recv=self._recv(rank)))
            except Exception as err:  # a broken barrier lets the other threads end too
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))
        return results

    def _exchange(self, rank, posted):
        self.barrier.wait()  # the previous call's reads are done: the box may be reused
        self.box[rank] = posted
        self.barrier.wait()
        return dict(self.box)

    def _sendrecv(self, rank):
        def Sendrecv(sendbuf, dest, recvbuf, source, tag=0, what=""):
            if self.on_send:
                self.on_send(rank, sendbuf)
            to, data = self._exchange(rank, (dest, sendbuf.copy()))[source]
            assert to == rank, f"rank {source} sent to {to}, but rank {rank} receives from it"
            recvbuf[...] = data
        return Sendrecv

    def _irecv(self, rank):
        def Irecv(buf, source, tag=0, what=""):
            self.receives[rank].append((buf, source))
            return SimpleNamespace(wait=lambda: None)
        return Irecv

    def _isend(self, rank):
        def Isend(buf, dest, tag=0, what=""):
            posted = self._exchange(rank, (dest, buf.copy()))
            recvbuf, source = self.receives[rank].pop(0)
            to, data = posted[source]
            assert to == rank, f"rank {source} sent to {to}, but rank {rank} receives from it"
            recvbuf[...] = data
            return SimpleNamespace(wait=lambda: None)
        return Isend

    def _alltoall(self, rank):
        def Alltoall(sendbuf, recvbuf, what=""):
            parts = self._exchange(rank, np.array_split(sendbuf.copy(), self.size))
            recvbuf[...] = np.concatenate([parts[s][rank] for s in range(self.size)])
        return Alltoall

    def _scatter(self, rank):
        def Scatter(sendbuf, recvbuf, root=0, what=""):  # sendbuf is read on root only
            parts = self._exchange(rank, np.array_split(sendbuf.copy(), self.size)
                                   if rank == root else None)
            recvbuf[...] = parts[root][rank]
        return Scatter

    def _gather(self, rank):
        def Gather(sendbuf, recvbuf, root=0, what=""):  # recvbuf is written on root only
            parts = self._exchange(rank, sendbuf.copy())
            if rank == root:
                recvbuf[...] = np.concatenate([parts[s] for s in range(self.size)])
        return Gather

    def _allgather(self, rank):
        def Allgather(sendbuf, recvbuf, what=""):
            parts = self._exchange(rank, sendbuf.copy())
            recvbuf[...] = np.concatenate([parts[s] for s in range(self.size)])
        return Allgather

    def _reduce_scatter(self, rank):
        def Reduce_scatter(sendbuf, recvbuf, what=""):  # MPI's Reduce_scatter_block, SUM
            parts = self._exchange(rank, sendbuf.copy())
            total = np.add.reduce([parts[s] for s in range(self.size)])
            recvbuf[...] = np.split(total, self.size)[rank]  # equal blocks, or it raises
        return Reduce_scatter

    def _send(self, rank):
        def Send(buf, dest, tag=0, what=""):  # buffered: returns at once, like an eager send
            self.clock[rank] += 1
            self.sends.append((self.clock[rank], rank, dest))
            self.mail[rank, dest].put((self.clock[rank], buf.copy()))
        return Send

    def _recv(self, rank):
        def Recv(buf, source, tag=0, what=""):
            try:
                sent_in, data = self.mail[source, rank].get(timeout=30)
            except queue.Empty:
                raise RuntimeError(f"rank {rank} waited for rank {source}: no message") from None
            self.clock[rank] = max(self.clock[rank], sent_in)
            buf[...] = data
        return Recv

    def _allreduce(self, rank):
        from mpi4py import MPI

        def Allreduce(buf, op=MPI.SUM, what=""):
            parts = self._exchange(rank, buf.copy())
            ordered = [parts[r] for r in range(self.size)]
            assert op in (MPI.SUM, MPI.MAX), "the stand-in reduces with SUM or MAX only"
            name = "MAX" if op == MPI.MAX else "SUM"
            buf[...] = (np.maximum if name == "MAX" else np.add).reduce(ordered)
            if rank == 0:
                self.allreduces.append(dict(op=name, what=what, result=buf.tolist(),
                                            parts=[p.tolist() for p in ordered]))
        return Allreduce


class SplitRecorder:
    """A stand-in for an mpi4py communicator of ``size`` ranks, seen from ``rank``: records
    the colour of every Split, so the groups Grid forms can be read without MPI."""

    def __init__(self, rank, size):
        self.rank, self.size, self.colors = rank, size, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Split(self, color, key):
        self.colors.append(color)
        return SplitRecorder(key, self.size)
