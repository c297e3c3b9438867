"""Layers with hand-written forward and backward passes.

Every layer keeps its forward and its backward side by side. ``forward(x, micro_id)`` caches
what the backward needs under the micro-batch id, because a pipeline stage holds several
micro-batches in flight; ``backward(dout, micro_id)`` pops that cache, accumulates the
parameter gradients with ``+=`` and returns the gradient of the input.

A layer with parameters writes its backward as two parts (:class:`SplitBackward`), which a
zero-bubble pipeline runs apart (Qi et al. 2024, arXiv:2401.10241, Sec. 2): ``backward_input``
(B) returns the input's gradient and keeps what the parameter gradients need under the
micro-batch id; ``backward_weight`` (W) accumulates them. ``backward`` is B then W at once:
the same arithmetic, so the same bits.

Parameters (:mod:`mpipar.engine.parameters`) are named by where they sit in the model
(``blocks.3.attn.qkv.W``) and each is initialised from the global seed and its own name only,
so any piece of the model built on any rank starts with exactly the serial model's weights.

What a layer costs (FLOPs) and the shape it returns are planning questions, answered from the
parameters' shapes in :mod:`mpipar.parts.plan`; the layers here only compute.

Shapes: B batch, T sequence length, C model width, H heads, D = C / H head width, V vocabulary.
"""

import math

import numpy as np

from mpipar.engine import backend as B
from mpipar.engine.parameters import Parameter


class Module:
    """Base class: named parameters, a per-micro-batch cache, forward and backward."""

    def __init__(self):
        self._cache = {}

    # -- the tree of modules and parameters, in definition order
    def named_parameters(self, prefix=""):
        for key, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + key, value
            elif isinstance(value, Module):
                yield from value.named_parameters(f"{prefix}{key}.")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def children(self):
        return [value for value in vars(self).values() if isinstance(value, Module)]

    def modules(self):
        yield self
        for child in self.children():
            yield from child.modules()

    def init(self, seed, prefix=""):
        """Give every parameter its canonical name and its seeded initial value."""
        for name, p in self.named_parameters(prefix):
            p.name = name
            p.set(p.init_value(seed, name))
        return self

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def clear_cache(self):
        for m in self.modules():
            m._cache.clear()

    def cached_bytes(self):
        """Bytes of activations held for backward, over all micro-batches in flight."""
        seen = {}  # by id: a layer's input is often the previous layer's cached output
        for m in self.modules():
            for saved in m._cache.values():
                seen.update((id(a), a.nbytes) for a in saved if hasattr(a, "nbytes"))
        return sum(seen.values())

    # -- the cache: forward saves, backward pops (so memory is freed as backward runs); in
    # mixed precision the float arrays are kept in the storage type (B.store) and come back as
    # float32 (B.load), unless the module keeps its own in full precision (``KEEP_FULL``)
    KEEP_FULL = False

    def save(self, micro_id, *arrays):
        self._cache[micro_id] = arrays if self.KEEP_FULL else tuple(B.store(a) for a in arrays)

    def saved(self, micro_id):
        arrays = self._cache.pop(micro_id)
        return arrays if self.KEEP_FULL else tuple(B.load(a) for a in arrays)

    def forward(self, x, micro_id=0):
        raise NotImplementedError

    def backward(self, dout, micro_id=0):
        raise NotImplementedError

    def backward_input(self, dout, micro_id=0):
        """B: a module that does not split its backward runs all of it here."""
        return self.backward(dout, micro_id)

    def backward_weight(self, micro_id=0):
        """W: nothing left to do (no parameters, or their gradients were made in B)."""


class SplitBackward(Module):
    """A module whose backward is B (``backward_input``) then W (``backward_weight``). A
    container's B runs its children's B in reverse order; its W is its children's W, in any
    order (each touches its own parameters only). A subclass changes B or W, not ``backward``:
    a container calls its children's B and W, never their backward (only an outermost module,
    such as the hybrid's whole stage, may hook ``backward``; a split schedule bypasses it)."""

    def backward(self, dout, micro_id=0):
        dx = self.backward_input(dout, micro_id)
        self.backward_weight(micro_id)
        return dx

    def backward_weight(self, micro_id=0):
        for child in self.children():
            child.backward_weight(micro_id)


def _rows(a):
    """View a (..., n) array as (rows, n) for a matrix product (a 2-D array as it is)."""
    return a if a.ndim == 2 else a.reshape(-1, a.shape[-1])


