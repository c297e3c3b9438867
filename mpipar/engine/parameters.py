"""Parameters: a tensor to learn, its gradient, and its initial value from (seed, name) only.

Each parameter is named by where it sits in the model (``blocks.3.attn.qkv.W``) and initialised
from the global seed and that name alone (:func:`param_rng`), so any piece of the model built
on any rank (a pipeline stage, a tensor-parallel shard) starts with exactly the serial model's
weights. The layers that hold parameters are in :mod:`mpipar.engine.nn`.

A gradient knows when it is zero. :meth:`Parameter.zero_grad` marks it so, and the first
contribution of the next backward is then written straight into it (``grad_add_matmul``,
``grad_add_sum``) instead of being made in a temporary and added: 0 + v == v, so the numbers
are the same, with one pass over the gradient fewer. Later contributions (more
micro-batches) add as before. A gradient that owns its memory is not even filled with zeros
until something reads ``grad``; one that is a view into a larger buffer (a bucket that MPI
sends as a whole) is filled at once, since the buffer may be read without asking the parameter.
"""

import hashlib
import math

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
        self._grad = None
        self._is_zero = False  # grad holds zeros (or will, see _fill_pending)
        self._fill_pending = False  # zero_grad deferred the fill to the first read

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

    # -- the gradient: read it as ``grad``; backward adds to it with the grad_add_* methods
    @property
    def grad(self):
        if self._fill_pending:
            self._grad[...] = 0
        self._is_zero = self._fill_pending = False  # the reader may write into it
        return self._grad

    @grad.setter
    def grad(self, value):  # a new array (a bucket's view, or None): nothing known about it
        self._grad, self._is_zero, self._fill_pending = value, False, False

    def zero_grad(self):
        if self._grad is None:
            return
        self._is_zero = True
        self._fill_pending = self._grad.base is None  # a view: its buffer is read directly
        if not self._fill_pending:
            self._grad[...] = 0

    def grad_add_matmul(self, a, b):
        """grad += a @ b; into a zero gradient, a @ b is written in place."""
        if self._is_zero:
            B.xp.matmul(a, b, out=self._grad)
            self._is_zero = self._fill_pending = False
        else:
            self.grad += a @ b

    def grad_add_sum(self, rows):
        """grad += rows.sum(axis=0); into a zero gradient, the sum is written in place
        (``initial=0``: the same 0 + ... as the addition, signed zeros included)."""
        if self._is_zero and B.xp is np:
            rows.sum(axis=0, out=self._grad, initial=0)
            self._is_zero = self._fill_pending = False
        else:
            self.grad += rows.sum(axis=0)

    @property
    def size(self):
        return int(math.prod(self.shape))  # (np.prod of a tuple costs microseconds a call)

    def __repr__(self):
        return f"Parameter({self.name}, shape={self.shape})"
