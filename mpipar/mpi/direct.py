"""The one speed-up of the MPI layer, apart from the reference path (:mod:`mpipar.mpi.comm`):
:class:`DirectComm`, whose blocking Send, Recv and Allreduce call MPI's blocking twins
directly, for a rank that waits with MPI's own Wait (each rank with its own core). The process
grid builds its communicators with :func:`communicator`, which picks it there; every other
rank gets the reference :class:`mpipar.mpi.comm.Comm`.
"""

import numpy as np
from mpi4py import MPI

from mpipar.mpi import checks, comm
from mpipar.mpi.failure import FLIGHT
from mpipar.mpi.trace import TRACE

_now, BYTE = MPI.Wtime, MPI.BYTE


class DirectComm(comm.Comm):
    """:class:`mpipar.mpi.comm.Comm` whose blocking Send, Recv and Allreduce call MPI's blocking
    twins directly. :func:`communicator` gives it to a rank that waits with MPI's own Wait
    (``WAIT == "spin"``: each rank has its own core), where the posted path's request object,
    clock reads and string formatting are the per-call cost an 8-byte message shows
    (``python -m mpipar.tools.bench overhead`` measures the wrapper against raw mpi4py;
    ``bench net``'s alpha is a ping-pong through it). A direct Send or Recv formats no string
    (the flight recorder keeps the partner's rank, written out when it reports), reads no
    clock, and counts itself in plain counters that ``stats`` folds in when read. A traced or
    narrated call, a device array, a strided one and bf16 (moved as its 2-byte words) take the
    reference path."""

    def __init__(self, mpi_comm, name="world"):
        super().__init__(mpi_comm, name)
        self._sends = self._sent = self._recvs = self._received = 0
        self.status = MPI.Status()  # of the direct receives
        self._send = getattr(mpi_comm, "Ssend" if comm.SSEND else "Send", None)  # bound once (None:
        self._recv = getattr(mpi_comm, "Recv", None)  # a stand-in without them, figures)

    @property
    def stats(self):
        """``stats[op][key]``, with the direct calls' counters folded in."""
        if self._sends:
            self._count("Send", sent=self._sent, messages=self._sends, calls=self._sends)
        if self._recvs:
            self._count("Recv", recv=self._received, calls=self._recvs)
        self._sends = self._sent = self._recvs = self._received = 0
        return self._stats

    def Send(self, buf, dest, tag=0, what=""):
        """MPI's blocking Send, bracketed by the flight recorder, and two additions (the
        ``stats`` counters). A 1-D array is C-contiguous exactly when MPI takes it (a strided
        one raises BufferError, which check_array then explains), so only an array of 2 or more
        dimensions has its flags read."""
        if TRACE.calls or comm.EXPLAIN or type(buf) is not np.ndarray or buf.dtype.kind == "V" \
                or buf.ndim > 1 and not buf.flags.c_contiguous:
            return super().Send(buf, dest, tag, what)
        FLIGHT.waiting = call = (None, self.name, "Send", dest, what)  # the rank: "-> rank 3"
        try:  # when read (failure._call)
            self._send(buf, dest, tag)
        except BufferError:
            checks.check_array(buf, what=f"Send to {dest}")
            raise
        finally:
            FLIGHT.waiting = None
        FLIGHT.recent.append(call)
        self._sends += 1  # counted after the send (Recv: before)
        self._sent += buf.nbytes

    def Recv(self, buf, source, tag=0, what=""):
        """Receive into ``buf``; a message of any other size is an error. Written out as Send."""
        if TRACE.calls or comm.EXPLAIN or type(buf) is not np.ndarray or buf.dtype.kind == "V" \
                or buf.ndim > 1 and not buf.flags.c_contiguous:
            return super().Recv(buf, source, tag, what)
        n, status = buf.nbytes, self.status
        self._recvs += 1
        self._received += n
        FLIGHT.waiting = call = (None, self.name, "Recv", source, what)  # "<- rank 3" when read
        try:
            self._recv(buf, source, tag, status)
        except BufferError:
            self._recvs, self._received = self._recvs - 1, self._received - n  # not received
            checks.check_array(buf, what=f"Recv from {source}")
            raise
        except MPI.Exception as err:
            raise checks.truncated(err, "Recv", source, n) from None
        finally:
            FLIGHT.waiting = None
        if status.Get_count(BYTE) != n:
            checks.check_count(status, buf, source)  # raises, saying what came
        FLIGHT.recent.append(call)
        return status

    def Allreduce(self, buf, op=MPI.SUM, what=""):
        """Straight to MPI's blocking Allreduce for a C-contiguous host array (anything else
        takes the reference path, which refuses it or stages it)."""
        if type(buf) is not np.ndarray or buf.dtype.kind == "V" or not buf.flags.c_contiguous:
            return super().Allreduce(buf, op, what)
        self._count("Allreduce", sent=buf.nbytes, recv=buf.nbytes)
        detail, t0 = f"all <-> all ({self.size})", _now()
        FLIGHT.waiting = (t0, self.name, "Allreduce", detail, what)
        try:
            self.mpi.Allreduce(MPI.IN_PLACE, buf, op)
        finally:
            FLIGHT.waiting = None
        self._record("Allreduce", detail, buf.nbytes, t0, what)


def communicator(mpi_comm, name):
    """``mpi_comm`` as the reference :class:`mpipar.mpi.comm.Comm`, or as :class:`DirectComm`
    for a rank that waits with MPI's own Wait."""
    return (DirectComm if comm.WAIT == "spin" else comm.Comm)(mpi_comm, name)


def world():
    """The whole job, as :func:`communicator` makes it (once ``comm.choose_wait`` has run)."""
    return communicator(MPI.COMM_WORLD, "world")
