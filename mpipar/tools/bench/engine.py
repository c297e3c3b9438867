"""The engine's overhead: one MLP training step through mpipar.engine.nn against the same step
written as bare NumPy matrix products, in the same run.

    python -m mpipar.tools.bench engine                   # engine.csv and engine.png in --out
    python -m mpipar.tools.bench engine --backend cupy    # engine_gpu.csv and .png: on the GPU

MLP widths [784, 128, 127, 126, 125, 124, 123, 10], batch 128, float32, one BLAS thread,
plain SGD. Both steps do the same arithmetic (forward, softmax cross-entropy, backward, update),
so the ratio is the price of the layer abstraction: Python calls, caching, dispatch. On the
CPU each call is timed in CPU time (:func:`seconds`). With ``--backend cupy`` both steps run
on the GPU (the bare one as CuPy calls, :func:`bare_step` with ``xp=cupy``) at 16, 32 and 128
rows, each call timed on the wall clock up to the device's synchronisation: a GPU step this
small is mostly kernel launches, so the ratio is the engine's Python and launches against the
bare calls' own. The CSV names the device.
"""

import statistics
import time

import numpy as np

from mpipar.engine import backend as B
from mpipar.engine import nn, optim
from mpipar.tools.bench.common import (
    bench_parser,
    environment,
    number,
    pyplot,
    save_figure,
    too_big,
    write_csv,
    wrote,
)

SIZES = [784, 128, 127, 126, 125, 124, 123, 10]


def engine_step(model, loss_fn, opt, x, y):
    opt.zero_grad()
    loss = loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    return loss


def bare_forward(Ws, bs, x, xp=np):
    """The MLP's forward with nothing but NumPy (or ``xp``): each layer's input (x, then the
    ReLUs' outputs) and the softmax of the logits."""
    hs = [x]
    for W, b in zip(Ws[:-1], bs[:-1]):
        hs.append(xp.maximum(hs[-1] @ W + b, 0))
    z = hs[-1] @ Ws[-1] + bs[-1]
    z -= z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return hs, p


