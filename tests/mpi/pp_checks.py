"""mpirun -n P python tests/mpi/pp_checks.py [--quick]: the pipeline against the serial trainer.

For every schedule x micro-batch count x model (an MLP of 9 layers, a GPT of 5), float64:
the loss of every step and every parameter after 3 steps equal the serial trainer's (relative
error <= 1e-10); the peak stash of activations each stage measures equals the schedule's
peak number of micro-batches in flight times the stash of one micro-batch; the parameters
gathered to rank 0 are the whole serial model. ZB-H1 (B and W apart) also ends with exactly
1F1B's parameters, bit for bit (the same arithmetic, the gradients summed in the same order),
and its stash is predicted instruction by instruction (schedules.peak_stash): a forward adds
one micro-batch's stash, its B swaps that for what its W needs (both measured on one
micro-batch), its W frees it. Interleaved 1F1B (2 chunks per rank, m in {4, 8}, on 2 and 4
ranks, the GPT with 6 blocks so that 4 ranks get 8 pieces): the same, with the stash
predicted chunk by chunk. Also: a hand-set --partition, the header check of a
message, and (on one rank) the partition by FLOPs. --quick runs a subset.
"""

import itertools
import sys

import numpy as np
from reference import make_task, serial_run

from mpipar import pipeline as PP
from mpipar import serial
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.parts import plan
from mpipar.parts.schedules import (
    SCHEDULES,
    SPLIT,
    Backward,
    Forward,
    interleaved,
    peak_in_flight,
    peak_stash,
    stage_schedule,
)

C.install_excepthook()
quick = "--quick" in sys.argv
grid = Grid(pp=C.world().size)
pp = grid.pp_comm
P, r = pp.size, pp.rank
STEPS = 3
MODELS = {
    "mlp": ["--model", "mlp", "--sizes", "64,16,16,16,16,10", "--batch-size", "10"],
    "gpt": ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "3",
            "--seq-len", "8", "--batch-size", "8"],
}


def stash_of_one_micro_batch(task, bounds, m, after_b=False):
    """Bytes a fresh copy of this stage caches for micro-batch 0 alone (serial probe): after
    its forward, or ``after_b``, after its B too (what its W needs)."""
    model = task.build_model().init(task.args.seed)
    x, _ = task.to_device(*task.batch(0))
    a = PP.micro_batches(x, m)[0]
    for _, layer in model.layers[:bounds[0]]:
        a = layer.forward(a, 0)
    probe = PP.build_stage(task.build_model(), bounds, task.args.seed)
    y = probe.forward(a, 0)
    if after_b:
        probe.backward_input(np.ones_like(y), 0)
    return probe.cached_bytes()


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def train_and_compare(name, task, held, instructions, m, ref_losses, ref_params,
                      placement="loop"):
    """STEPS steps of this rank's part of the pipeline (``held``: one stage module, or the list
    of its chunks): every step's loss and, after them, every parameter equal the serial
    trainer's (the loss is on the last piece's rank: P-1, or 0 in a V). Returns the most
    activation bytes the part stashed at once."""
    last = 0 if placement == "v" else P - 1
    pieces = held if isinstance(held, list) else [held]
    opt = serial.make_optimizer(task.args, [p for piece in pieces for p in piece.parameters()])
    micro_rows = C.split_rows(task.args.batch_size, m)
    peak = 0
    for step in range(STEPS):
        x, y = task.to_device(*task.batch(step))
        result = PP.run_pipeline(
            held, instructions, pp, micro_rows,
            inputs=PP.micro_batches(x, m) if r == 0 else None,
            targets=PP.micro_batches(y, m) if r == last else None,
            loss_fn=task.loss_fn, normalizer=y.size, optimizer=opt, placement=placement)
        peak = max(peak, result.peak_stash_bytes)
        if r == last:
            assert abs(result.loss - ref_losses[step]) <= 1e-10 * abs(ref_losses[step]), \
                (name, step, result.loss, ref_losses[step])
        assert sum(piece.cached_bytes() for piece in pieces) == 0, \
            (name, "activations left in the cache")
    for piece in pieces:
        for pname, p in piece.named_parameters():
            err = rel_err(B.to_numpy(p.data), ref_params[pname])
            assert err <= 1e-10, f"{name}: rank {r} {pname} relative error {err:.2e}"
    return peak


def check_gathered(name, held, ref_params, placement="loop"):
    """The whole model gathered to rank 0 is the serial one, under the serial names, in order."""
    full = PP.gather_params(held, pp, placement=placement)
    if r == 0:
        assert list(full) == list(ref_params), (list(full), list(ref_params))
        for pname, value in full.items():
            assert rel_err(value, ref_params[pname]) <= 1e-10, (name, pname)
    else:
        assert full is None


