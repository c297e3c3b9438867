"""The only module that hands arrays to MPI.

Run any scheme under ``mpirun -n 4 python -m mpipar.<scheme>``; this module gives it a
:class:`Comm` that wraps an mpi4py communicator and, on every call:

1. uses the buffer (upper-case) API: arrays are never pickled;
2. checks the array first: C-contiguous (a transposed view is accepted by MPI and arrives in
   the wrong order, so it is refused here), and of the expected shape and dtype;
3. counts calls and logical payload bytes per operation (``stats``), see :class:`Comm`;
4. records a timestamped span in :data:`mpipar.mpi.trace.TRACE` and, with ``--explain``, prints
   a line naming the call, the partner ranks, the bytes and the time (:mod:`mpipar.mpi.explain`);
5. waits without burning a core when ranks outnumber cores: a blocking call is posted as its
   non-blocking twin and completed by :func:`wait`, whose strategies :mod:`mpipar.mpi.waiting`
   holds, with their measurements.

It also keeps this rank's flight recorder (:data:`mpipar.mpi.failure.FLIGHT`: the last calls, and
the one it waits in now) for the watchdog, and re-exports the ways a job ends from
:mod:`mpipar.mpi.failure`: ``install_excepthook`` (one rank's exception ends the whole job),
``start_watchdog`` (so does a rank that waits too long) and ``refuse`` (bad input: exit code 2).
``MPIPAR_SSEND=1`` maps every send to a synchronous send, so that an ordering that only works
while MPI buffers small messages deadlocks at once in the tests; ``MPIPAR_WAIT`` names the way
a rank waits: ``spin`` (MPI's own Wait), ``backoff``, ``yield`` or ``sleep`` (see
:mod:`mpipar.mpi.waiting`). Any other value of either is refused.

Every call of :class:`Comm` is the reference path: checked, counted, posted and completed by
:func:`wait`. One speed-up lives apart, in :mod:`mpipar.mpi.direct`, for a rank with its own
core: its blocking Send, Recv and Allreduce go straight to MPI's blocking calls. What the
wrapper costs beside bare mpi4py is measured by ``python -m mpipar.tools.bench overhead``; the
report holds its run.
"""

from collections import defaultdict
from contextlib import contextmanager
from functools import lru_cache
from itertools import accumulate

import numpy as np
from mpi4py import MPI

from mpipar.engine import backend as B
from mpipar.mpi import explain, waiting
from mpipar.mpi.checks import check_array, check_count, check_rows, truncated
from mpipar.mpi.failure import FLIGHT, install_excepthook, refuse, start_watchdog  # noqa: F401
from mpipar.mpi.failure import env_choice as _env
from mpipar.mpi.metadata import PickledCalls
from mpipar.mpi.trace import TRACE

EXPLAIN = False  # set by a scheme's --explain: narrate every call on every rank
_now, BYTE = MPI.Wtime, MPI.BYTE
SSEND = _env("MPIPAR_SSEND", ("0", "1")) == "1"


# ----------------------------------------------------------------------------- waiting
GIVEN_WAIT = _env("MPIPAR_WAIT", tuple(waiting.STRATEGIES))  # None: choose_wait picks
WAIT = GIVEN_WAIT  # how a rank waits (mpipar.mpi.waiting); None until chosen: MPI's own Wait


def choose_wait(long_waits=False):
    """Set :data:`WAIT`: ``MPIPAR_WAIT`` if it names a strategy, else :func:`waiting.default` for
    this job: do its ranks outnumber the cores of their machine, and are its waits long (a
    pipeline stage waits for a micro-batch's compute). A collective over COMM_WORLD (it asks
    which ranks share the machine): the runner calls it on every rank before it builds the
    grid, and :class:`mpipar.mpi.grid.Grid` does where nothing has chosen yet."""
    global WAIT
    oversubscribed = B.on_this_machine()[1] > max(B.cores(), 1)
    WAIT = GIVEN_WAIT or waiting.default(oversubscribed, long_waits)
    return WAIT


