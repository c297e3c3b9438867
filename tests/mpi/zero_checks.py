"""mpirun -n P python tests/mpi/zero_checks.py: ZeRO-2 and ZeRO-3 against the serial trainer.

For the MLP and a tiny GPT, each with a global batch that 3 and 4 do not divide, with SGD
momentum and Adam, ZeRO-2 with and without buckets and overlap, ZeRO-3 with and without
micro-batches, and with prefetch (--overlap): the first Bcast overwrites workers built from
another seed; after step 1 each rank's gradient shard equals its slice of the serial gradient
(and the same slice shifted by one element does not: a one-element mistake fails here); each
step makes exactly the calls and moves exactly the bytes of the formula, layer by layer (bucket
by bucket); the replicas' full parameters are bitwise identical after every step; after 3 steps
the losses and every parameter equal the serial trainer's (relative error <= 1e-10); each rank's
optimizer state is 1/P of the serial one plus its padding (< P values per flat buffer); between
ZeRO-3 steps a rank holds no full parameter or gradient, only 1/P of them, and during a step
one layer's at most (two layers' parameters with prefetch, at some point).
"""

import hashlib

import numpy as np
from reference import BUCKET, MODELS, make_task, serial_run

from mpipar import zero as Z
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.train import trainer_class

C.install_excepthook()
grid = Grid(dp=C.world().size)
dp_comm = grid.dp_comm
P, r = dp_comm.size, dp_comm.rank
STEPS = 3
TOL = 1e-10
W = 8  # bytes per float64 value
COMMON = ["--dtype", "float64", "--steps", str(STEPS), "--quiet", "--sync", "allreduce"]
MODES = {
    "zero 2, sgd": ["--zero", "2", "--optim", "sgd"],
    "zero 2, adam, buckets": ["--zero", "2", "--optim", "adam", *BUCKET],
    "zero 2, sgd, buckets, overlap": ["--zero", "2", "--optim", "sgd", *BUCKET, "--overlap"],
    "zero 2, adam, overlap, 2 micro-batches": ["--zero", "2", "--optim", "adam", *BUCKET,
                                               "--overlap", "--micro-batches", "2"],
    "zero 3, sgd": ["--zero", "3", "--optim", "sgd"],
    "zero 3, adam": ["--zero", "3", "--optim", "adam"],
    "zero 3, sgd, 2 micro-batches": ["--zero", "3", "--optim", "sgd", "--micro-batches", "2"],
    "zero 3, adam, prefetch": ["--zero", "3", "--optim", "adam", "--overlap"],
    "zero 3, sgd, prefetch, 2 micro-batches": ["--zero", "3", "--optim", "sgd", "--overlap",
                                               "--micro-batches", "2"],
}


# -- what the trainer does, seen from outside: every Allgather and Reduce_scatter it calls
CALLS = []


def logged(op, padded):
    """Wrap dp_comm's ``op`` so that each call logs (op, bytes of its padded full buffer)."""
    inner = getattr(dp_comm, op)

    def call(*args, **kwargs):
        CALLS.append((op, padded(*args).nbytes))
        return inner(*args, **kwargs)
    setattr(dp_comm, op, call)


logged("Allgather", lambda send, recv: recv)
logged("Reduce_scatter", lambda send, recv: send)
CURRENT = None  # the trainer under test
HELD = []  # how many other layers held full parameters at each gather, new gradient


def one_layer_at_a_time(method):
    """Wrap a FlatShard method: in ZeRO-3, when a layer gathers its parameters or makes its full
    gradient, no other layer holds a full gradient, and no other layer's full parameters are
    held (the peak is one layer's, not the model's); with prefetch (--overlap) one other's are:
    the layer that computes while this one's arrive, or the one that arrived for it."""
    def call(self, *args):
        if isinstance(CURRENT, Z.Zero3Scheme):
            others = [g for g in CURRENT.groups if g is not self]
            held = sum(any(p.data is not None for p in g.params) for g in others)
            assert held <= CURRENT.args.overlap, (method.__name__, held)
            HELD.append(held)
            assert all(g.flat_grad is None for g in others), method.__name__
        return method(self, *args)
    return call


for _name in ("gather_params", "post_gather", "new_grads"):
    setattr(Z.FlatShard, _name, one_layer_at_a_time(getattr(Z.FlatShard, _name)))


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(B.to_numpy(a).tobytes())
    return h.hexdigest()


