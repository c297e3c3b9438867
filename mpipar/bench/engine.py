"""The engine's overhead: one MLP training step through mpipar.nn against the same step
written as bare NumPy matrix products, in the same run.

    python -m mpipar.bench engine     # engine.csv and engine.png in --out (see mpipar.bench)

MLP widths [784, 128, 127, 126, 125, 124, 123, 10], batch 128, float32, one BLAS thread,
plain SGD. Both steps do the same arithmetic (forward, softmax cross-entropy, backward, update),
so the ratio is the price of the layer abstraction: Python calls, caching, dispatch. Each call
is timed in CPU time (:func:`seconds`).
"""

import statistics
import time

import numpy as np

from mpipar import backend as B
from mpipar import nn, optim
from mpipar.bench.common import bench_parser, environment, pyplot, save_figure, write_csv, wrote

SIZES = [784, 128, 127, 126, 125, 124, 123, 10]


def engine_step(model, loss_fn, opt, x, y):
    opt.zero_grad()
    loss = loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    return loss


def bare_step(Ws, bs, x, y, lr, momentum=0.0, velocity=None):
    """The same step with nothing but NumPy: the baseline. With ``momentum``, ``velocity`` is
    a pair of lists like (Ws, bs), initially zeros: SGD with momentum, v = momentum v + g and
    w -= lr v (:class:`mpipar.optim.SGD`)."""
    hs = [x]
    for W, b in zip(Ws[:-1], bs[:-1]):
        hs.append(np.maximum(hs[-1] @ W + b, 0))
    z = hs[-1] @ Ws[-1] + bs[-1]
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y]).mean()
    dz = p
    dz[np.arange(len(y)), y] -= 1
    dz /= len(y)
    for i in range(len(Ws) - 1, -1, -1):
        dW, db = hs[i].T @ dz, dz.sum(axis=0)
        if i:
            dz = (dz @ Ws[i].T) * (hs[i] > 0)
        if momentum:
            vW, vb = velocity[0][i], velocity[1][i]
            vW *= momentum
            vW += dW
            vb *= momentum
            vb += db
            dW, db = vW, vb
        Ws[i] -= lr * dW
        bs[i] -= lr * db
    return loss


def seconds(fn):
    """CPU seconds of one call: the step runs on one thread, and on a shared machine the wall
    clock would also count the time other work holds the core (on an idle core they agree)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def plot(engine, bare, ratio, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 2.4))
    ax.barh(["bare NumPy", "mpipar.nn"], [bare * 1e3, engine * 1e3], color=["#999999", "#4C72B0"])
    ax.set_xlabel("CPU ms per training step (median of many alternating calls)")
    ax.set_title(f"One MLP step, batch 128, float32, 1 thread: ratio {ratio:.2f}")
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("engine", worker=False)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.sized("--repeats", 200, 30, type=int)
    args = ap.parse_args(argv)
    repeats = args.repeats
    B.use("numpy", "float32")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], args.batch_size)

    model = nn.MLP(SIZES).init(0)
    opt = optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.SoftmaxCrossEntropy()
    Ws = [p.data.copy() for n, p in model.named_parameters() if n.endswith(".W")]
    bs = [p.data.copy() for n, p in model.named_parameters() if n.endswith(".b")]

    # the two must compute the same thing before their times mean anything
    l1 = engine_step(model, loss_fn, opt, x, y)
    l2 = bare_step(Ws, bs, x, y, 1e-3)
    assert abs(l1 - l2) < 1e-4 * abs(l2), (l1, l2)

    # Alternate the two, one call each, so that noise from other work on the machine hits both
    # alike: the ratio is the median over these pairs of (engine call / the bare call beside it).
    t_engine, t_bare = [], []
    for _ in range(3):
        engine_step(model, loss_fn, opt, x, y)
        bare_step(Ws, bs, x, y, 1e-3)
    for _ in range(repeats):
        t_engine.append(seconds(lambda: engine_step(model, loss_fn, opt, x, y)))
        t_bare.append(seconds(lambda: bare_step(Ws, bs, x, y, 1e-3)))
    engine, bare = statistics.median(t_engine), statistics.median(t_bare)
    ratio = statistics.median(e / b for e, b in zip(t_engine, t_bare))
    fastest = min(t_engine) / min(t_bare)
    row = dict(environment(), bench="engine", sizes="-".join(map(str, SIZES)),
               batch=args.batch_size, dtype="float32", engine_ms=round(engine * 1e3, 4),
               bare_numpy_ms=round(bare * 1e3, 4), ratio=round(ratio, 4),
               fastest_ratio=round(fastest, 4), repeats=repeats)
    path = write_csv("engine.csv", [row], args.out)
    png = plot(engine, bare, ratio, args.out / "engine.png")
    print(f"one MLP step {SIZES}, batch {args.batch_size}, float32, 1 thread (medians):")
    print(f"  mpipar.nn   {engine * 1e3:8.3f} ms")
    print(f"  bare NumPy  {bare * 1e3:8.3f} ms")
    print(f"  ratio       {ratio:8.3f}  (target <= 1.15; median over {repeats} paired calls; "
          f"fastest against fastest {fastest:.3f})")
    wrote(path, png)


if __name__ == "__main__":
    main()
