"""mpirun -n P python tests/mpi/sp_checks.py: sequence parallelism against the serial trainer and
against tensor parallelism without it, float64, in one launch (P = 1, 2 or 4).

Checked on every rank:
- tensor parallel with --sequence-parallel, Adam and SGD (and --update master): the loss of every
  step equals the serial one, and after 3 steps every gathered parameter does (relative error
  <= 1e-10); the replicated parameters are bitwise identical across the ranks after every step;
- the traffic of a step: every Allreduce of an activation (4L + 2 of b*s*h) is replaced by a
  Reduce_scatter and an Allgather of the same b*s*h, in the order of the layers, so the bytes a
  rank receives, and a ring's bytes on the wire, are tensor parallelism's; the Allreduces left
  are the cross-entropy's 3 of b*s and one of the LayerNorm and position gradients;
- the LayerNorms' cached activations are 1/t of tensor parallelism's, and nothing else cached
  changes size;
- forgetting the Allreduce of the LayerNorm gradients fails the comparison, in exactly the
  LayerNorm and position parameters;
- P = 4 also: the hybrid with --sequence-parallel, tp 2 x pp 2 (with --recompute) and
  dp 2 x tp 2 (overlapped buckets), equals the serial trainer (losses, gathered parameters;
  the tp copies of the replicated parameters bitwise equal), and a stage boundary carries
  each tp rank's rows only.
"""

import hashlib
import sys

import numpy as np
from reference import make_task, serial_run

from mpipar import hybrid as H
from mpipar import tensor_parallel as TP
from mpipar.engine import backend as B
from mpipar.engine import nn
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE
from mpipar.parts import sequence_parallel as SP
from mpipar.parts.tp_layers import split_parameters
from mpipar.runner import recompute

TRACE.calls = True  # the checks read each MPI call's span
C.install_excepthook()
world = C.world()
N = world.size
STEPS, TOL, W = 3, 1e-10, 8  # W: bytes per float64
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
       "--seq-len", "8", "--batch-size", "4", "--dtype", "float64"]
B.use("numpy", "float64")
grid = Grid(tp=N)
tp_comm = grid.tp_comm
t, rank = tp_comm.size, tp_comm.rank


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def digest(params):
    return hashlib.sha256(b"".join(B.to_numpy(p.data).tobytes() for p in params)).hexdigest()


def trainer_for(flags, sequence_parallel=True):
    task = make_task(GPT + flags + ["--sequence-parallel"] * sequence_parallel,
                     "tensor_parallel", t)
    return task, TP.TensorParallel(task, grid, task.args)


def step_traffic(trainer, step):
    """(op, full bytes) of one step's collectives, in order, and the group's stats."""
    tp_comm.reset_stats()
    TRACE.clear()
    trainer.step(step)
    calls = [(e[3], e[4]["bytes"]) for e in TRACE.events if e[2] == "comm"]
    return calls, {op: dict(s) for op, s in tp_comm.stats.items()}


