"""Optimizers: SGD with momentum, and Adam / AdamW.

Each update is elementwise, so updating a shard of a parameter gives exactly the slice of the
full update: the data-parallel ZeRO mode and the tensor-parallel shards rely on this.
State is kept per parameter, keyed by the Parameter object (``state_bytes`` reports its size,
which ZeRO divides by the number of ranks).
"""

from mpipar import backend as B


class Optimizer:
    def __init__(self, params, lr):
        self.params = list(params)
        self.lr = lr
        self.state = {}  # Parameter -> tuple of arrays

    def step(self):
        for p in self.params:
            self.update(p)

    def update(self, p):
        raise NotImplementedError

    def zero_grad(self):
        for p in self.params:
            p.grad[...] = 0

    def state_bytes(self):
        return sum(a.nbytes for arrays in self.state.values() for a in arrays)


class SGD(Optimizer):
    """v = momentum * v + g;  w -= lr * v  (plain SGD when momentum is 0)."""

    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum = momentum
        self.weight_decay = weight_decay

    def update(self, p):
        g = p.grad
        if self.weight_decay:
            g = g + self.weight_decay * p.data
        if self.momentum:
            if p not in self.state:
                self.state[p] = (B.xp.zeros_like(p.data),)
            (v,) = self.state[p]
            v *= self.momentum
            v += g
            g = v
        p.data -= self.lr * g


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) with bias correction; ``decoupled=True`` gives AdamW
    (Loshchilov & Hutter 2019), where weight decay shrinks the weights directly."""

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

    def update(self, p):
        g = p.grad
        if self.weight_decay and not self.decoupled:
            g = g + self.weight_decay * p.data
        if p not in self.state:
            self.state[p] = (B.xp.zeros_like(p.data), B.xp.zeros_like(p.data))
        m, v = self.state[p]
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * g * g
        m_hat = m / (1 - self.b1**self.t)
        v_hat = v / (1 - self.b2**self.t)
        if self.weight_decay and self.decoupled:
            p.data -= self.lr * self.weight_decay * p.data
        p.data -= self.lr * m_hat / (B.xp.sqrt(v_hat) + self.eps)


def make(name, params, lr, weight_decay=0.0):
    """Build an optimizer by its command-line name: sgd (momentum 0.9), adam or adamw."""
    if name == "sgd":
        return SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adam":
        return Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return Adam(params, lr=lr, weight_decay=weight_decay or 0.01, decoupled=True)
    raise ValueError(f"unknown optimizer {name!r}: choose sgd, adam or adamw")
