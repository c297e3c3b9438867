"""Finite-difference checks, in float64, of every layer's input and parameter gradients."""

import numpy as np
import pytest

from mpipar.engine import backend as B
from mpipar.engine import nn

RNG = np.random.default_rng(0)


def numeric_grad(f, a, idx, h=1e-6):
    old = a[idx]
    a[idx] = old + h
    up = f()
    a[idx] = old - h
    down = f()
    a[idx] = old
    return (up - down) / (2 * h)


def sample(shape, k=12):
    """Up to k entries of an array of this shape, always including the first and last."""
    flat = RNG.choice(int(np.prod(shape)), size=min(k, int(np.prod(shape))), replace=False)
    picks = {0, int(np.prod(shape)) - 1, *map(int, flat)}
    return [np.unravel_index(i, shape) for i in sorted(picks)]


def gradcheck(module, x, name, tol=1e-6, check_input=True):
    """Compare backward with central differences of L = sum(forward(x) * dout)."""
    module.init(seed=1)
    for p in module.parameters():  # non-trivial values, also for LayerNorm's ones/zeros
        p.data += RNG.normal(0, 0.1, p.data.shape)
    dout = RNG.standard_normal(module.forward(x).shape)
    module.clear_cache()  # drop what the shape probe cached

    def loss():
        out = module.forward(x, micro_id=7)
        for m in module.modules():
            m._cache.pop(7, None)
        return float((out * dout).sum())

    module.zero_grad()
    module.forward(x, micro_id=3)
    dx = module.backward(dout, micro_id=3)
    for m in module.modules():
        assert not m._cache, f"{name}: backward left a cache entry in {type(m).__name__}"
    targets = [("input", x, dx)] if check_input else []
    targets += [(pname, p.data, p.grad) for pname, p in module.named_parameters()]
    for label, arr, grad in targets:
        for idx in sample(arr.shape):
            num = numeric_grad(loss, arr, idx)
            err = abs(num - grad[idx]) / max(1.0, abs(num), abs(grad[idx]))
            assert err < tol, (f"{name}: d{label}{[int(i) for i in idx]} is wrong: backward gives "
                               f"{grad[idx]:.8g}, finite differences {num:.8g}")


def x3(shape=(2, 5, 8)):
    return RNG.standard_normal(shape)


@pytest.mark.parametrize("name,make,shape", [
    ("Linear", lambda: nn.Linear(8, 6), (2, 5, 8)),
    ("Linear (2-d input)", lambda: nn.Linear(8, 3), (7, 8)),
    ("ReLU", nn.ReLU, (4, 9)),
    ("GELU", nn.GELU, (3, 4, 5)),
    ("LayerNorm", lambda: nn.LayerNorm(8), (2, 5, 8)),
    ("CausalSelfAttention", lambda: nn.CausalSelfAttention(8, 2), (2, 5, 8)),
    ("FeedForward", lambda: nn.FeedForward(8), (2, 5, 8)),
    ("Block", lambda: nn.Block(8, 2), (2, 5, 8)),
    ("GPTHead", lambda: nn.GPTHead(8, 11), (2, 5, 8)),
    ("MLP", lambda: nn.MLP([8, 7, 6, 3]), (5, 8)),
])
def test_layer_gradients(name, make, shape):
    x = RNG.standard_normal(shape)
    if name == "ReLU":
        x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kink
    module = make()
    gradcheck(module, x, name, check_input=name != "MLP")  # the MLP's fc0 is fed by data


def test_mlp_skips_the_data_gradient():
    mlp = nn.MLP([4, 5, 3]).init(0)
    mlp.forward(np.ones((2, 4)))
    assert mlp.backward(np.ones((2, 3))) is None


def test_embedding_gradients():
    idx = RNG.integers(0, 11, (3, 5))
    idx[0, :2] = 4  # a repeated token: its gradient rows must add up
    gradcheck(nn.GPTEmbedding(11, 8, seq_len=6), idx, "GPTEmbedding", check_input=False)


def test_gpt_gradients():
    idx = RNG.integers(0, 13, (2, 6))
    gradcheck(nn.GPT(13, 8, 2, 2, 6), idx, "GPT", check_input=False)


