"""Parameters: a tensor to learn, its gradient, and its initial value from (seed, name) only.

Each parameter is named by where it sits in the model (``blocks.3.attn.qkv.W``) and initialised
from the global seed and that name alone (:func:`param_rng`), so any piece of the model built
on any rank (a pipeline stage, a tensor-parallel shard) starts with exactly the serial model's
weights. The layers that hold parameters are in :mod:`mpipar.engine.nn`.

Each parameter also says how it lies over the process groups (:class:`Placement`: the groups
that split the model and those that replicate it) and which part of the serial model it is
(:meth:`Parameter.pieces`); the schemes declare them, and clipping, checkpoints and the memory
ledger read them.

A gradient is filled with zeros by :meth:`Parameter.zero_grad` and every backward adds into
it (``W.grad += x^T dout``), so the contributions of several micro-batches add up. It may be a
view into a larger buffer (a bucket that MPI sends as a whole): the additions are in place.
"""

import hashlib
import math
from collections import namedtuple

import numpy as np

from mpipar.engine import backend as B


def param_rng(seed, name):
    """A NumPy generator that depends on the global seed and the parameter's name only."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class Parameter:
    """A tensor to learn: ``data``, its gradient ``grad``, and how to initialise it."""

    def __init__(self, *shape, init="normal", std=0.02):
        self.shape = tuple(shape)
        self.init = init  # "normal" (mean 0, std), "zeros" or "ones"
        self.std = std
        self.name = None  # set by Module.init to the canonical name
        self.data = None
        self.grad = None  # backward adds into it; a step starts from zero_grad
        self.placement = Placement()  # a whole tensor on one rank, until a scheme says otherwise

    def init_value(self, seed, name):
        """The full initial value, as float64 on the host (shards slice it)."""
        if self.init in ("zeros", "ones"):
            return getattr(np, self.init)(self.shape)  # np.zeros or np.ones, float64
        return param_rng(seed, name).normal(0.0, self.std, size=self.shape)

    def set(self, host_value):
        """Take a copy of ``host_value`` as the data (asarray would alias a C-contiguous array
        of the right dtype, and the caller's later in-place changes would reach the model)."""
        self.data = B.xp.array(host_value, dtype=B.dtype, order="C")  # array() always copies
        self.grad = B.xp.zeros_like(self.data)

    def zero_grad(self):
        if self.grad is not None:
            self.grad[...] = 0

    def pieces(self):
        """Which parts of the serial model's tensors this array holds (:data:`Piece`)."""
        return [Piece(self.name, list(self.shape), ["all"], None)]

    @property
    def size(self):
        return int(math.prod(self.shape))  # (np.prod of a tuple costs microseconds a call)

    def __repr__(self):
        return f"Parameter({self.name}, shape={self.shape})"


# ----------------------------------------------------------------------------- placement
class Placement:
    """How a parameter lies over the process groups (torchtitan's DTensor idea, in miniature).

    ``split``: the groups whose ranks hold other parts of the model than this rank (a
    tensor-parallel shard's tp group, a pipeline stage's pp group, a ZeRO shard's dp group);
    ``replicated``: the groups whose ranks hold this same array, with the same gradient at the
    update (the data-parallel replicas, a LayerNorm on every tensor-parallel rank). A group is
    anything with ``rank``, ``size`` and ``name``. What the piece is of the serial model's
    tensors is the parameter's own :meth:`Parameter.pieces`.

    The runner reads placements and never asks which trainer it runs in: clipping counts each
    entry of the serial model once, checkpoints let one rank of each replica group write, the
    memory ledger and recomputation read the trainer's arrays and modules.
    """

    def __init__(self, split=(), replicated=()):
        self.split, self.replicated = tuple(split), tuple(replicated)

    def first_of_replicas(self, groups=None):
        """Whether this rank is rank 0 of every group (of ``groups``, if given) the parameter is
        replicated over: the one copy that is counted or written."""
        return all(g.rank == 0 for g in self.replicated if groups is None or g in groups)

    def __repr__(self):
        names = lambda gs: ",".join(g.name for g in gs)  # noqa: E731
        return f"Placement(split={names(self.split)}, replicated={names(self.replicated)})"


# name: the serial model's tensor; shape: its full shape; select: ["all"], ["axis", axis,
# [[a, b], ...]] or ["flat", a, b] (entries a..b of the flattened tensor); run: None (the whole
# array holds the piece) or (lo, hi), the run of this array's flattened entries that does.
Piece = namedtuple("Piece", "name shape select run")


def _at(axis, sl):
    return (slice(None),) * axis + (sl,)


def take(full, select):
    """The part ``select`` (a :data:`Piece`'s) of a full array, as a new contiguous array (on
    the host if ``full`` is)."""
    if select[0] == "all":
        return full.copy()
    if select[0] == "flat":
        return full.reshape(-1)[select[1]:select[2]].copy()
    axis, ranges = select[1], select[2]
    parts = [full[_at(axis, slice(a, b))] for a, b in ranges]
    xp = np if isinstance(full, np.ndarray) else B.xp
    return parts[0].copy() if len(parts) == 1 else xp.concatenate(parts, axis=axis)


def put(full, select, part):
    """The inverse of :func:`take`: write ``part`` into ``full`` at ``select``."""
    if select[0] == "all":
        full[...] = part
    elif select[0] == "flat":
        full.reshape(-1)[select[1]:select[2]] = part.reshape(-1)
    else:
        axis, start = select[1], 0
        for a, b in select[2]:
            full[_at(axis, slice(a, b))] = part[_at(axis, slice(start, start + b - a))]
            start += b - a


def place(params, split=(), replicated=()):
    """Give every parameter of ``params`` one placement; returns them."""
    for p in params:
        p.placement = Placement(split, replicated)
    return params


class FlatBlock(Parameter):
    """Block ``[lo, lo + size)`` of several parameters laid end to end, flattened (ZeRO's
    shard): its pieces are the runs of each parameter that fall inside the block."""

    def __init__(self, covers, lo, size):
        super().__init__(size)
        self.covers, self.lo = [(p.name, tuple(p.shape), p.size) for p in covers], lo

    def pieces(self):
        out, start = [], 0
        for name, shape, n in self.covers:
            a, b = max(self.lo, start) - start, min(self.lo + self.size, start + n) - start
            if a < b:  # this tensor's entries a..b are in the block
                out.append(Piece(name, list(shape), ["flat", a, b],
                                 (start + a - self.lo, start + b - self.lo)))
            start += n
        return out