def wait(request, status=None, call=("", "MPI request", "", "")):
    """Complete a request with the strategy ``WAIT`` names (:mod:`mpipar.mpi.waiting`): MPI's own
    Wait ("spin"), or polls with Test between which a rank yields or sleeps, so that a waiting
    rank leaves its core to a rank that computes when ranks outnumber cores.

    ``call`` (comm name, op, detail, what) is what the watchdog names if the wait never ends."""
    FLIGHT.waiting = (_now(), *call)
    try:
        waiting.STRATEGIES[WAIT or "spin"](request, status)
    finally:
        FLIGHT.waiting = None


# ----------------------------------------------------------------------------- checks
# "-> rank 3", formatted once per rank: an f-string per call costs a tenth of an 8-byte message
TO, FROM = lru_cache(None)("-> rank {}".format), lru_cache(None)("<- rank {}".format)


class Request:
    """A posted non-blocking call; ``wait()`` completes it (without spinning) and records it."""

    def __init__(self, comm, mpi_request, op, detail, nbytes, finish=None, what="", source=None,
                 posted=False):
        self.comm, self.mpi_request, self.what, self.source = comm, mpi_request, what, source
        self.op, self.detail, self.nbytes, self.finish = op, detail, nbytes, finish
        # --explain names a posted call's completion "Isend done", a blocking one "Send"
        self.shown = f"I{op.lower()} done" if posted else op
        self.t0, self.status = _now(), MPI.Status()
        # complete: MPI has finished the transfer; done: wait() has checked, copied back, recorded
        self.complete = self.done = False

    def test(self):
        """Let MPI advance the request (MPICH progresses only inside MPI calls); True once
        it has completed. ``wait()`` must still be called to finish and record it."""
        if not self.complete:
            try:
                self.complete = self.mpi_request.Test(self.status)
            except MPI.Exception as err:
                raise truncated(err, self.op, self.source, self.nbytes) from None
        return self.complete

    def wait(self):
        if not self.done:
            if not self.complete:
                try:
                    wait(self.mpi_request, self.status,
                         (self.comm.name, self.op, self.detail, self.what))
                except MPI.Exception as err:
                    raise truncated(err, self.op, self.source, self.nbytes) from None
                self.complete = True
            if self.finish is not None:
                self.finish(self.status)
            self.comm._record(self.op, self.detail, self.nbytes, self.t0, self.what, self.shown)
            self.done = True
        return self.status


