"""Small metadata between ranks: a few Python objects, pickled (MPI's lower-case calls).

Arrays never travel this way: :class:`mpipar.mpi.comm.Comm` sends them through the buffer API,
checked and counted. A batch's shapes, a step number, a count per stage or a report does, and
these calls, which every ``Comm`` has, carry it. They are blocking mpi4py calls that never pass
through :func:`mpipar.mpi.comm.wait`, so they run :func:`mpipar.mpi.failure.watched`: the
watchdog names them too. None is counted in ``Comm.stats``, which hold the traffic of the
scheme itself.
"""

from mpipar.mpi import explain
from mpipar.mpi.failure import watched


class PickledCalls:
    """The lower-case calls of a :class:`mpipar.mpi.comm.Comm` (which gives ``mpi``, ``name`` and
    ``say``)."""

    def bcast_obj(self, obj, root=0, what=""):
        return self._pickled("bcast", f"root {root} -> all", what, self.mpi.bcast, obj, root)

    def gather_obj(self, obj, root=0, what=""):
        return self._pickled("gather", f"all -> root {root}", what, self.mpi.gather, obj, root)

    def allgather_obj(self, obj, what=""):
        return self._pickled("allgather", "all <-> all", what, self.mpi.allgather, obj)

    def _pickled(self, op, detail, what, call, *args):
        """A blocking lower-case call, watched by the flight recorder like every wait."""
        detail += " (pickled)"
        self.say(f"{op:<14} {detail}{explain.about(what)}")
        with watched(op, detail, what, self.name):
            return call(*args)
