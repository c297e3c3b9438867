"""Optimizers: SGD with momentum, and Adam / AdamW.

Each update is elementwise, so updating a shard of a parameter gives exactly the slice of the
full update: the data-parallel ZeRO mode and the tensor-parallel shards rely on this.
State is kept per parameter, keyed by the Parameter object (``state_bytes`` reports its size,
which ZeRO divides by the number of ranks).

Mixed precision (Micikevicius et al. 2018, arXiv:1710.03740, Sec. 3.1): a parameter stored in
a 16-bit type gets a float32 master copy, the last array of its state. The update reads the
16-bit gradient as float32, multiplied by ``unscale`` (1 / the loss scale), updates the master
and the float32 state, and rounds the master into the parameter: an update smaller than half
a bf16 unit of the weight would be lost if it were added to the weight itself, but adds up in
the master.
"""

import numpy as np

from mpipar.engine import backend as B


def low(p):
    """Whether ``p`` is stored in a 16-bit type (and so updated through a master copy)."""
    return p.data.dtype.itemsize == 2


class Optimizer:
    state_kinds = ()  # what each array of a parameter's state is (a checkpoint's names)

    def __init__(self, params, lr):
        self.params = list(params)
        self.lr = lr
        self.state = {}  # Parameter -> tuple of arrays shaped like the parameter
        self.unscale = 1.0  # gradients times this before the update: 1 / the loss scale
        if any(low(p) for p in self.params):  # the master copies: a checkpoint keeps them
            self.state_kinds = (*type(self).state_kinds, "master")

    def step(self):
        for p in self.params:
            if p not in self.state:
                self.state[p] = self.fresh_state(p)
            if low(p):  # through the float32 master copy, rounded back into the parameter
                *state, master = self.state[p]
                self.update(master, p.grad.astype(np.float32) * self.unscale, *state)
                p.data[...] = master
            else:
                self.update(p.data, p.grad if self.unscale == 1.0 else p.grad * self.unscale,
                            *self.state[p])

    def fresh_state(self, p):
        """The state before the first update: :meth:`new_state`, and the master copy of a
        16-bit parameter."""
        return self.new_state(p) + ((p.data.astype(np.float32),) if low(p) else ())

    def zeros(self, p):
        """A state array for ``p``: its shape, in float32 for a 16-bit parameter."""
        return B.xp.zeros(p.data.shape, dtype=np.float32) if low(p) else B.xp.zeros_like(p.data)

    def new_state(self, p):
        """The optimizer's per-parameter arrays (zeros, shaped like the parameter)."""
        return ()

    def update(self, w, g, *state):
        """Update the weights ``w`` in place from their gradient ``g`` and the state."""
        raise NotImplementedError

    def zero_grad(self):
        for p in self.params:
            p.zero_grad()

    def state_bytes(self):
        return sum(a.nbytes for arrays in self.state.values() for a in arrays)


class SGD(Optimizer):
    """v = momentum * v + g;  w -= lr * v  (plain SGD when momentum is 0)."""

    state_kinds = ("momentum",)

    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum = momentum
        self.weight_decay = weight_decay

    def new_state(self, p):
        return (self.zeros(p),) if self.momentum else ()

    def update(self, w, g, *state):
        if self.weight_decay:
            g = g + self.weight_decay * w
        if self.momentum:
            (v,) = state
            v *= self.momentum
            v += g
            g = v
        w -= self.lr * g


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) with bias correction; ``decoupled=True`` gives AdamW
    (Loshchilov & Hutter 2019), where weight decay shrinks the weights directly."""

    state_kinds = ("adam_m", "adam_v")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=False):
        super().__init__(params, lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decoupled = decoupled
        self.t = 0

    def step(self):
        self.t += 1
        super().step()

    def new_state(self, p):
        return self.zeros(p), self.zeros(p)

    def update(self, w, g, m, v):
        if self.weight_decay and not self.decoupled:
            g = g + self.weight_decay * w
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * g * g
        m_hat = m / (1 - self.b1**self.t)
        v_hat = v / (1 - self.b2**self.t)
        if self.weight_decay and self.decoupled:
            w -= self.lr * self.weight_decay * w
        w -= self.lr * m_hat / (B.xp.sqrt(v_hat) + self.eps)


DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adam": 0.0, "adamw": 0.01}  # when the caller gives None


def make(name, params, lr, weight_decay=None):
    """Build an optimizer by its command-line name: sgd (momentum 0.9), adam or adamw.

    ``weight_decay=None`` takes the optimizer's default (AdamW 0.01, the others 0); any number,
    0.0 included, is used as given."""
    if name not in DEFAULT_WEIGHT_DECAY:
        raise ValueError(f"unknown optimizer {name!r}: choose sgd, adam or adamw")
    if weight_decay is None:
        weight_decay = DEFAULT_WEIGHT_DECAY[name]
    if name == "sgd":
        return SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    return Adam(params, lr=lr, weight_decay=weight_decay, decoupled=name == "adamw")
