"""Parameters: a tensor to learn, its gradient, and its initial value from (seed, name) only.

Each parameter is named by where it sits in the model (``blocks.3.attn.qkv.W``) and initialised
from the global seed and that name alone (:func:`param_rng`), so any piece of the model built
on any rank (a pipeline stage, a tensor-parallel shard) starts with exactly the serial model's
weights. The layers that hold parameters are in :mod:`mpipar.nn`.
"""

import hashlib
import math

import numpy as np

from mpipar import backend as B


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
        self.grad = None

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

    @property
    def size(self):
        return int(math.prod(self.shape))  # (np.prod of a tuple costs microseconds a call)

    def __repr__(self):
        return f"Parameter({self.name}, shape={self.shape})"