# ----------------------------------------------------------------------------- layers
class Linear(SplitBackward):
    """y = x W + b, with W of shape (d_in, d_out).

    ``input_grad=False`` skips dx for a layer fed straight from the data (it would be thrown
    away, and for a wide input it is a third of the layer's backward FLOPs)."""

    def __init__(self, d_in, d_out, bias=True, std=None, input_grad=True):
        super().__init__()
        self.input_grad = input_grad
        std = 1.0 / math.sqrt(d_in) if std is None else std
        self.W = Parameter(d_in, d_out, std=std)
        if bias:
            self.b = Parameter(d_out, init="zeros")
        self.has_bias = bias

    def forward(self, x, micro_id=0):
        self.save(micro_id, x)
        y = x @ self.W.data  # (..., d_out)
        if self.has_bias:
            y += self.b.data
        return y

    def backward_input(self, dout, micro_id=0):
        (x,) = self.saved(micro_id)
        self.save(micro_id, x, dout)  # what W needs
        return dout @ self.W.data.T if self.input_grad else None  # (..., d_in)

    def backward_weight(self, micro_id=0):
        x, dout = self.saved(micro_id)
        self.W.grad += _rows(x).T @ _rows(dout)  # (d_in, d_out)
        if self.has_bias:
            self.b.grad += _rows(dout).sum(axis=0)  # dout summed over the rows


class ReLU(Module):
    def forward(self, x, micro_id=0):
        mask = x > 0
        self.save(micro_id, mask)
        return x * mask

    def backward(self, dout, micro_id=0):
        return dout * self.saved(micro_id)[0]  # the mask


class GELU(Module):
    """GELU, tanh approximation: 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi)."""

    K = math.sqrt(2.0 / math.pi)

    def forward(self, x, micro_id=0):
        t = B.xp.tanh(self.K * (x + 0.044715 * (x * x * x)))  # x**3 calls pow(): 100x slower
        self.save(micro_id, x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, dout, micro_id=0):
        x, t = self.saved(micro_id)
        dt = self.K * (1.0 + 3 * 0.044715 * x**2)  # d(inner)/dx
        return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt)