def bare_step(Ws, bs, x, y, lr, momentum=0.0, velocity=None, xp=np):
    """The same step with nothing but NumPy (or ``xp``, e.g. CuPy, whose arrays the
    arguments then are): the baseline. With ``momentum``, ``velocity`` is a pair of lists like
    (Ws, bs), initially zeros: SGD with momentum, v = momentum v + g and w -= lr v
    (:class:`mpipar.engine.optim.SGD`)."""
    hs, p = bare_forward(Ws, bs, x, xp)
    rows = xp.arange(len(y))
    loss = -xp.log(p[rows, y]).mean()
    dz = p
    dz[rows, y] -= 1
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
    clock would also count the time other work holds the core (on an idle core they agree).
    On a GPU (``backend.xp`` not NumPy): wall seconds up to the device's synchronisation, as
    the kernels run beside the CPU."""
    if B.xp is np:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    B.synchronize()
    t0 = time.perf_counter()
    fn()
    B.synchronize()
    return time.perf_counter() - t0


def measure(rows, repeats):
    """Time the engine's step and the bare step at ``rows`` rows, alternating, on the array
    module in use: (engine s, bare s, median ratio, fastest ratio), medians over ``repeats``
    pairs. Both first compute one step from the same weights and must agree."""
    xp = B.xp
    rng = np.random.default_rng(0)
    x = B.asarray(rng.standard_normal((rows, SIZES[0])).astype(np.float32))
    y = B.asarray(rng.integers(0, SIZES[-1], rows))
    model = nn.MLP(SIZES).init(0)
    opt = optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.SoftmaxCrossEntropy()
    Ws = [p.data.copy() for n, p in model.named_parameters() if n.endswith(".W")]
    bs = [p.data.copy() for n, p in model.named_parameters() if n.endswith(".b")]

    def bare():
        return bare_step(Ws, bs, x, y, 1e-3, xp=xp)

    def engine():
        return engine_step(model, loss_fn, opt, x, y)

    # the two must compute the same thing before their times mean anything
    l1, l2 = float(engine()), float(bare())
    assert abs(l1 - l2) < 1e-4 * abs(l2), (l1, l2)

    # Alternate the two, one call each, so that noise from other work on the machine hits both
    # alike: the ratio is the median over these pairs of (engine call / the bare call beside it).
    for _ in range(3):
        engine()
        bare()
    t_engine, t_bare = [], []
    for _ in range(repeats):
        t_engine.append(seconds(engine))
        t_bare.append(seconds(bare))
    ratio = statistics.median(e / b for e, b in zip(t_engine, t_bare))
    return (statistics.median(t_engine), statistics.median(t_bare), ratio,
            min(t_engine) / min(t_bare))


def plot(engine, bare, ratio, path, baseline="bare NumPy", what="batch 128, float32, 1 thread"):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 2.4))
    ax.barh([baseline, "mpipar.engine.nn"], [bare * 1e3, engine * 1e3],
            color=["#999999", "#4C72B0"])
    clock = "CPU" if baseline == "bare NumPy" else "wall"
    ax.set_xlabel(f"{clock} ms per training step (median of many alternating calls)")
    ax.set_title(f"One MLP step, {what}: ratio {ratio:.2f}")
    return save_figure(fig, path)


def device_name():
    """The GPU's name as CUDA gives it, e.g. "NVIDIA H200"."""
    name = B.xp.cuda.runtime.getDeviceProperties(B.xp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def main(argv=None):
    ap = bench_parser("engine", worker=False)
    ap.add_argument("--batch-size", type=number(), default=None,
                    help="rows per step (default 128; with --backend cupy 16, 32 and 128)")
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                    help="cupy: both steps on the GPU (engine_gpu.csv)")
    ap.sized("--repeats", 200, 30, type=number())
    args = ap.parse_args(argv)
    if args.batch_size and (problem := too_big(4 * args.batch_size * sum(SIZES),
                                               f"--batch-size {args.batch_size}: a step")):
        ap.error(problem)
    gpu = args.backend == "cupy"
    if gpu and (problem := B.cupy_problem()):
        ap.exit(2, f"error: {problem}\n")
    B.use(args.backend, "float32")
    sizes = [args.batch_size] if args.batch_size else [16, 32, 128] if gpu else [128]
    label, baseline = ("the GPU", "bare CuPy") if gpu else ("1 thread", "bare NumPy")
    table = []
    for rows in sizes:
        engine, bare, ratio, fastest = measure(rows, args.repeats)
        table.append(dict(environment(), bench="engine", backend=args.backend,
                          device=device_name() if gpu else "cpu",
                          sizes="-".join(map(str, SIZES)), batch=rows, dtype="float32",
                          engine_ms=round(engine * 1e3, 4),
                          **{f"bare_{args.backend}_ms": round(bare * 1e3, 4)},
                          ratio=round(ratio, 4), fastest_ratio=round(fastest, 4),
                          repeats=args.repeats))
        print(f"one MLP step {SIZES}, batch {rows}, float32, {label} (medians):")
        print(f"  mpipar.engine.nn   {engine * 1e3:8.3f} ms")
        print(f"  {baseline:<10}  {bare * 1e3:8.3f} ms")
        print(f"  ratio       {ratio:8.3f}  (target <= 1.15; median over {args.repeats} paired "
              f"calls; fastest against fastest {fastest:.3f})")
    name = "engine_gpu" if gpu else "engine"
    path = write_csv(f"{name}.csv", table, args.out)
    png = plot(engine, bare, ratio, args.out / f"{name}.png", baseline,  # the last size's
               f"batch {rows}, float32, {label}")
    wrote(path, png)


if __name__ == "__main__":
    main()