def check(task, ref_losses, ref_params, schedule, m, partition=None, gather=False):
    """One schedule against the serial trainer; returns this rank's trained stage."""
    name = f"{task.kind} {schedule} m={m} partition={partition}"
    counts, _ = plan.plan_stages(task, P, m, partition)
    bounds = plan.stage_bounds(counts)[r]
    stage = PP.build_stage(task.build_model(), bounds, task.args.seed)
    instructions = stage_schedule(schedule, P, r, m)
    peak = train_and_compare(name, task, stage, instructions, m, ref_losses, ref_params)
    if task.args.batch_size % m == 0 and schedule not in SPLIT:  # the prediction is a product
        want = peak_in_flight(instructions) * stash_of_one_micro_batch(task, bounds, m)
        assert peak == want, f"{name}: rank {r} stashed {peak} bytes, schedule predicts {want}"
    elif task.args.batch_size % m == 0:  # each micro-batch in flight held until its W
        stash_f, stash_w = (stash_of_one_micro_batch(task, bounds, m, b) for b in (False, True))
        want = peak_stash(instructions, stash_f, stash_w)
        assert peak == want > 0, f"{name}: rank {r} stashed {peak} bytes, schedule predicts {want}"
        assert peak_in_flight(instructions) == min(P, m), name
    if gather:
        check_gathered(name, stage, ref_params)
    return stage


def check_zero_bubble(task, ref_losses, ref_params, m):
    """ZB-H1 against the serial trainer, and bit for bit against 1F1B's parameters."""
    one_f_one_b = check(task, ref_losses, ref_params, "1f1b", m)
    zb = check(task, ref_losses, ref_params, "zb-h1", m, gather=m == 2)
    for (pname, a), (_, b) in zip(one_f_one_b.named_parameters(), zb.named_parameters()):
        assert np.array_equal(B.to_numpy(a.data), B.to_numpy(b.data)), \
            f"{task.kind} zb-h1 m={m}: rank {r} {pname} differs from 1F1B's"


def check_interleaved(task, ref_losses, ref_params, m, v=2, warmup="production"):
    """Interleaved 1F1B: the model in P*v pieces, chunk c of this rank is piece c*P + r."""
    name = f"{task.kind} interleaved v={v} m={m} {warmup} warm-up"
    counts, _ = plan.plan_stages(task, P * v, m)
    bounds = plan.stage_bounds(counts)
    mine = [bounds[c * P + r] for c in range(v)]
    chunks = [PP.build_stage(task.build_model(), b, task.args.seed) for b in mine]
    instructions = interleaved(P, r, m, v, warmup)
    peak = train_and_compare(name, task, chunks, instructions, m, ref_losses, ref_params)
    if task.args.batch_size % m == 0:  # the most bytes the chunks in flight stash at once
        one = [stash_of_one_micro_batch(task, b, m) for b in mine]
        held, want = 0, 0
        for ins in instructions:
            held += one[ins.chunk] * (isinstance(ins, Forward) - isinstance(ins, Backward))
            want = max(want, held)
        assert peak == want > 0, f"{name}: rank {r} stashed {peak} bytes, schedule predicts {want}"
    check_gathered(name, chunks, ref_params)


def check_v_shaped(task, ref_losses, ref_params, m, schedule):
    """ZB-V and DualPipeV: the model in 2P pieces, rank r holding pieces r and 2P-1-r; equal to
    the serial trainer, and bit for bit 1F1B's parameters: every layer adds the micro-batches'
    gradients in the same order (0 to m-1) from the same activations."""
    name = f"{task.kind} {schedule} m={m}"
    counts, _ = plan.plan_stages(task, 2 * P, m)
    bounds = plan.stage_bounds(counts)
    chunks = [PP.build_stage(task.build_model(), bounds[x], task.args.seed)
              for x in (r, 2 * P - 1 - r)]
    train_and_compare(name, task, chunks, stage_schedule(schedule, P, r, m, 2), m, ref_losses,
                      ref_params, placement="v")
    check_gathered(name, chunks, ref_params, placement="v")
    return PP.gather_params(chunks, pp, placement="v")  # the whole model on rank 0