def replicas_equal(named):
    hashes = dp_comm.allgather_obj(digest(named[k] for k in sorted(named)))
    return all(h == hashes[0] for h in hashes)


def full(dp):
    """The replica's whole model on this rank (ZeRO-3 gathers it: call after the traffic check)."""
    if isinstance(dp, Z.Zero3Scheme):
        return dp.gathered()
    return {p.name: B.to_numpy(p.data) for p in dp.params}


def check_traffic(name, args, dp):
    """The counted calls and bytes of one step against the formula (stats reset before it)."""
    s, m = dp_comm.stats, args.micro_batches
    ops = set(s)  # (before a look-up adds an empty entry)
    sizes = [P * g.shard_size * W for g in dp.groups]  # each flat buffer, padded, in bytes
    psi = sum(sizes)  # Psi
    assert all(0 <= size - g.n * W < P * W for size, g in zip(sizes, dp.groups)), name
    gathers = 0 if args.zero == 3 and args.overlap else 2 * m if args.zero == 3 else 1
    assert s["Allgather"]["sent"] + s["Allgather"]["recv"] == gathers * psi
    if args.zero == 3 and args.overlap:  # each Allgather as P-1 Isend and Irecv of one block
        assert ops == ({"Send", "Recv"} if P > 1 else set()) | {"Reduce_scatter"}, (name, ops)
        assert s["Send"]["messages"] == 2 * m * (P - 1) * len(sizes), name
        assert s["Send"]["sent"] == s["Recv"]["recv"] == 2 * m * (P - 1) * psi // P, name
        assert s["Reduce_scatter"]["sent"] == m * psi, name
        assert CALLS == m * [("Reduce_scatter", n) for n in reversed(sizes)], (name, CALLS)
    elif args.zero == 3:  # per layer: Allgather forward, Allgather backward, Reduce_scatter
        assert set(s) == {"Allgather", "Reduce_scatter"}, (name, set(s))
        assert s["Reduce_scatter"]["sent"] == m * psi, name  # 3 Psi in all per micro-batch
        assert CALLS == m * ([("Allgather", n) for n in sizes]
                             + [(op, n) for n in reversed(sizes)
                                for op in ("Allgather", "Reduce_scatter")]), (name, CALLS)
    elif args.overlap:  # P-1 Isend and Irecv of one block per bucket, then Allgathers
        assert set(s) == ({"Send", "Recv"} if P > 1 else set()) | {"Allgather"}, (name, set(s))
        assert s["Send"]["messages"] == (P - 1) * len(sizes), name
        assert s["Send"]["sent"] == s["Recv"]["recv"] == (P - 1) * psi // P, name
        assert CALLS == [("Allgather", n) for n in sizes], (name, CALLS)
        log = dp.sync.launch_log  # the first bucket went out while backward still ran
        filled = np.cumsum([len(g.params) for g in dp.groups])
        assert 0 < log[0] < len(dp.params) and log == sorted(log), (name, log)
        assert all(np.array(log) >= filled) and log[-1] == len(dp.params), (name, log)
    else:  # ZeRO-2: one Reduce_scatter then one Allgather per bucket: 2 Psi
        assert set(s) == {"Allgather", "Reduce_scatter"}, (name, set(s))
        assert s["Reduce_scatter"]["sent"] == psi, name
        assert CALLS == [(op, n) for op in ("Reduce_scatter", "Allgather") for n in sizes], name
    if args.zero == 2 and args.bucket_mb is not None:
        assert len(dp.groups) > 1, name  # in reverse parameter order, each in one bucket
        assert [id(p) for g in dp.groups for p in g.params] == [id(p) for p in dp.params[::-1]]


def dense_gradient(task):
    """The serial trainer's gradient of step 1, {name: host array}."""
    model = task.build_model().init(task.args.seed)
    x, y = task.to_device(*task.batch(0))
    task.loss_fn.forward(model.forward(x), y, normalizer=y.size)
    model.backward(task.loss_fn.backward())
    return {n: B.to_numpy(p.grad).copy() for n, p in model.named_parameters()}