def check_equals_serial(flags, name):
    task, trainer = trainer_for(flags)
    losses, ref = serial_run(task, STEPS)[:2]
    _, replicated = split_parameters(trainer.model)
    for step in range(STEPS):
        loss = trainer.step(step)
        assert abs(loss - losses[step]) <= 1e-12 * abs(losses[step]), (name, step, loss)
        mine = digest(replicated)
        assert set(tp_comm.allgather_obj(mine)) == {mine}, f"{name} step {step}: copies differ"
    full = trainer.full_params()
    if rank == 0:
        for pname, value in ref.items():
            err = rel_err(full[pname], value)
            assert err <= TOL, f"{name} t={t}: {pname} relative error {err:.2e}"
        bad = full["blocks.0.ln1.b"].copy()  # the check catches a one-element slip of 1e-9
        bad.flat[bad.size // 2] += 1e-9 * np.abs(bad).max()
        assert rel_err(bad, ref["blocks.0.ln1.b"]) > TOL


def check_traffic():
    """Step 0 of both variants: each activation Allreduce of b*s*h becomes one Reduce_scatter
    and one Allgather of b*s*h; the same bytes received, the same ring volume."""
    task, tp_trainer = trainer_for([], False)
    a = task.args
    L, bsh, bs = a.n_layers, a.batch_size * a.seq_len * a.d_model * W, a.batch_size * a.seq_len * W
    tp_calls, tp_stats = step_traffic(tp_trainer, 0)
    sp_trainer = trainer_for([])[1]
    sp_calls, sp_stats = step_traffic(sp_trainer, 0)
    if t == 1:
        assert tp_calls == sp_calls == [], (tp_calls, sp_calls)  # one rank makes no call
        return
    RS, AG, AR = "Reduce_scatter", "Allgather", "Allreduce"
    block = [AG, RS, AG, RS]  # f' qkv, g' attention proj, f' fc, g' MLP proj
    want = [(RS, bsh)] + [(op, bsh) for op in block * L] + [(AG, bsh)] + [(AR, bs)] * 3 \
        + [(op, bsh) for op in [RS] + [AG, RS] * 2 * L + [AG]]
    n_ln = sum(p.size for p in sp_trainer.model.parameters() if hasattr(p, "sequence_parallel"))
    assert n_ln == (2 * L + 1) * 2 * a.d_model + a.seq_len * a.d_model, n_ln
    want.append((AR, n_ln * W))  # the LayerNorm and position gradients, once
    assert sp_calls == want, (sp_calls, want)
    moved = [n for op, n in tp_calls if op == AR and n == bsh]  # what sequence parallelism splits
    assert len(moved) == 4 * L + 2
    moved = sum(moved)
    assert sp_stats[RS]["recv"] + sp_stats[AG]["recv"] == moved  # what a rank receives
    # on a ring a Reduce_scatter sends (t-1)/t of its buffer, an Allgather receives (t-1)/t of
    # its result, an Allreduce sends 2(t-1)/t: times t, in integers
    assert (t - 1) * sp_stats[RS]["sent"] + t * sp_stats[AG]["recv"] == 2 * (t - 1) * moved
    assert sp_stats[AR]["sent"] == tp_stats[AR]["sent"] - moved + n_ln * W


def ln_bytes(model):
    return sum(m.cached_bytes() for m in model.modules() if isinstance(m, nn.LayerNorm))


def check_cached_activations():
    """After a forward, the LayerNorms cache (B, T/t, C): 1/t of tensor parallelism's."""
    held = {}
    for sp in (False, True):
        task, trainer = trainer_for([], sp)
        x, _ = task.to_device(*task.batch(0))
        trainer.model.forward(x)
        held[sp] = ln_bytes(trainer.model), trainer.model.cached_bytes()
        trainer.model.clear_cache()
    (ln_tp, all_tp), (ln_sp, all_sp) = held[False], held[True]
    a = task.args  # (2L + 1) LayerNorms, each caching xhat (B, T, C) and rstd (B, T, 1)
    L, BT = a.n_layers, a.batch_size * a.seq_len
    assert ln_tp == (2 * L + 1) * (BT * a.d_model + BT) * W, ln_tp
    assert ln_sp * t == ln_tp, (ln_sp, ln_tp)
    assert all_tp - all_sp == ln_tp - ln_sp, (all_tp, all_sp, ln_tp, ln_sp)
    if rank == 0:
        C.log(f"LayerNorm caches after a forward: {ln_tp:,} bytes per rank without "
              f"--sequence-parallel, {ln_sp:,} with it (t = {t})")


def check_missing_layernorm_allreduce():
    """The classic mistake: no Allreduce of the LayerNorm gradients. One SGD step: exactly the
    LayerNorm and position parameters leave the serial trajectory."""
    saved = SP.allreduce_sequence_grads
    SP.allreduce_sequence_grads = lambda params, group: None
    try:
        task, trainer = trainer_for(["--optim", "sgd", "--lr", "0.1"])
        trainer.step(0)
    finally:
        SP.allreduce_sequence_grads = saved
    _, ref = serial_run(task, 1)[:2]
    marked = {n for n, p in trainer.model.named_parameters() if hasattr(p, "sequence_parallel")}
    full = trainer.full_params()
    if rank == 0:
        wrong = {n for n, v in full.items() if rel_err(v, ref[n]) > TOL}
        assert wrong == marked, sorted(wrong ^ marked)
        C.log(f"without the LayerNorm Allreduce: {len(wrong)} of {len(full)} parameters "
              f"differ from serial after one step (worst relative error "
              f"{max(rel_err(full[n], ref[n]) for n in wrong):.2g})")


def check_hybrid(layout, extra):
    d, tp, p = layout
    name = f"hybrid dp={d} tp={tp} pp={p} {' '.join(extra)}"
    task = make_task(GPT + ["--dp", str(d), "--tp", str(tp), "--pp", str(p), "--micro-batches",
                            "2", "--sequence-parallel", *extra], "hybrid", N)
    losses, ref = serial_run(task, STEPS)[:2]  # the serial model of the same flags
    trainer = H.Hybrid(task, H.make_grid(d, tp, p), task.args)
    if task.args.recompute:
        recompute.apply(trainer)  # each stage keeps its inputs only and runs its forward again
    args = task.args
    for step in range(STEPS):
        trainer.pp_comm.reset_stats()
        loss = trainer.step(step)
        if world.rank == 0:
            assert abs(loss - losses[step]) <= 1e-12 * abs(losses[step]), (name, step, loss)
    if p > 1:  # one activation (or gradient) of this rank's rows, r*(s/t)*h, plus a header
        rows = sum(r * args.seq_len // tp * args.d_model * W + 80 for r in trainer.micro_rows)
        sent = trainer.pp_comm.total("sent")
        assert sent == rows + 8 * trainer.is_last_stage, (name, sent, rows)
    mine = digest(split_parameters(trainer.stage)[1])
    assert set(trainer.tp_comm.allgather_obj(mine)) == {mine}, f"{name}: tp copies differ"
    full = H.gather_model(task, trainer)
    if world.rank == 0:
        for pname, value in ref.items():
            err = rel_err(full[pname], value)
            assert err <= TOL, f"{name}: {pname} relative error {err:.2e}"


check_equals_serial([], "adam")
check_equals_serial(["--optim", "sgd", "--lr", "0.1"], "sgd")
check_equals_serial(["--update", "master"], "adam, update master")
check_traffic()
check_cached_activations()
if t > 1:
    check_missing_layernorm_allreduce()
if N == 4:
    check_hybrid((1, 2, 2), ["--recompute"])
    check_hybrid((2, 2, 1), ["--bucket-mb", "0.001", "--overlap"])
world.Barrier()
C.log(f"sequence-parallel checks passed on {N} ranks")
sys.exit(0)