def check_partition():
    """The FLOPs partition on its own (pure function; checked once, on one rank)."""
    assert plan.partition([1, 1, 1, 1], 2) == [2, 2]
    assert plan.partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]  # the big layer alone
    assert plan.partition([0, 3, 3, 3, 3, 1], 4) == [2, 1, 1, 2]
    assert plan.partition([0, 0, 0, 0, 0, 0], 3) == [2, 2, 2]  # ties: even layer counts
    assert plan.partition([7], 1) == [1]
    costs = np.random.default_rng(0).integers(0, 100, 9)
    for p in range(1, 10):  # against brute force over every cut
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (9,)))
                   for cut in itertools.combinations(range(1, 9), p - 1))
        counts = plan.partition(costs, p)
        ends = np.cumsum(counts)
        assert len(counts) == p and min(counts) >= 1 and ends[-1] == 9
        assert max(sum(costs[a:b]) for a, b in zip([0, *ends[:-1]], ends)) == best
    try:
        plan.partition([1, 2], 3)
    except ValueError:
        pass
    else:
        raise AssertionError("3 stages of 2 layers accepted")


def check_header():
    """A message of another micro-batch than the receiver expects fails clearly."""
    if r == 0:
        for request in PP.send_tensor(pp, np.ones((3, 2)), 1, PP.TAG_ACT, micro_id=5):
            request.wait()
    elif r == 1:
        try:
            PP.recv_tensor(pp, 0, PP.TAG_ACT, micro_id=4, rows=3, dtype=np.float64)
        except ValueError as err:
            assert "micro-batch 4" in str(err) and "micro-batch 5" in str(err), err
        else:
            raise AssertionError("a wrong micro-batch id was accepted")
        pp.Recv(np.empty((3, 2)), 0, PP.TAG_ACT)  # drain the payload
    pp.Barrier()
    # a header of another length (8 numbers where 10 are expected), and a payload of another
    # size than its header names (3 x 1 where 3 x 2 is announced): each named, never used
    header = np.zeros(PP.HEADER_LEN, dtype=np.int64)
    header[:6] = PP.TAG_ACT, 4, ord("d"), 2, 3, 2
    if r == 0:
        pp.Send(header[:8].copy(), 1, PP.TAG_ACT)
        pp.Send(header, 1, PP.TAG_ACT)
        pp.Send(np.ones((3, 1)), 1, PP.TAG_ACT)
    elif r == 1:
        for expect in ("got 64 bytes", "got 24 bytes"):  # the short header, the short payload
            try:
                PP.recv_tensor(pp, 0, PP.TAG_ACT, micro_id=4, rows=3, dtype=np.float64)
            except ValueError as err:
                assert f"Recv from 0: {expect}" in str(err) and "expects" in str(err), err
            else:
                raise AssertionError(f"a message that {expect} was accepted")
    pp.Barrier()


B.use("numpy", "float64")
if P == 1:
    check_partition()
if P >= 2:
    check_header()
schedules = ["gpipe", "1f1b"] if quick else list(SCHEDULES)
micro_counts = [1, 4] if quick else [1, 2, 4, 8]
for flags in MODELS.values():
    task = make_task(flags + ["--dtype", "float64", "--steps", "3"])
    ref_losses, ref_params, _ = serial_run(task, STEPS)
    for schedule in schedules:
        for m in micro_counts:
            check(task, ref_losses, ref_params, schedule, m, gather=(schedule, m) == ("1f1b", 2))
    for m in micro_counts:
        check_zero_bubble(task, ref_losses, ref_params, m)
    n_layers = len(task.build_model().layers)
    by_hand = ",".join(map(str, [n_layers - P + 1] + [1] * (P - 1)))  # all but P-1 on stage 0
    check(task, ref_losses, ref_params, "1f1b", 2, partition=by_hand, gather=True)
if P in (2, 4):
    deep_gpt = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "6",
                "--seq-len", "8", "--batch-size", "8"]
    for flags in (MODELS["mlp"], deep_gpt):
        task = make_task(flags + ["--dtype", "float64", "--steps", "3"])
        ref_losses, ref_params, _ = serial_run(task, STEPS)
        for m in (4, 8):
            for warmup in ("production", "lean"):
                check_interleaved(task, ref_losses, ref_params, m, warmup=warmup)
        for m in sorted({2 * P, 2 * P + 1, 3 * P}):
            v_params = [check_v_shaped(task, ref_losses, ref_params, m, name)
                        for name in ("zb-v", "dualpipev")]
            one_f = PP.gather_params(check(task, ref_losses, ref_params, "1f1b", m), pp)
            for got in v_params if r == 0 else []:  # the same bits as 1F1B's, every layer
                assert all(np.array_equal(got[n], one_f[n]) for n in one_f), (task.kind, m)
        check_v_shaped(task, ref_losses, ref_params, 2 * P - 1, "zb-v")  # fewer than 2P
C.log(f"pp checks passed on {P} ranks")
