"""Optimizers: each update against its formula written out here."""

import numpy as np
import pytest

from mpipar.engine import backend as B
from mpipar.engine import nn, optim


def params(seed, dtype):
    B.use("numpy", dtype)
    rng = np.random.default_rng(seed)
    out = []
    for i, shape in enumerate([(13, 11), (5,), (3, 4, 7)]):
        p = nn.Parameter(*shape)
        p.name = f"p{i}"
        p.set(rng.standard_normal(shape))
        out.append(p)
    return out


def run(make, steps=3, seed=0, dtype="float64"):
    ps = params(seed, dtype)
    opt = make(ps)
    rng = np.random.default_rng(seed + 1)
    grads = [[rng.standard_normal(p.shape) for p in ps] for _ in range(steps)]
    for step in grads:
        for p, g in zip(ps, step):
            p.grad[...] = g
        opt.step()
    return [p.data.copy() for p in ps], grads


MAKERS = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1),
    "sgd momentum + decay": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.01, decoupled=True),
}


def test_sgd_momentum_matches_its_formula():
    got, grads = run(MAKERS["sgd momentum + decay"])
    for i, w0 in enumerate(p.data for p in params(0, "float64")):
        w, v = w0.copy(), np.zeros_like(w0)
        for step in grads:
            v = 0.9 * v + (step[i] + 0.01 * w)
            w = w - 0.1 * v
        np.testing.assert_allclose(got[i], w, rtol=1e-13)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_matches_its_formula(decoupled):
    got, grads = run(MAKERS["adamw" if decoupled else "adam"])
    for i, w0 in enumerate(p.data for p in params(0, "float64")):
        w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
        for t, step in enumerate(grads, start=1):
            g = step[i] if decoupled else step[i] + 0.01 * w
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            if decoupled:
                w = w - 0.01 * 0.01 * w
            w = w - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        np.testing.assert_allclose(got[i], w, rtol=1e-12)


def test_state_bytes_count_the_state_arrays():
    ps = params(0, "float32")
    n = sum(p.size for p in ps)
    for make, per_value in ((MAKERS["sgd"], 0), (MAKERS["sgd momentum + decay"], 4),
                            (MAKERS["adam"], 8)):
        opt = make(ps)
        opt.step()
        assert opt.state_bytes() == per_value * n


def test_a_parameter_that_is_a_view_is_updated_in_place():
    """A parameter may be a view into a buffer it shares (ZeRO's flat parameters), even a
    strided one: the update lands in the buffer."""
    (p, *_) = params(0, "float64")
    buffer = np.ones((13, 11))
    p.data, p.grad = buffer.T, np.full((11, 13), 2.0)  # a transposed view
    optim.SGD([p], lr=0.1).step()
    assert np.all(buffer == 1.0 - 0.1 * 2.0)


@pytest.mark.parametrize("name, given, expected", [
    ("adamw", None, 0.01), ("adamw", 0.0, 0.0), ("adamw", 0.05, 0.05),
    ("adam", None, 0.0), ("adam", 0.0, 0.0), ("sgd", None, 0.0), ("sgd", 0.0, 0.0)])
def test_make_uses_the_weight_decay_given_and_zero_means_zero(name, given, expected):
    # an `or` default once turned adamw's explicit weight_decay=0.0 into 0.01
    ps = params(0, "float64")
    opt = optim.make(name, ps, 0.01) if given is None else optim.make(name, ps, 0.01, given)
    assert opt.weight_decay == expected
    assert getattr(opt, "decoupled", False) == (name == "adamw")


def test_adamw_with_zero_weight_decay_steps_exactly_like_adam():
    adam, _ = run(lambda ps: optim.make("adam", ps, 0.01, weight_decay=0.0))
    adamw, _ = run(lambda ps: optim.make("adamw", ps, 0.01, weight_decay=0.0))
    for a, b in zip(adam, adamw):
        assert a.tobytes() == b.tobytes()


def test_make_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        optim.make("lamb", params(0, "float64"), 0.01)


def test_the_update_follows_arrays_that_are_replaced():
    """The optimizer keeps each parameter's block views between steps: a gradient or data
    array replaced since (a bucket's view) is the one it must read and write next."""
    ps = params(0, "float64")
    opt = optim.SGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad[...] = 1.0
    opt.step()
    p = ps[0]
    bucket = np.full(p.size + 3, 2.0)
    p.grad = bucket[3:].reshape(p.shape)
    p.data = p.data.copy()
    w, v = p.data.copy(), opt.state[p][0].copy()
    opt.step()
    np.testing.assert_array_equal(p.data, w - 0.1 * (0.9 * v + 2.0))
    opt.zero_grad()  # a zeroed gradient, never written by a backward, updates with zeros
    w, v = p.data.copy(), opt.state[p][0].copy()
    opt.step()
    np.testing.assert_array_equal(p.data, w - 0.1 * (0.9 * v))