@pytest.mark.parametrize("loss_cls", [nn.SoftmaxCrossEntropy, nn.MSE])
def test_loss_gradients(loss_cls):
    logits = RNG.standard_normal((4, 3, 5))
    target = RNG.integers(0, 5, (4, 3)) if loss_cls is nn.SoftmaxCrossEntropy else \
        RNG.standard_normal((4, 3, 5))
    fn = loss_cls()
    fn.forward(logits, target, normalizer=17)
    d = fn.backward()
    for idx in sample(logits.shape):
        def f():
            return loss_cls().forward(logits, target, normalizer=17)
        num = numeric_grad(f, logits, idx)
        where = [int(i) for i in idx]
        assert abs(num - d[idx]) < 1e-7, f"{loss_cls.__name__}: dlogits{where} is wrong"


def test_attention_keeps_its_head_count_and_width():
    """The heads an attention computes and their width are set at construction, not read back
    from a weight's width (a tensor-parallel rank passes its n_heads / t)."""
    attn = nn.CausalSelfAttention(12, 3)
    assert (attn.n_local_heads, attn.head_dim) == (3, 4)
    with pytest.raises(ValueError, match="not divisible"):
        nn.CausalSelfAttention(12, 5)


def test_attention_is_causal():
    """Changing a later position must not change an earlier output."""
    attn = nn.CausalSelfAttention(8, 2).init(0)
    x = RNG.standard_normal((1, 6, 8))
    y1 = attn.forward(x)
    x[0, 4] += 1.0
    y2 = attn.forward(x, micro_id=1)
    np.testing.assert_array_equal(y1[0, :4], y2[0, :4])
    assert not np.allclose(y1[0, 4:], y2[0, 4:])


def test_cache_is_per_micro_batch():
    """Two micro-batches in flight: backward of the first must use the first's activations."""
    mlp = nn.MLP([4, 5, 3]).init(0)
    a, b = RNG.standard_normal((2, 4)), RNG.standard_normal((2, 4))
    dout = RNG.standard_normal((2, 3))
    mlp.forward(a, micro_id=0)
    mlp.forward(b, micro_id=1)
    mlp.zero_grad()
    mlp.backward(dout, micro_id=0)
    interleaved = [p.grad.copy() for p in mlp.parameters()]
    ref = nn.MLP([4, 5, 3]).init(0)
    ref.forward(a)
    ref.backward(dout)
    for g, r in zip(interleaved, (p.grad for p in ref.parameters())):
        np.testing.assert_array_equal(g, r)


def test_init_depends_on_seed_and_name_only():
    """A slice of the model built alone starts with the serial model's weights."""
    full = nn.GPT(11, 8, 2, 3, 6).init(5)
    part = nn.Sequential(full.layers[2:4])  # blocks.1, blocks.2
    alone = nn.GPT(11, 8, 2, 3, 6)
    stage = nn.Sequential(alone.layers[2:4]).init(5)
    names = [n for n, _ in stage.named_parameters()]
    assert names[0].startswith("blocks.1.")
    for (n1, p1), (n2, p2) in zip(part.named_parameters(), stage.named_parameters()):
        assert n1 == n2
        np.testing.assert_array_equal(p1.data, p2.data)
    other = nn.GPT(11, 8, 2, 3, 6).init(6)
    assert not np.array_equal(other.parameters()[0].data, full.parameters()[0].data)


def test_canonical_names():
    names = [n for n, _ in nn.GPT(11, 8, 2, 2, 6).named_parameters()]
    assert names[:2] == ["embed.tok.W", "embed.pos"]
    assert "blocks.1.attn.qkv.W" in names and names[-1] == "head.out.b"
    assert [n for n, _ in nn.MLP([4, 5, 3]).named_parameters()] == \
        ["fc0.W", "fc0.b", "fc1.W", "fc1.b"]


@pytest.mark.parametrize("bad", [-1, 5, 9])
def test_cross_entropy_refuses_a_target_that_is_not_a_class(bad):
    # z[rows, -1] would silently pick the last class, and z[rows, 5] fails far from the cause
    logits = RNG.standard_normal((2, 3, 5))
    targets = RNG.integers(0, 5, (2, 3))
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=rf"target {bad} is out of range.*0\.\.4"):
        nn.SoftmaxCrossEntropy().forward(logits, targets)