# ----------------------------------------------------------------------------- the wrapper
class Comm(PickledCalls):
    """An mpi4py communicator with checked, counted, traced and non-spinning calls.

    ``stats[op]`` holds ``calls``, ``messages`` (point-to-point messages this rank sent),
    ``sent`` and ``recv``: the logical payload bytes this rank contributed to and got from the
    operation. For a collective these are the bytes of the data the call moves between this
    rank and the others, independent of MPI's internal algorithm: a root that broadcasts n
    bytes to p-1 ranks counts sent = (p-1) n; each receiver counts recv = n; an Allreduce of
    n bytes counts sent = recv = n on every rank.
    """

    def __init__(self, mpi_comm, name="world"):
        self.mpi, self.name = mpi_comm, name
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self._stats = defaultdict(lambda: defaultdict(int))

    # -- bookkeeping
    @property
    def stats(self):
        """``stats[op][key]`` (see the class)."""
        return self._stats

    def _count(self, op, sent=0, recv=0, messages=0, calls=1):
        for key, n in (("calls", calls), ("sent", sent), ("recv", recv), ("messages", messages)):
            self._stats[op][key] += int(n)

    def _record(self, op, detail, nbytes, t0, what="", shown=None):
        FLIGHT.recent.append((_now(), self.name, op, detail, what))
        if TRACE.calls or EXPLAIN:
            self._trace(op, detail, nbytes, t0, what, shown or op)

    def _trace(self, op, detail, nbytes, t0, what, shown=None):
        """A span per call (TRACE.calls) and the --explain line: both off in a plain run."""
        t1 = _now()
        if TRACE.calls:
            TRACE.events.append((t0, t1, "comm", op,
                                 {"comm": self.name, "detail": detail, "bytes": nbytes}))
        if EXPLAIN:
            explain.completed(self, shown or op, detail, nbytes, t1 - t0, what)

    def say(self, text):
        """With --explain: one line prefixed by the world rank and this group's rank."""
        if EXPLAIN:
            explain.call_line(self, text)

    def posted(self, op, detail, nbytes, what):
        """With --explain, name a non-blocking call when it is posted (it completes later,
        in ``wait``, which prints the time it took): overlap is then visible."""
        FLIGHT.recent.append((_now(), self.name, op + " posted", detail, what))
        if EXPLAIN:
            explain.posted(self, op, detail, nbytes, what)

    def reset_stats(self):
        self.stats.clear()  # (DirectComm: its counters first folded in, then cleared)

    def total(self, key, ops=None):
        return sum(s[key] for op, s in self.stats.items() if ops is None or op in ops)

    def _blocking(self, req, op, detail, nbytes, t0, what="", host=None, dev=None):
        """Complete a posted collective, copy its result back to the device (CuPy), record."""
        wait(req, None, (self.name, op, detail, what))
        B.copy_back(host, dev)
        self._record(op, detail, nbytes, t0, what)

    # -- point to point
    def Send(self, buf, dest, tag=0, what=""):
        """Send ``buf`` to ``dest``: posted (:meth:`Isend`) and completed by :func:`wait`."""
        self.Isend(buf, dest, tag, what, posted=False).wait()

    def Isend(self, buf, dest, tag=0, what="", posted=True):
        """Post a send (a synchronous one with MPIPAR_SSEND=1); ``.wait()`` completes it.
        ``what`` names the data for --explain (a layer, a bucket, a micro-batch)."""
        check_array(buf, what=f"Isend to {dest}")
        post = self.mpi.Issend if SSEND else self.mpi.Isend
        self._count("Send", sent=buf.nbytes, messages=1)
        detail = TO(dest)
        if posted:
            self.posted("Isend", detail, buf.nbytes, what)
        return Request(self, post(B.host(buf), dest=dest, tag=tag), "Send", detail, buf.nbytes,
                       what=what, posted=posted)

    def Recv(self, buf, source, tag=0, what=""):
        """Receive into ``buf`` (:meth:`Irecv`, completed by :func:`wait`); a message of any
        other size is an error."""
        return self.Irecv(buf, source, tag, what, posted=False).wait()

    def Irecv(self, buf, source, tag=0, what="", posted=True):
        """Receive into ``buf``; a message of any other size than ``buf`` is an error."""
        check_array(buf, what=f"Recv from {source}")
        host, dev = B.host_out(buf)

        def finish(status):
            check_count(status, buf, source)
            B.copy_back(host, dev)

        self._count("Recv", recv=buf.nbytes)
        detail = FROM(source)
        if posted:
            self.posted("Irecv", detail, buf.nbytes, what)
        req = self.mpi.Irecv(host, source=source, tag=tag)
        return Request(self, req, "Recv", detail, buf.nbytes, finish, what, source, posted)

    def Sendrecv(self, sendbuf, dest, recvbuf, source, tag=0, what=""):
        """Send to ``dest`` and receive from ``source`` at once: cannot deadlock in a ring. A
        message of any other size than ``recvbuf`` is an error, as in :meth:`Recv`."""
        check_array(sendbuf, what=f"Sendrecv to {dest}")
        check_array(recvbuf, what=f"Sendrecv from {source}")
        detail = f"-> {dest}, <- {source}"
        self._count("Sendrecv", sent=sendbuf.nbytes, recv=recvbuf.nbytes, messages=1)
        t0 = _now()
        host_in, dev = B.host_out(recvbuf)
        rreq = self.mpi.Irecv(host_in, source=source, tag=tag)
        sreq = (self.mpi.Issend if SSEND else self.mpi.Isend)(B.host(sendbuf), dest=dest, tag=tag)
        call, status = (self.name, "Sendrecv", detail, what), MPI.Status()
        wait(sreq, None, call)
        try:
            wait(rreq, status, call)
        except MPI.Exception as err:
            raise truncated(err, "Sendrecv", source, recvbuf.nbytes) from None
        check_count(status, recvbuf, source, "Sendrecv")  # a short message is an error
        B.copy_back(host_in, dev)
        self._record("Sendrecv", detail, sendbuf.nbytes, t0, what)

    # -- collectives
    def Barrier(self):
        self._count("Barrier")
        self._blocking(self.mpi.Ibarrier(), "Barrier", "all ranks", 0, _now())

    def Bcast(self, buf, root=0, what=""):
        """Every rank's ``buf`` becomes root's."""
        check_array(buf, what="Bcast")
        t0 = _now()
        host, dev = (B.host(buf), None) if self.rank == root else B.host_out(buf)
        n = buf.nbytes
        self._count("Bcast", sent=n * (self.size - 1) if self.rank == root else 0,
                    recv=0 if self.rank == root else n)
        self._blocking(self.mpi.Ibcast(host, root=root), "Bcast", f"root {root} -> all", n, t0,
                       what, host, dev)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0, what=""):
        """``recvbuf`` on root = op over every rank's ``sendbuf`` (recvbuf ignored elsewhere)."""
        check_array(sendbuf, what="Reduce")
        t0, is_root = _now(), self.rank == root
        if is_root:
            check_array(recvbuf, sendbuf.shape, sendbuf.dtype, what="Reduce result")
        host_out, dev = B.host_out(recvbuf) if is_root else (None, None)
        n = sendbuf.nbytes
        self._count("Reduce", sent=0 if is_root else n, recv=n * (self.size - 1) if is_root else 0)
        req = self.mpi.Ireduce(B.host(sendbuf), host_out, op=op, root=root)
        self._blocking(req, "Reduce", f"all -> root {root}", n, t0, what, host_out, dev)

    def Allreduce(self, buf, op=MPI.SUM, what=""):
        """In place: every rank's ``buf`` becomes op over all ranks' ``buf`` (:meth:`Iallreduce`,
        completed by :func:`wait`)."""
        self.Iallreduce(buf, op, what, posted=False).wait()

    def Iallreduce(self, buf, op=MPI.SUM, what="", posted=True):
        """Non-blocking in-place Allreduce; call ``.wait()`` on the result before reading buf."""
        check_array(buf, what="Allreduce")
        no_bf16_arithmetic(buf, op, "Allreduce", "mpipar.mpi.bf16.bf16_sum")
        host, dev = B.host_out(buf)
        if dev is not None:
            host[...] = B.host(buf)
        self._count("Allreduce", sent=buf.nbytes, recv=buf.nbytes)
        if posted:
            self.posted("Iallreduce", f"all <-> all ({self.size})", buf.nbytes, what)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, host, op=op)
        return Request(self, req, "Allreduce", f"all <-> all ({self.size})", buf.nbytes,
                       lambda status: B.copy_back(host, dev), what, posted=posted)

    def Allgather(self, sendbuf, recvbuf, what=""):
        """recvbuf (size * len(sendbuf) along axis 0) = every rank's sendbuf, in rank order."""
        check_array(sendbuf, what="Allgather")
        check_array(recvbuf, (self.size * sendbuf.shape[0],) + sendbuf.shape[1:], sendbuf.dtype,
                    what="Allgather result")
        t0 = _now()
        host_out, dev = B.host_out(recvbuf)
        self._count("Allgather", sent=sendbuf.nbytes, recv=recvbuf.nbytes - sendbuf.nbytes)
        req = self.mpi.Iallgather(B.host(sendbuf), host_out)
        self._blocking(req, "Allgather", f"all <-> all ({self.size})", recvbuf.nbytes, t0, what,
                       host_out, dev)

    def Reduce_scatter(self, sendbuf, recvbuf, op=MPI.SUM, what=""):
        """Sum sendbuf over ranks and give rank r block r (equal blocks along axis 0)."""
        check_array(sendbuf, what="Reduce_scatter")
        if sendbuf.shape[0] % self.size:
            raise ValueError(f"Reduce_scatter: {sendbuf.shape[0]} rows do not split into "
                             f"{self.size} equal blocks")
        check_array(recvbuf, (sendbuf.shape[0] // self.size,) + sendbuf.shape[1:],
                    sendbuf.dtype, what="Reduce_scatter result")
        no_bf16_arithmetic(sendbuf, op, "Reduce_scatter", "mpipar.mpi.bf16.reduce_scatter")
        t0 = _now()
        host_out, dev = B.host_out(recvbuf)
        self._count("Reduce_scatter", sent=sendbuf.nbytes, recv=recvbuf.nbytes)
        req = self.mpi.Ireduce_scatter_block(B.host(sendbuf), host_out, op=op)
        self._blocking(req, "Reduce_scatter", f"all <-> all ({self.size})", sendbuf.nbytes, t0,
                       what, host_out, dev)

    def Scatterv(self, sendbuf, counts, recvbuf, root=0, what=""):
        """Root splits sendbuf along axis 0 into ``counts[r]`` rows for rank r."""
        check_array(recvbuf, what="Scatterv result")
        row = int(np.prod(recvbuf.shape[1:]))
        check_rows("Scatterv", f"rank {self.rank}'s buffer", recvbuf, counts[self.rank])
        t0, is_root = _now(), self.rank == root
        elems = [c * row for c in counts]
        send = None
        if is_root:
            check_array(sendbuf, what="Scatterv")
            check_rows("Scatterv", f"root {root}'s array", sendbuf, sum(counts), recvbuf)
            send = [B.host(sendbuf), (elems, offsets(elems)), mpi_type(sendbuf)]
        host_out, dev = B.host_out(recvbuf)
        self._count("Scatterv", sent=(sendbuf.nbytes - recvbuf.nbytes) if is_root else 0,
                    recv=0 if is_root else recvbuf.nbytes)
        req = self.mpi.Iscatterv(send, host_out, root=root)
        self._blocking(req, "Scatterv", f"root {root} -> all, rows {list(counts)}",
                       recvbuf.nbytes, t0, what, host_out, dev)

    def Gatherv(self, sendbuf, counts, recvbuf, root=0, what=""):
        """Root collects ``counts[r]`` rows from rank r into recvbuf, in rank order."""
        check_array(sendbuf, what="Gatherv")
        check_rows("Gatherv", f"rank {self.rank}'s array", sendbuf, counts[self.rank])
        row = int(np.prod(sendbuf.shape[1:]))
        t0, is_root = _now(), self.rank == root
        elems = [c * row for c in counts]
        recv, host_out, dev = None, None, None
        if is_root:
            check_array(recvbuf, what="Gatherv result")
            check_rows("Gatherv", f"root {root}'s buffer", recvbuf, sum(counts), sendbuf)
            host_out, dev = B.host_out(recvbuf)
            recv = [host_out, (elems, offsets(elems)), mpi_type(recvbuf)]
        self._count("Gatherv", sent=0 if is_root else sendbuf.nbytes,
                    recv=(recvbuf.nbytes - sendbuf.nbytes) if is_root else 0)
        req = self.mpi.Igatherv(B.host(sendbuf), recv, root=root)
        self._blocking(req, "Gatherv", f"all -> root {root}", sendbuf.nbytes, t0, what,
                       host_out, dev)

    def Alltoall(self, sendbuf, recvbuf, what=""):
        """Block d of ``sendbuf`` (its axis 0 cut into ``size`` equal blocks) goes to rank d;
        block s of ``recvbuf`` comes from rank s. This rank's own block is copied, not sent."""
        check_array(sendbuf, what="Alltoall")
        if sendbuf.shape[0] % self.size:
            raise ValueError(f"Alltoall: {sendbuf.shape[0]} rows do not split into "
                             f"{self.size} equal blocks")
        check_array(recvbuf, sendbuf.shape, sendbuf.dtype, what="Alltoall result")
        t0, own = _now(), sendbuf.nbytes // self.size
        host_out, dev = B.host_out(recvbuf)
        self._count("Alltoall", sent=sendbuf.nbytes - own, recv=recvbuf.nbytes - own)
        req = self.mpi.Ialltoall(B.host(sendbuf), host_out)
        self._blocking(req, "Alltoall", f"all <-> all ({self.size})", sendbuf.nbytes - own, t0,
                       what, host_out, dev)

    def Alltoallv(self, sendbuf, send_rows, recvbuf, recv_rows, what=""):
        """Rows ``send_rows[d]`` of ``sendbuf`` (consecutive, in rank order) go to rank d; the
        ``recv_rows[s]`` rows from rank s land in ``recvbuf`` in rank order. Each side names
        its own counts: rank d's ``recv_rows[r]`` must be rank r's ``send_rows[d]`` (an
        Alltoall of the counts makes sure), or MPI truncates or leaves rows unwritten."""
        check_array(sendbuf, what="Alltoallv")
        check_array(recvbuf, what="Alltoallv result")
        check_rows("Alltoallv", f"rank {self.rank}'s array", sendbuf, sum(send_rows))
        check_rows("Alltoallv", f"rank {self.rank}'s buffer", recvbuf, sum(recv_rows), sendbuf)
        row = int(np.prod(sendbuf.shape[1:]))
        element = mpi_type(sendbuf)
        out_elems, in_elems = [c * row for c in send_rows], [c * row for c in recv_rows]
        t0, me = _now(), self.rank
        host_out, dev = B.host_out(recvbuf)
        per_row = row * sendbuf.dtype.itemsize
        sent = (sum(send_rows) - send_rows[me]) * per_row  # this rank's own rows are copied
        self._count("Alltoallv", sent=sent, recv=(sum(recv_rows) - recv_rows[me]) * per_row)
        req = self.mpi.Ialltoallv([B.host(sendbuf), (out_elems, offsets(out_elems)), element],
                                  [host_out, (in_elems, offsets(in_elems)), element])
        self._blocking(req, "Alltoallv", f"rows out {list(send_rows)}, in {list(recv_rows)}",
                       sent, t0, what, host_out, dev)


def narrate(text):
    """With --explain, print a line about the step being run, prefixed by the world rank."""
    if EXPLAIN:
        explain.step(text)


@contextmanager
def step(label, detail):
    """One of a scheme's steps that moves data, as one construct: narrated with --explain
    (``label: detail``) and traced as a "sync" span named ``label``, what the timeline draws
    and the benchmarks measure as exposed communication."""
    narrate(f"{label}: {detail}")
    with TRACE.span("sync", label):
        yield


def no_bf16_arithmetic(buf, op, call, instead):
    """Refuse a predefined reduction of bf16 data, which MPI would apply to the raw 2-byte
    words as integers; a user-defined operation (mpipar.mpi.bf16's) passes."""
    if B.words(buf) is not buf and op in (MPI.SUM, MPI.MAX, MPI.MIN, MPI.PROD):
        raise TypeError(f"{call}: MPI has no bf16 arithmetic (it would add the raw 2-byte "
                        f"words as integers): sum in float32, or with {instead}")


def mpi_type(a):
    """The MPI datatype of ``a``'s elements (bf16 as its 2-byte words: MPI has no bf16)."""
    return MPI._typedict[B.words(a).dtype.char]


def any_rank(group, flag, what="any rank?"):
    """Whether ``flag`` holds on any rank of ``group``: one Allreduce MAX of 0 or 1, so every
    rank gets the same answer. A collective: every rank calls it."""
    buf = np.array([float(bool(flag))])
    group.Allreduce(buf, op=MPI.MAX, what=what)
    return bool(buf[0])


def world():
    """The whole job as a :class:`Comm`."""
    return Comm(MPI.COMM_WORLD, "world")


def log(*args):
    """Print on world rank 0 only (every rank computes; one speaks), in one write: with an
    unbuffered stdout (PYTHONUNBUFFERED=1) ``print`` writes the text and its newline apart,
    and another rank's line forwarded by the launcher could land between them."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        explain.say(" ".join(map(str, args)))


def split_rows(n, p):
    """Rows per rank when n rows are split over p ranks as evenly as possible."""
    return [n // p + (1 if r < n % p else 0) for r in range(p)]


def offsets(counts):
    """Where each of consecutive pieces of these sizes starts: [0, c0, c0 + c1, ...]."""
    return list(accumulate(counts, initial=0))[:-1]


def flatten(arrays, out=None):
    """Copy arrays one after another into the contiguous 1-D buffer ``out`` (a new one if
    None): MPI refuses non-contiguous memory, and one large message beats many small ones."""
    if out is None:
        out = B.xp.empty(sum(a.size for a in arrays), dtype=arrays[0].dtype if arrays
                         else B.dtype)
    for a, start in zip(arrays, offsets([a.size for a in arrays])):
        out[start:start + a.size] = a.reshape(-1)
    return out


def unflatten(flat, arrays):
    """The inverse of :func:`flatten`: copy consecutive pieces of ``flat`` back into arrays."""
    for a, start in zip(arrays, offsets([a.size for a in arrays])):
        a[...] = flat[start:start + a.size].reshape(a.shape)