class LayerNorm(SplitBackward):
    """Normalise the last axis to zero mean and unit variance, then scale (g) and shift (b)."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.g = Parameter(d, init="ones")
        self.b = Parameter(d, init="zeros")
        self.eps = eps

    def forward(self, x, micro_id=0):
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / B.xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
        xhat = xc * rstd
        self.save(micro_id, xhat, rstd)
        return xhat * self.g.data + self.b.data

    def backward_input(self, dout, micro_id=0):
        xhat, rstd = self.saved(micro_id)
        self.save(micro_id, xhat, dout)  # what W needs
        dxhat = dout * self.g.data
        # d/dx of (x - mean) * rstd: remove the mean of dxhat and its projection on xhat
        return rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                       - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))

    def backward_weight(self, micro_id=0):
        xhat, dout = self.saved(micro_id)
        self.g.grad += _rows(dout * xhat).sum(axis=0)
        self.b.grad += _rows(dout).sum(axis=0)


class Embedding(SplitBackward):
    """Rows of a table: token ids (B, T) -> vectors (B, T, C)."""

    def __init__(self, n, d, std=0.02):
        super().__init__()
        self.W = Parameter(n, d, std=std)

    def forward(self, idx, micro_id=0):
        self.save(micro_id, idx)
        return self.W.data[idx]  # (B, T, C)

    def backward_input(self, dout, micro_id=0):
        (idx,) = self.saved(micro_id)
        self.save(micro_id, idx, dout)  # what W needs
        return None  # token ids have no gradient

    def backward_weight(self, micro_id=0):
        idx, dout = self.saved(micro_id)
        B.xp.add.at(self.W.grad, idx.reshape(-1), _rows(dout))


class CausalSelfAttention(SplitBackward):
    """Multi-head self-attention where position t sees positions <= t.

    qkv: one Linear (C -> 3C) whose columns are [q | k | v], each split into H heads of D.
    ``n_local_heads`` is the number of heads this module computes: all H here, H/t on a
    tensor-parallel rank (which passes it), so the core never guesses it from a width.
    """

    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_local_heads = n_heads
        self.head_dim = d_model // n_heads  # D
        self.qkv = Linear(d_model, 3 * d_model, std=0.02)
        self.proj = Linear(d_model, d_model, std=0.02)

    def attend(self, qkv, micro_id):
        """The attention core on this module's H heads of D: (B, T, 3*H*D) -> (B, T, H*D)."""
        Bn, T, _ = qkv.shape
        H, D = self.n_local_heads, self.head_dim
        C = H * D  # the width of q (of k, of v): C, or C/t on a tensor-parallel rank
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(Bn, T, H, D).transpose(0, 2, 1, 3)
                   for i in range(3))  # each (B, H, T, D)
        scale = 1.0 / math.sqrt(D)
        s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, H, T, T)
        s = s + self._mask(T, s.dtype)
        s = s - s.max(axis=-1, keepdims=True)
        p = B.xp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)  # (B, H, T, T) attention weights
        y = p @ v  # (B, H, T, D)
        self.save(micro_id, q, k, v, p)
        return y.transpose(0, 2, 1, 3).reshape(Bn, T, C)  # (B, T, C)

    def attend_backward(self, dy, micro_id):
        q, k, v, p = self.saved(micro_id)
        Bn, H, T, D = q.shape
        dy = dy.reshape(Bn, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
        dp = dy @ v.transpose(0, 1, 3, 2)  # (B, H, T, T)
        dv = p.transpose(0, 1, 3, 2) @ dy  # (B, H, T, D)
        # softmax backward: ds = p * (dp - sum_j dp_j p_j); masked entries have p = 0
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
        ds *= 1.0 / math.sqrt(D)
        dq = ds @ k  # (B, H, T, D)
        dk = ds.transpose(0, 1, 3, 2) @ q  # (B, H, T, D)
        parts = [t.transpose(0, 2, 1, 3).reshape(Bn, T, H * D) for t in (dq, dk, dv)]
        return B.xp.concatenate(parts, axis=-1)  # (B, T, 3C)

    def _mask(self, T, dtype):
        m = np.triu(np.full((T, T), -np.inf), k=1)  # -inf above the diagonal: no peeking ahead
        return B.asarray(m, dtype=dtype)

    def forward(self, x, micro_id=0):
        y = self.attend(self.qkv.forward(x, micro_id), micro_id)
        return self.proj.forward(y, micro_id)

    def backward_input(self, dout, micro_id=0):
        dy = self.proj.backward_input(dout, micro_id)
        return self.qkv.backward_input(self.attend_backward(dy, micro_id), micro_id)


class FeedForward(SplitBackward):
    """The transformer's MLP: Linear(C, 4C), GELU, Linear(4C, C)."""

    def __init__(self, d_model, d_hidden=None):
        super().__init__()
        d_hidden = 4 * d_model if d_hidden is None else d_hidden
        self.fc = Linear(d_model, d_hidden, std=0.02)
        self.act = GELU()
        self.proj = Linear(d_hidden, d_model, std=0.02)

    def forward(self, x, micro_id=0):
        return self.proj.forward(self.act.forward(self.fc.forward(x, micro_id), micro_id), micro_id)

    def backward_input(self, dout, micro_id=0):
        d = self.act.backward_input(self.proj.backward_input(dout, micro_id), micro_id)
        return self.fc.backward_input(d, micro_id)


class Block(SplitBackward):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1 = LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = LayerNorm(d_model)
        self.mlp = FeedForward(d_model)

    def forward(self, x, micro_id=0):
        x = x + self.attn.forward(self.ln1.forward(x, micro_id), micro_id)
        return x + self.mlp.forward(self.ln2.forward(x, micro_id), micro_id)

    def backward_input(self, dout, micro_id=0):
        dx = dout + self.ln2.backward_input(self.mlp.backward_input(dout, micro_id), micro_id)
        return dx + self.ln1.backward_input(self.attn.backward_input(dx, micro_id), micro_id)


class GPTEmbedding(SplitBackward):
    """Token embedding plus learned position embedding: ids (B, T) -> (B, T, C)."""

    def __init__(self, vocab, d_model, seq_len):
        super().__init__()
        self.tok = Embedding(vocab, d_model)
        self.pos = Parameter(seq_len, d_model, std=0.02)

    def forward(self, idx, micro_id=0):
        T = idx.shape[1]
        if T > self.pos.shape[0]:  # else a broadcasting error about (T, C) and (seq_len, C)
            raise ValueError(f"input of {T} tokens is longer than the model's context "
                             f"seq_len={self.pos.shape[0]}")
        return self.tok.forward(idx, micro_id) + self.pos.data[:T]

    def backward_input(self, dout, micro_id=0):
        self.save(micro_id, dout)  # what W needs for the position table
        return self.tok.backward_input(dout, micro_id)

    def backward_weight(self, micro_id=0):
        (dout,) = self.saved(micro_id)
        self.pos.grad[:dout.shape[1]] += dout.sum(axis=0)  # (T, C)
        self.tok.backward_weight(micro_id)


class GPTHead(SplitBackward):
    """Final LayerNorm and the projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.ln = LayerNorm(d_model)
        self.out = Linear(d_model, vocab, std=0.02)

    def forward(self, x, micro_id=0):
        return self.out.forward(self.ln.forward(x, micro_id), micro_id)

    def backward_input(self, dout, micro_id=0):
        return self.ln.backward_input(self.out.backward_input(dout, micro_id), micro_id)


# ----------------------------------------------------------------------------- containers
class Sequential(SplitBackward):
    """Named layers run in order. ``layers`` is a list of (name, module) pairs, so a pipeline
    stage can take a slice of it and keep every parameter's canonical name."""

    def __init__(self, layers):
        super().__init__()
        self.layers = list(layers)

    def named_parameters(self, prefix=""):
        for name, layer in self.layers:
            yield from layer.named_parameters(f"{prefix}{name}.")

    def children(self):
        return [layer for _, layer in self.layers]

    # Between its layers a Sequential passes the storage type on (B.store: 16-bit in mixed
    # precision) and hands each layer float32 (B.load); in full precision both do nothing.
    def forward(self, x, micro_id=0):
        for _, layer in self.layers:
            x = B.store(layer.forward(B.load(x), micro_id))
        return x

    def backward_input(self, dout, micro_id=0):
        for _, layer in reversed(self.layers):
            dout = B.store(layer.backward_input(B.load(dout), micro_id))
        return dout

    def backward(self, dout, micro_id=0):  # layer by layer: each W frees what its B kept
        for _, layer in reversed(self.layers):
            dout = B.store(layer.backward(B.load(dout), micro_id))
        return dout


def MLP(sizes):
    """Linear layers of the given widths with ReLU between: fc0, act0, fc1, act1, ..., fcN."""
    layers = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        fc = Linear(d_in, d_out, std=math.sqrt(2.0 / d_in), input_grad=i > 0)  # fc0 sees data
        layers.append((f"fc{i}", fc))
        if i < len(sizes) - 2:
            layers.append((f"act{i}", ReLU()))
    return Sequential(layers)


def GPT(vocab, d_model, n_heads, n_layers, seq_len):
    """A character-level GPT as a flat sequence: embed, blocks.0 .. blocks.{L-1}, head."""
    layers = [("embed", GPTEmbedding(vocab, d_model, seq_len))]
    layers += [(f"blocks.{i}", Block(d_model, n_heads)) for i in range(n_layers)]
    layers.append(("head", GPTHead(d_model, vocab)))
    return Sequential(layers)


# ----------------------------------------------------------------------------- losses
class SoftmaxCrossEntropy(Module):
    """Fused softmax and cross-entropy over the last axis of the logits.

    The loss is the SUM over this rank's rows divided by ``normalizer``, the number of rows in
    the *global* batch. Every scheme passes the global count, so summing the ranks' gradients
    (or the micro-batches') gives exactly the serial gradient, with no further scaling.
    """

    KEEP_FULL = True  # the loss and its softmax in float32, whatever the storage type

    def forward(self, logits, targets, normalizer=None, micro_id=0):
        z = _rows(B.load(logits))  # (N, V), in float32 from 16-bit logits
        t = targets.reshape(-1)  # (N,)
        normalizer = z.shape[0] if normalizer is None else normalizer
        check_targets(t, z.shape[1])
        z = z - z.max(axis=1, keepdims=True)
        logsumexp = B.xp.log(B.xp.exp(z).sum(axis=1))
        rows = B.xp.arange(z.shape[0])
        loss = (logsumexp - z[rows, t]).sum() / normalizer
        self.save(micro_id, z, t, logsumexp, logits.shape, normalizer)
        return float(loss)

    def backward(self, dout=1.0, micro_id=0):
        z, t, logsumexp, shape, normalizer = self.saved(micro_id)
        dz = B.xp.exp(z - logsumexp[:, None])  # softmax
        dz[B.xp.arange(z.shape[0]), t] -= 1.0
        dz *= dout / normalizer
        return dz.reshape(shape)


class MSE(Module):
    """Mean squared error: SUM over this rank's elements / normalizer (global element count)."""

    def forward(self, pred, target, normalizer=None, micro_id=0):
        diff = pred - target
        normalizer = diff.size if normalizer is None else normalizer
        self.save(micro_id, diff, normalizer)
        return float((diff * diff).sum() / normalizer)

    def backward(self, dout=1.0, micro_id=0):
        diff, normalizer = self.saved(micro_id)
        return diff * (2.0 * dout / normalizer)


def check_targets(t, n):
    """Refuse a target outside 0..n-1: z[rows, -1] would silently pick the last class."""
    if bad := [v for v in (int(t.min()), int(t.max())) if not 0 <= v < n] if t.size else []:
        raise ValueError(f"target {bad[0]} is out of range: valid targets are 0..{n - 1}")


def accuracy(logits, targets):
    return float((logits.argmax(axis=-1) == targets).mean())