def test_gpt_refuses_an_input_longer_than_its_context():
    gpt = nn.GPT(13, 8, 2, 1, seq_len=6).init(0)
    gpt.forward(RNG.integers(0, 13, (2, 6)))  # seq_len tokens, and fewer, are fine
    gpt.forward(RNG.integers(0, 13, (2, 3)), micro_id=1)
    with pytest.raises(ValueError, match="input of 7 tokens is longer than the model's context "
                                         "seq_len=6"):
        gpt.forward(RNG.integers(0, 13, (2, 7)), micro_id=2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameter_set_copies_its_source(dtype):
    """set() must own its data: with a matching dtype asarray would alias the caller's array,
    and a later in-place change of that array would silently change the model."""
    B.set_dtype(dtype)  # the autouse fixture restores the default afterwards
    src = np.arange(6, dtype=dtype).reshape(2, 3)
    p = nn.Parameter(2, 3)
    p.set(src)
    assert p.data.dtype == src.dtype and not np.shares_memory(p.data, src)
    src += 100.0
    np.testing.assert_array_equal(p.data, np.arange(6).reshape(2, 3))
    p.set(src[:, ::-1])  # a strided view arrives C-contiguous, as the optimizer needs
    assert p.data.flags.c_contiguous
    np.testing.assert_array_equal(p.data, src[:, ::-1])


# -- a zeroed gradient is written by the first micro-batch and added to by the next ones
def plain_sums(xs, douts, order):
    """dW and db by the plain formula: zeros, then += each micro-batch's x^T dout and sum."""
    dW, db = np.zeros((xs[0].shape[-1], douts[0].shape[-1])), np.zeros(douts[0].shape[-1])
    for k in order:
        dW += xs[k].reshape(-1, dW.shape[0]).T @ douts[k].reshape(-1, dW.shape[1])
        db += douts[k].reshape(-1, dW.shape[1]).sum(axis=0)
    return dW, db


@pytest.mark.parametrize("n_micro", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_linear_gradients_are_bitwise_the_plain_sum(n_micro, split):
    """After zero_grad a Linear writes its first dW and db into the gradient (0 + v == v) and
    adds the later micro-batches' ones: bitwise the plain zeros-then-+= sum, through backward
    and through B and W apart, W in another order (as a zero-bubble stage runs them)."""
    lin = nn.Linear(6, 4).init(0)
    xs = [RNG.standard_normal((3, 5, 6)) for _ in range(n_micro)]
    douts = [RNG.standard_normal((3, 5, 4)) for _ in range(n_micro)]
    douts[-1][..., 2] = -0.0  # 0 + (-0.0) is +0.0: a written sum must not keep the sign
    order = list(range(n_micro))[::-1] if split else range(n_micro)
    for _ in range(2):  # the second step starts from the first step's gradient, zeroed
        lin.zero_grad()
        for k in range(n_micro):
            lin.forward(xs[k], k)
        for k in range(n_micro):
            (lin.backward_input if split else lin.backward)(douts[k], k)
        for k in order if split else ():
            lin.backward_weight(k)
    dW, db = plain_sums(xs, douts, order)
    assert lin.W.grad.tobytes() == dW.tobytes()
    assert lin.b.grad.tobytes() == db.tobytes()
    if n_micro == 1:
        assert not np.signbit(lin.b.grad[2]) and not np.signbit(lin.W.grad[:, 2]).any()


def test_layernorm_gradients_add_over_micro_batches():
    ln = nn.LayerNorm(5).init(0)
    xs, douts = RNG.standard_normal((2, 4, 5)), RNG.standard_normal((2, 4, 5))
    ln.zero_grad()
    g, b = np.zeros(5), np.zeros(5)
    for k in range(2):
        xhat = (xs[k] - xs[k].mean(-1, keepdims=True))
        xhat = xhat * (1.0 / np.sqrt((xhat * xhat).mean(-1, keepdims=True) + ln.eps))
        ln.forward(xs[k], k)
        ln.backward(douts[k], k)
        g += (douts[k] * xhat).sum(axis=0)
        b += douts[k].sum(axis=0)
    assert ln.g.grad.tobytes() == g.tobytes() and ln.b.grad.tobytes() == b.tobytes()


def test_a_zeroed_gradient_reads_as_zeros():
    """zero_grad may leave an owned gradient's zeros unwritten until it is read; a gradient
    that is a view into a larger buffer (a bucket MPI sends whole) is zeroed at once."""
    bucket = np.full(10, 7.0)
    own, view = nn.Parameter(2, 3), nn.Parameter(4)
    own.set(np.ones((2, 3)))
    view.set(np.ones(4))
    own.grad[...] = 7.0
    view.grad = bucket[6:]
    own.zero_grad()
    view.zero_grad()
    np.testing.assert_array_equal(bucket, [7.0] * 6 + [0.0] * 4)
    np.testing.assert_array_equal(own.grad, np.zeros((2, 3)))
    emb = nn.Embedding(5, 3).init(0)  # adds into some rows of its gradient only
    for _ in range(2):
        emb.zero_grad()
        emb.forward(np.array([[1, 1, 3]]))
        emb.backward(np.ones((1, 3, 3)))
    np.testing.assert_array_equal(emb.W.grad, np.array([0, 2, 0, 1, 0])[:, None] * np.ones(3))


# ----------------------------------------------------------------------------- mixture of experts
def moe_gradcheck(module, x, name, tol=1e-6):
    """As :func:`gradcheck`, with the layer's load-balancing loss in L: sum(out * dout) + aux."""
    module.init(seed=1)
    for p in module.parameters():
        p.data += RNG.normal(0, 0.3, p.data.shape)  # a router far from uniform: real top-k
    dout = RNG.standard_normal(x.shape)

    def loss():
        out = module.forward(x, micro_id=7)
        for m in module.modules():
            m._cache.pop(7, None)
        return float((out * dout).sum()) + module.settle()

    module.zero_grad()
    module.forward(x, micro_id=3)
    module.settle()  # the step's shares f_e, which the backward needs
    dx = module.backward(dout, micro_id=3)
    assert not any(m._cache for m in module.modules()), name
    for label, arr, grad in [("input", x, dx)] + [(n, p.data, p.grad)
                                                  for n, p in module.named_parameters()]:
        for idx in sample(arr.shape, k=6):
            num = numeric_grad(loss, arr, idx)
            err = abs(num - grad[idx]) / max(1.0, abs(num), abs(grad[idx]))
            assert err < tol, (f"{name}: d{label}{[int(i) for i in idx]}: backward "
                               f"{grad[idx]:.8g}, finite differences {num:.8g}")


@pytest.mark.parametrize("experts,k,coef", [(4, 2, 0.5), (4, 1, 0.0), (3, 3, 1.0)])
def test_moe_gradients(experts, k, coef):
    from mpipar.engine import moe

    moe_gradcheck(moe.MoE(8, experts, k, coef), RNG.standard_normal((2, 5, 8)),
                  f"MoE E={experts} k={k} coef={coef}")


def test_moe_routes_each_token_to_its_top_k_with_ties_to_the_lower_expert():
    """A router of zeros gives every expert the same probability 1/E: every token goes to
    experts 0..k-1, the output is (1/E) * sum of those experts, and aux = coef * E * sum f P
    with f = (1/k for the first k experts), P = 1/E each: coef exactly."""
    from mpipar.engine import moe

    layer = moe.MoE(8, 4, 2, 0.25).init(seed=1)
    layer.router.W.data[:] = 0
    x = RNG.standard_normal((3, 4, 8))
    out = layer.forward(x)
    layer.settle()
    h = x.reshape(-1, 8)
    want = sum(layer.experts.layers[e][1].forward(h, micro_id=9) for e in (0, 1)) / 4
    np.testing.assert_allclose(out.reshape(-1, 8), want, rtol=1e-12, atol=0)
    assert layer.tokens_per_expert.tolist() == [12, 12, 0, 0]
    assert layer.aux == pytest.approx(0.25, rel=1e-15)


def test_moe_gpt_names_every_expert():
    from mpipar.engine import moe

    names = [n for n, _ in moe.gpt(11, 8, 2, 2, 5, 3, 2, 0.01).named_parameters()]
    assert "blocks.1.mlp.router.W" in names and "blocks.1.mlp.router.b" not in names
    assert [n for n in names if n.startswith("blocks.0.mlp.experts.2.")] == [
        f"blocks.0.mlp.experts.2.{p}" for p in ("fc.W", "fc.b", "proj.W", "proj.b")]
    assert not any(".mlp.fc." in n for n in names)  # no dense feed-forward left