def check_shards(name, dp, dense):
    """Each shard's gradient is its slice of the dense gradient; one element off is not."""
    got, want, shifted = [], [], []
    for g in dp.groups:
        flat = np.zeros(P * g.shard_size + 1)  # one more zero for the shifted slice
        C.flatten([dense[p.name] for p in g.params], flat[:g.n])
        lo = r * g.shard_size
        got.append(B.to_numpy(g.shard.grad))
        want.append(flat[lo:lo + g.shard_size])
        shifted.append(flat[lo + 1:lo + 1 + g.shard_size])
    got, want, shifted = (np.concatenate(a) for a in (got, want, shifted))
    scale = dp_comm.allgather_obj(float(np.linalg.norm(want)))  # rank's slice may be all zero
    err = lambda a: np.linalg.norm(got - a) / max(scale)  # noqa: E731
    assert err(want) <= TOL, f"{name}: shard gradient relative error {err(want):.2e}"
    assert max(dp_comm.allgather_obj(err(shifted))) > 1e-3, f"{name}: a shift goes unnoticed"


references, dense = {}, {}
n_checked, memory_lines = 0, []
for model_name, model_args in MODELS.items():
    for mode, mode_args in MODES.items():
        name = f"{model_name} / {mode} / P={P}"
        task = make_task(model_args + mode_args + COMMON, "data_parallel", P)
        args = task.args
        if model_name not in dense:
            dense[model_name] = dense_gradient(task)

        # workers build their model from another seed: only the first Bcast can fix that
        model = task.build_model().init(args.seed + 1000 * r)
        dp = CURRENT = trainer_class("data_parallel", args)(task, grid, args, model=model)
        assert type(dp).__name__ == f"Zero{args.zero}Scheme", name
        assert replicas_equal(full(dp)), f"{name}: replicas differ after the first Bcast"

        losses, HELD[:] = [], []
        for step in range(STEPS):
            dp_comm.reset_stats()
            CALLS.clear()
            losses.append(dp.step(step))
            check_traffic(name, args, dp)
            if step == 0:
                check_shards(name, dp, dense[model_name])
            memory = dp.memory()  # what a rank holds between steps: no full gradient
            assert all(p.grad is None for p in dp.params), name
            kept = W * sum(g.shard_size for g in dp.groups)  # 1/P of the padded model
            assert memory["grad_bytes"] == kept, (name, memory)
            if args.zero == 3:  # and no full parameter
                assert all(p.data is None for p in dp.params), name
                assert memory["param_bytes"] == kept, (name, memory)
            assert replicas_equal(full(dp)), f"{name}: replicas differ after step {step}"

        if args.zero == 3:  # prefetch holds two layers at once, at some point; else never
            assert max(HELD) == args.overlap, (name, max(HELD))
        key, got = (model_name, args.optim), full(dp)  # (every rank takes part in ZeRO-3's)
        if r == 0 and key not in references:
            references[key] = serial_run(task, STEPS)
        if r == 0:
            ref_losses, ref_params, ref_opt = references[key]
            np.testing.assert_allclose(losses, ref_losses, rtol=TOL, err_msg=name)
            for pname, want in ref_params.items():
                err = np.linalg.norm(got[pname] - want) / np.linalg.norm(want)
                assert err <= TOL, f"{name}: {pname} relative error {err:.2e}"
        # optimizer state per rank: 1/P of the serial one, plus the padding of each buffer
        ref_bytes = dp_comm.bcast_obj(references[key][2].state_bytes() if r == 0 else None)
        kinds = ref_bytes // (W * dp.n)  # SGD momentum 1, Adam 2
        pad = sum(P * g.shard_size - g.n for g in dp.groups)
        assert dp.optimizer_state_bytes() * P == ref_bytes + kinds * W * pad, name
        if args.zero == 3 and mode.endswith("adam"):
            memory_lines.append(f"{model_name}: a ZeRO-3 rank holds {memory['param_bytes']:,} "
                                f"parameter and {memory['grad_bytes']:,} gradient bytes between "
                                f"steps, of the model's {dp.n * W:,} (1/{P} + {pad} padding "
                                f"values over {len(dp.groups)} layers), optimizer state "
                                f"{memory['optimizer_bytes']:,} of {ref_bytes:,}")
        n_checked += 1

dp_comm.Barrier()
if r == 0:
    print("\n".join(memory_lines))
    print(f"zero checks passed on {P} ranks ({n_checked} configurations)", flush=True)
