"""Pipeline parallelism: the model cut by layer into consecutive stages, one stage per rank.

    mpirun -n 4 python -m mpipar.pipeline             # GPT on text, 4 stages, 1F1B, 4 micro-batches
    mpirun -n 4 python -m mpipar.pipeline --model mlp --schedule gpipe --micro-batches 8
    mpirun -n 2 python -m mpipar.pipeline --schedule interleaved --chunks 2 --micro-batches 4
    python -m mpipar.pipeline --print-schedule --schedule 1f1b --stages 4 --micro-batches 4

The seed's steps, each under a ``PP Step N`` banner below:

1. Split the model by layer into consecutive stages, one per rank (balanced by FLOPs).
2. The first stage takes the batch and runs forward (on one micro-batch at a time).
3. It passes its output activations to the second stage (Send).
4. Each next stage receives them (Recv), continues forward and passes its output on.
5. The last stage finishes forward and produces the final output (the logits).
6. It computes the loss from the output and starts backpropagation.
7. Backward runs stage by stage in reverse: each stage computes its parameter gradients and
   passes the gradient of its input to the previous stage.
8. When all micro-batches are through, each stage updates its own parameters with the
   gradients it summed over them.
9. The updated parameters already sit on the stage that uses them in the next step, so nothing
   is distributed; they are gathered to rank 0 only to evaluate or save the model.

Micro-batches (GPipe): the batch is cut into m micro-batches so that stages work at the same
time; a schedule from :mod:`mpipar.schedules` (naive, gpipe, 1f1b, interleaved) is a list of
instructions per stage, and :func:`run_pipeline` executes it. Interleaved 1F1B (``--chunks v``)
cuts the model into p*v consecutive pieces instead; rank r holds pieces r, r+p, r+2p, ... as v
chunks, each its own stage module, and every message is tagged with the chunk it goes to:
bubble (p-1)/(v*m+p-1), v times as many messages; m must be a multiple of p.
Every rank computes the global batch from (seed, step) itself: the first stage uses its
inputs, the last stage its targets, so no data or targets travel between stages. The loss
divides by the target count of the WHOLE batch, so the gradients summed over micro-batches
equal the serial gradient exactly.
The batch may not divide by m: micro-batches then differ by one row (comm.split_rows), which
changes nothing in the result, since the loss normaliser is global; m > batch is refused.

Communication per rank per step: for every micro-batch, one activation forward to the next
stage and one gradient back to the previous one, each b/m * (width of the cut) elements
(b/m * s * h for the GPT: Send/Recv, alpha + n*beta each), plus a 80-byte header per message
that carries the micro-batch id, dtype and shape and is checked on arrival. A middle stage
sends and receives 2 * b * s * h * itemsize bytes per step in 4m messages (2m of them headers).

Deadlock freedom: every send is non-blocking (Isend, completed at the end of the step) and
only receives block, so a stage waits only for data a schedule guarantees to come; the tests
rerun everything with synchronous sends (MPIPAR_SSEND=1) to prove it does not rely on MPI's
buffering. Each received micro-batch gets a fresh buffer, because the stage's first layer
caches its input by reference until backward.

References: GPipe, Huang et al. 2019 (arXiv:1811.06965), Sec. 2.2; 1F1B / PipeDream-Flush,
Narayanan et al. 2021 (arXiv:2104.04473), Sec. 2.2; instruction lists after shallowspeed.

Left out on purpose: zero-bubble schedules, activation recomputation, overlapping the next
step's forward with this step's optimizer, and a separate loss-scale for mixed precision.
"""

import argparse
import os
from collections import namedtuple

import numpy as np
from mpi4py import MPI

from mpipar import backend as B
from mpipar import comm, nn, serial
from mpipar.grid import Grid
from mpipar.schedules import (
    CHOICES,
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    bubble_formula,
    format_schedule,
    peak_in_flight,
    stage_schedule,
)
from mpipar.trace import TRACE, gantt

TAG_ACT, TAG_GRAD, TAG_LOSS = 11, 12, 13
CHUNK_TAG = 100  # a message to model chunk c has the tag TAG_ACT or TAG_GRAD + c * CHUNK_TAG
HEADER_LEN = 10  # tag, micro-batch id, dtype code, ndim, up to 6 dims
DEFAULT_TIMELINE = "pipeline-timeline.png"
DRAWN = ("forward", "backward", "optimizer")  # trace kinds on the timeline; the rest is idle


# ----------------------------------------------------------------------------- comm helpers
def send_tensor(pp_comm, a, dest, tag, micro_id):
    """Post a header (tag, micro-batch id, dtype, shape) and then the array; return both
    requests. Non-blocking, so a sender never waits for its receiver."""
    a = B.xp.ascontiguousarray(a)
    if a.ndim > HEADER_LEN - 4:
        raise ValueError(f"cannot send an array of {a.ndim} dimensions (at most {HEADER_LEN - 4})")
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[:4] = tag, micro_id, ord(a.dtype.char), a.ndim
    header[4:4 + a.ndim] = a.shape
    return [pp_comm.Isend(header, dest, tag), pp_comm.Isend(a, dest, tag)]


def recv_tensor(pp_comm, source, tag, micro_id, rows, dtype):
    """Receive the header, check it names the expected micro-batch, dtype and row count, then
    receive the array into a FRESH buffer (the stage caches it by reference until backward)."""
    header = np.empty(HEADER_LEN, dtype=np.int64)
    pp_comm.Recv(header, source, tag)
    got_tag, got_micro, code, ndim = (int(v) for v in header[:4])
    shape = tuple(int(v) for v in header[4:4 + ndim])
    try:
        got_dtype = np.dtype(chr(code))
    except (TypeError, ValueError, OverflowError):  # not a header at all
        got_dtype = f"<dtype code {code}>"
    what = "activation" if tag % CHUNK_TAG == TAG_ACT else "gradient"
    if (got_tag, got_micro, got_dtype) != (tag, micro_id, np.dtype(dtype)) or \
            not shape or shape[0] != rows:
        raise ValueError(
            f"stage {pp_comm.rank} expected the {what} of micro-batch {micro_id} ({rows} rows, "
            f"{np.dtype(dtype)}) from stage {source}, but the header says micro-batch {got_micro}, "
            f"shape {shape}, {got_dtype} (tag {got_tag}): the two stages' schedules disagree")
    buf = B.xp.empty(shape, dtype=dtype)
    pp_comm.Recv(buf, source, tag)
    return buf


# -- PP Step 1: split the model by layer into consecutive stages, one per rank --
def partition(costs, n_stages):
    """Layers per stage: the contiguous cut into n_stages non-empty stages whose most expensive
    stage is as cheap as possible; among such cuts, the one with the most even layer counts.

    Two small dynamic programmes over (stages, layers), O(p n^2): the first finds the least
    possible maximum stage cost, the second the least possible maximum layer count under it.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} non-empty stages")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))
    inf = float("inf")

    def solve(size):
        """best[k][j]: least max size(i, j) over cuts of layers[:j] into k stages; choice: i."""
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, n_stages + 1):
            for j in range(k, n + 1):
                for i in range(k - 1, j):
                    value = max(best[k - 1][i], size(i, j))
                    if value < best[k][j]:
                        best[k][j], choice[k][j] = value, i
        return best, choice

    best, _ = solve(lambda i, j: prefix[j] - prefix[i])
    limit = best[n_stages][n] * (1 + 1e-12)
    _, choice = solve(lambda i, j: (j - i) if prefix[j] - prefix[i] <= limit else inf)
    cuts, j = [n], n
    for k in range(n_stages, 0, -1):
        j = choice[k][j]
        cuts.append(j)
    cuts = cuts[::-1]
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def stage_bounds(counts):
    """[(first layer, end layer)] per stage from layer counts."""
    ends = np.cumsum(counts).tolist()
    return list(zip([0] + ends[:-1], ends))


def build_stage(model, bounds, seed):
    """This rank's stage: its layers, keeping the canonical names and the serial weights."""
    a, b = bounds
    return nn.Sequential(model.layers[a:b]).init(seed)


def plan_stages(task, n_stages, n_micro, partition_arg=None):
    """The layer counts per stage (by FLOPs, or as given), refusing bad input clearly on every
    rank. Returns (counts, per-layer forward FLOPs of one micro-batch)."""
    model = task.build_model()
    names = [name for name, _ in model.layers]
    rows = comm.split_rows(task.args.batch_size, n_micro)[0]
    flops = model.layer_flops(task.input_shape(rows))
    if partition_arg:
        try:
            counts = [int(v) for v in partition_arg.split(",")]
        except ValueError:
            comm.refuse(f"--partition {partition_arg!r}: expected layer counts like 2,1,1")
        if len(counts) != n_stages or min(counts) < 1 or sum(counts) != len(names):
            comm.refuse(f"--partition {partition_arg}: need {n_stages} positive layer counts "
                        f"(one per stage, or per piece, stages x chunks, when interleaved) "
                        f"summing to {len(names)}, the model's layers: "
                        f"{', '.join(names)}")
        return counts, flops
    if n_stages > len(names):
        comm.refuse(f"{n_stages} pipeline stages but the {task.kind} model has only "
                    f"{len(names)} layers ({', '.join(names)}): each stage needs at least one "
                    f"layer, so run with at most {len(names)} ranks (or a deeper model)")
    return partition(flops, n_stages), flops


# -- PP Step 2: the first stage takes the batch (as micro-batches) and runs forward --
def micro_batches(a, n_micro):
    """Cut the rows of a batch into n_micro micro-batches (sizes differ by at most one)."""
    ends = np.cumsum(comm.split_rows(a.shape[0], n_micro)).tolist()
    return [a[s:e] for s, e in zip([0] + ends[:-1], ends)]


StepResult = namedtuple("StepResult", "loss peak_stash_bytes")


def chunks_of(module):
    """The model chunks a rank holds: a list of stage modules (interleaved), else [module]."""
    return list(module) if isinstance(module, (list, tuple)) else [module]


class StageRunner:
    """Executes one stage's instruction list for one training step.

    Any module with nn.Module's ``forward(x, micro_id)`` / ``backward(dout, micro_id)`` can be
    the stage (a tensor-parallel block too); a list of such modules is the stage's model chunks
    (interleaved 1F1B: chunk c of rank r is piece c*p + r of the model). Buffers are keyed by
    (micro-batch id, chunk), because a stage holds several micro-batches in flight.
    """

    def __init__(self, module, pp_comm, micro_rows, inputs=None, targets=None, loss_fn=None,
                 normalizer=None, optimizer=None):
        self.module, self.comm, self.micro_rows = module, pp_comm, micro_rows
        self.chunks = chunks_of(module)
        self.stage, self.n_stages = pp_comm.rank, pp_comm.size
        self.is_first_stage = self.stage == 0
        self.is_last_stage = self.stage == self.n_stages - 1
        self.inputs, self.targets = inputs, targets  # first stage / last stage only
        self.loss_fn, self.normalizer, self.optimizer = loss_fn, normalizer, optimizer
        self.acts_in, self.acts_out = {}, {}  # (micro id, chunk) -> received input / output
        self.grads_in, self.grads_out = {}, {}  # (micro id, chunk) -> output's grad / input's
        self.sends = []  # posted sends, completed at the end of the step
        self.loss = 0.0
        self.peak_stash_bytes = 0

    def first_piece(self, c):
        return self.is_first_stage and c == 0

    def last_piece(self, c):
        return self.is_last_stage and c == len(self.chunks) - 1

    def name(self, k, c):
        return f"micro-batch {k}" + (f" (chunk {c})" if len(self.chunks) > 1 else "")

    def forward(self, k, c=0):
        if self.first_piece(c):
            comm.narrate(f"PP Step 2: stage 0 runs forward on micro-batch {k}")
            x = self.inputs[k]
        else:
            x = self.acts_in.pop((k, c))  # received in Step 4
        self.output(k, c, self.chunks[c].forward(x, k))

    # -- PP Step 3: the stage passes its output activations to the next stage --
    def send_act(self, k, c=0):
        """To the next stage's same chunk; from the last stage to stage 0's next chunk."""
        dest, to = (self.stage + 1, c) if not self.is_last_stage else (0, c + 1)
        comm.narrate(f"PP Step 3: stage {self.stage} sends {self.name(k, c)}'s activations "
                     f"to stage {dest}")
        self.sends += send_tensor(self.comm, self.acts_out.pop((k, c)), dest,
                                  TAG_ACT + to * CHUNK_TAG, k)

    # -- PP Step 4: the next stage receives them and continues the forward pass --
    def recv_act(self, k, c=0):
        source = (self.stage - 1) % self.n_stages
        comm.narrate(f"PP Step 4: stage {self.stage} receives {self.name(k, c)}'s activations "
                     f"from stage {source}, then runs forward on them")
        self.acts_in[k, c] = recv_tensor(self.comm, source, TAG_ACT + c * CHUNK_TAG, k,
                                         self.micro_rows[k], B.dtype)

    # -- PP Step 5: the last stage finishes forward and produces the final output --
    def output(self, k, c, y):
        if self.last_piece(c):
            comm.narrate(f"PP Step 5: stage {self.stage} produced the logits of micro-batch {k}")
            self.compute_loss(k, y)
        else:
            self.acts_out[k, c] = y  # Step 3 sends it

    # -- PP Step 6: compute the loss from the output and start backpropagation --
    def compute_loss(self, k, logits):
        """The loss object caches what its backward needs under k; the normaliser is the
        target count of the whole batch, so the micro-batch losses (and gradients) sum."""
        comm.narrate(f"PP Step 6: stage {self.stage} computes the loss of micro-batch {k}")
        self.loss += self.loss_fn.forward(logits, self.targets[k], self.normalizer, k)

    def output_grad(self, k, c=0):
        """The gradient that starts backward: from the loss on the last piece, else received."""
        if self.last_piece(c):
            return self.loss_fn.backward(1.0, k)
        return self.grads_in.pop((k, c))

    # -- PP Step 7: backward stage by stage; each passes its input's gradient back --
    def recv_grad(self, k, c=0):
        source = (self.stage + 1) % self.n_stages
        comm.narrate(f"PP Step 7: stage {self.stage} receives {self.name(k, c)}'s gradient "
                     f"from stage {source}")
        self.grads_in[k, c] = recv_tensor(self.comm, source, TAG_GRAD + c * CHUNK_TAG, k,
                                          self.micro_rows[k], B.dtype)

    def backward(self, k, c=0):
        comm.narrate(f"PP Step 7: stage {self.stage} runs backward on {self.name(k, c)} "
                     "(parameter gradients accumulate with +=)")
        dx = self.chunks[c].backward(self.output_grad(k, c), k)
        if not self.first_piece(c):
            self.grads_out[k, c] = dx

    def send_grad(self, k, c=0):
        """To the previous stage's same chunk; from stage 0 to the last stage's chunk c-1."""
        dest, to = (self.stage - 1, c) if not self.is_first_stage else (self.n_stages - 1, c - 1)
        comm.narrate(f"PP Step 7: stage {self.stage} sends {self.name(k, c)}'s input gradient "
                     f"to stage {dest}")
        self.sends += send_tensor(self.comm, self.grads_out.pop((k, c)), dest,
                                  TAG_GRAD + to * CHUNK_TAG, k)

    # -- PP Step 8: with every micro-batch through, each stage updates its own parameters --
    def optimizer_step(self, _k=None, _c=0):
        comm.narrate(f"PP Step 8: stage {self.stage} updates its parameters")
        if self.optimizer is not None:
            self.optimizer.step()

    # ---- the interpreter
    HANDLERS = {Forward: forward, Backward: backward, SendAct: send_act, RecvAct: recv_act,
                SendGrad: send_grad, RecvGrad: recv_grad, OptimizerStep: optimizer_step}

    def run(self, instructions):
        """Execute the instructions in order, tracing each one and tracking the stash."""
        for ins in instructions:
            info = {} if ins.micro is None else {"micro": ins.micro}
            with TRACE.span(ins.kind, str(ins), **info):
                self.HANDLERS[type(ins)](self, ins.micro, ins.chunk)
            if isinstance(ins, Forward):  # only a forward adds to the stash
                self.peak_stash_bytes = max(self.peak_stash_bytes,
                                            sum(ch.cached_bytes() for ch in self.chunks))
        for request in self.sends:
            request.wait()
        left = {name: sorted(d) for name, d in (("received activations", self.acts_in),
                                                ("unsent activations", self.acts_out),
                                                ("received gradients", self.grads_in),
                                                ("unsent gradients", self.grads_out)) if d}
        if left:
            raise RuntimeError(f"stage {self.stage}: the schedule left (micro-batch, chunk) "
                               f"behind: {left}")
        return StepResult(self.loss if self.is_last_stage else None, self.peak_stash_bytes)


def run_pipeline(module, instructions, pp_comm, micro_rows, inputs=None, targets=None,
                 loss_fn=None, normalizer=None, optimizer=None, zero_grad=True):
    """One training step of one stage: zero the gradients, run the schedule's instructions.

    ``module``: the stage, or the list of its model chunks (interleaved).
    ``micro_rows[k]``: rows of micro-batch k (every stage knows them, to check each message).
    ``inputs``: the micro-batches of the inputs (first stage); ``targets`` theirs (last stage).
    ``loss_fn``: forward(logits, targets, normalizer, micro_id) / backward(dout, micro_id), as
    nn.SoftmaxCrossEntropy; ``normalizer``: the target count of the whole batch.
    ``optimizer``: anything with ``step()`` (a hybrid scheme can allreduce inside it).
    Returns StepResult(loss summed over micro-batches on the last stage else None, peak bytes
    of activations the module stashed).
    """
    if zero_grad:
        for chunk in chunks_of(module):
            chunk.zero_grad()
    runner = StageRunner(module, pp_comm, micro_rows, inputs, targets, loss_fn, normalizer,
                         optimizer)
    return runner.run(instructions)


def send_loss_to_rank0(pp_comm, loss):
    """The last stage has the loss; rank 0 prints it."""
    last = pp_comm.size - 1
    if last == 0:
        return loss
    if pp_comm.rank == last:
        pp_comm.Send(np.array([loss]), 0, TAG_LOSS)
    elif pp_comm.rank == 0:
        buf = np.empty(1)
        pp_comm.Recv(buf, last, TAG_LOSS)
        return float(buf[0])
    return None


# -- PP Step 9: the parameters stay on their stage; gather them to rank 0 to evaluate or save --
def gather_params(module, pp_comm, root=0):
    """{canonical name: host array} of the WHOLE model on root (None elsewhere), in the model's
    order: each stage's parameters (of all its chunks) flattened into one buffer, one Gatherv."""
    chunks = chunks_of(module)
    named = [pair for chunk in chunks for pair in chunk.named_parameters()]
    flat = (B.xp.concatenate([p.data.reshape(-1) for _, p in named]) if named
            else B.xp.zeros(0, dtype=B.dtype))
    counts = pp_comm.allgather_obj(int(flat.size))
    layout = pp_comm.gather_obj([[(name, p.shape) for name, p in chunk.named_parameters()]
                                 for chunk in chunks], root=root)
    recv = B.xp.empty(sum(counts), dtype=flat.dtype) if pp_comm.rank == root else None
    pp_comm.Gatherv(flat, counts, recv, root=root)
    if pp_comm.rank != root:
        return None
    pieces, offset, host = {}, 0, B.to_numpy(recv)
    for rank, stage_layout in enumerate(layout):
        for c, chunk_layout in enumerate(stage_layout):  # chunk c of rank r: piece c*p + r
            piece = pieces.setdefault(c * pp_comm.size + rank, {})
            for name, shape in chunk_layout:
                size = int(np.prod(shape))
                piece[name] = host[offset:offset + size].reshape(shape)
                offset += size
    return {name: value for x in sorted(pieces) for name, value in pieces[x].items()}


def assemble_model(task, params):
    """A serial model carrying the given {name: array} (for evaluation on rank 0)."""
    model = task.build_model()
    for name, p in model.named_parameters():
        p.name = name
        p.set(params[name])
    return model


# ----------------------------------------------------------------------------- measuring
def step_summary(events):
    """(first forward start, last backward end, busy seconds) of one rank's traced step."""
    spans = [(t0, t1) for t0, t1, kind, _, _ in events if kind in ("forward", "backward")]
    return (min(t0 for t0, _ in spans), max(t1 for _, t1 in spans),
            sum(t1 - t0 for t0, t1 in spans))


def measured_bubble(summaries):
    """Idle share of one step from every rank's summary: 1 - busy / (P * span)."""
    begin = min(s[0] for s in summaries)
    end = max(s[1] for s in summaries)
    return 1.0 - sum(s[2] for s in summaries) / (len(summaries) * (end - begin))


def median_bubble(per_rank_summaries, skip=1):
    """Median over steps (after ``skip`` warm-up steps) of the measured bubble."""
    n_steps = len(per_rank_summaries[0])
    steps = range(min(skip, n_steps - 1), n_steps)
    return float(np.median([measured_bubble([s[i] for s in per_rank_summaries]) for i in steps]))


def median_step(per_rank_summaries, skip=1):
    """The step whose span (first forward to last backward, over all ranks) is the median:
    a typical step to draw, not one that another process happened to interrupt."""
    n_steps = len(per_rank_summaries[0])
    spans = [(max(s[i][1] for s in per_rank_summaries) - min(s[i][0] for s in per_rank_summaries),
              i) for i in range(min(skip, n_steps - 1), n_steps)]
    return sorted(spans)[len(spans) // 2][1]


def _fmt_bytes(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="mpirun -n P python -m mpipar.pipeline",
        description="Train across P pipeline stages (one per rank).")
    serial.add_common_args(ap)
    # the GPT by default, with 4 blocks: embed+block, block, block, block+head balance 4 stages
    for action in ap._actions:
        if action.dest == "model":
            action.default, action.help = "gpt", "gpt (default): character-level GPT; mlp: digits"
        elif action.dest == "n_layers":
            action.default, action.help = 4, "GPT blocks (default 4 here: about one per stage)"
    g = ap.add_argument_group("pipeline")
    g.add_argument("--schedule", default="1f1b", metavar="{" + ",".join(CHOICES) + "}",
                   help="naive, gpipe, 1f1b or interleaved (default 1f1b)")
    g.add_argument("--chunks", type=int, metavar="V",
                   help="model chunks per rank for --schedule interleaved (default 2; the "
                        "model is cut into P*V pieces)")
    g.add_argument("--micro-batches", type=int, default=4, metavar="M",
                   help="micro-batches per step (default 4)")
    g.add_argument("--partition", metavar="N,N,...",
                   help="layers per stage by hand, e.g. 2,1,1 (default: balance the FLOPs)")
    g.add_argument("--timeline", default=DEFAULT_TIMELINE, metavar="FILE.png",
                   help="Gantt chart of a real step's trace, the median step by duration "
                        f"(default {DEFAULT_TIMELINE}; 'none' for no chart)")
    g.add_argument("--explain", action="store_true",
                   help="narrate every MPI call and step of the first training step")
    g.add_argument("--print-schedule", action="store_true",
                   help="print every stage's instruction list and exit (no MPI ranks needed)")
    g.add_argument("--stages", type=int, default=4,
                   help="number of stages for --print-schedule (default 4)")
    args = ap.parse_args(argv)
    if args.schedule not in CHOICES:
        comm.refuse(f"unknown --schedule {args.schedule!r}: choose one of {', '.join(CHOICES)}")
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    elif args.schedule != "interleaved" and args.chunks != 1:
        comm.refuse(f"--chunks {args.chunks} needs --schedule interleaved ({args.schedule} "
                    "runs one model chunk per rank)")
    if args.chunks <= 0:
        comm.refuse(f"--chunks must be positive, got {args.chunks}")
    if args.micro_batches <= 0:
        comm.refuse(f"--micro-batches must be positive, got {args.micro_batches}")
    return args


def main(argv=None):
    comm.install_excepthook()
    args = parse_args(argv)
    if args.print_schedule:
        if args.stages <= 0:
            comm.refuse(f"--stages must be positive, got {args.stages}")
        if args.schedule == "interleaved" and args.micro_batches % args.stages:
            comm.refuse(f"--schedule interleaved needs --micro-batches ({args.micro_batches}) "
                        f"to be a multiple of the stages ({args.stages})")
        comm.log(format_schedule(args.schedule, args.stages, args.micro_batches, args.chunks))
        return
    args = serial.finish_args(args)
    if args.micro_batches > args.batch_size:
        comm.refuse(f"--micro-batches {args.micro_batches} exceeds --batch-size "
                    f"{args.batch_size}: a micro-batch would be empty")

    grid = Grid(pp=MPI.COMM_WORLD.Get_size())  # a pure pipeline: every rank is one stage
    pp_comm = grid.pp_comm
    n_stages, stage_id, m, v = pp_comm.size, pp_comm.rank, args.micro_batches, args.chunks
    is_first_stage, is_last_stage = stage_id == 0, stage_id == n_stages - 1
    task = serial.Task(args)
    model = task.build_model()
    if v > 1:
        if m % n_stages:
            comm.refuse(f"--schedule interleaved needs --micro-batches ({m}) to be a multiple "
                        f"of the stages ({n_stages})")
        if n_stages * v > len(model.layers):
            comm.refuse(f"{n_stages} stages x {v} chunks = {n_stages * v} model pieces but the "
                        f"{task.kind} model has only {len(model.layers)} layers: use fewer "
                        "--chunks or ranks (or a deeper model)")
    counts, flops = plan_stages(task, n_stages * v, m, args.partition)
    bounds = stage_bounds(counts)  # piece x = c*p + r is chunk c of rank r
    comm.EXPLAIN = args.explain
    mine = [c * n_stages + stage_id for c in range(v)]
    comm.narrate(f"PP Step 1: stage {stage_id} holds layers " + "; ".join(
        f"{bounds[x][0]}..{bounds[x][1] - 1}" for x in mine) + f" of {len(model.layers)}: "
        + ", ".join(name for x in mine for name, _ in model.layers[slice(*bounds[x])]))
    chunks = [build_stage(model, bounds[x], args.seed) for x in mine]
    stage = chunks[0] if v == 1 else chunks
    opt = serial.make_optimizer(args, [p for chunk in chunks for p in chunk.parameters()])
    instructions = stage_schedule(args.schedule, n_stages, stage_id, m, v)
    micro_rows = comm.split_rows(args.batch_size, m)

    n_params = sum(p.size for p in model.parameters())
    rows = "/".join(map(str, sorted(set(micro_rows), reverse=True)))
    comm.log(f"pipeline: {args.model} with {n_params:,} parameters on {n_stages} stages, "
             f"schedule {args.schedule}" + (f" with {v} chunks per stage" if v > 1 else "")
             + f", {m} micro-batches of {rows} rows, {args.steps} steps "
             f"of batch {args.batch_size}, {args.optim} lr {args.lr}, {args.dtype}")
    total = sum(flops)
    for x, (a, b) in enumerate(bounds):
        names = ", ".join(name for name, _ in model.layers[a:b])
        where = f"stage {x} (rank {x})" if v == 1 else \
            f"piece {x} (rank {x % n_stages}, chunk {x // n_stages})"
        comm.log(f"  {where}: {names:<34} {sum(flops[a:b]) / 1e6:8.2f} MFLOP "
                 f"forward per micro-batch ({sum(flops[a:b]) / max(total, 1):4.0%})")

    bar = serial.progress(args.steps, "pipeline", args.quiet or pp_comm.rank != 0)
    summaries, step_events, peak_stash, loss = [], [], 0, None
    for step in bar:
        comm.EXPLAIN = args.explain and step == 0
        TRACE.clear()
        x, y = task.to_device(*task.batch(step))  # every rank computes the global batch
        result = run_pipeline(
            stage, instructions, pp_comm, micro_rows,
            inputs=micro_batches(x, m) if is_first_stage else None,
            targets=micro_batches(y, m) if is_last_stage else None,
            loss_fn=task.loss_fn, normalizer=y.size, optimizer=opt)
        summaries.append(step_summary(TRACE.events))
        step_events.append([e for e in TRACE.events if e[2] in DRAWN])
        peak_stash = max(peak_stash, result.peak_stash_bytes)
        loss = send_loss_to_rank0(pp_comm, result.loss)
        if pp_comm.rank == 0:
            bar.set_postfix(loss=f"{loss:.4f}")
            if args.log_every and (step + 1) % args.log_every == 0:
                bar.write(f"step {step + 1:5d}  loss {loss:.4f}")
    comm.EXPLAIN = False

    all_summaries = pp_comm.gather_obj(summaries)
    peaks = pp_comm.gather_obj(peak_stash)
    step_events = pp_comm.gather_obj(step_events)
    comm.EXPLAIN = args.explain
    comm.narrate("PP Step 9: the parameters stay on their stage; gather them to rank 0 only to "
                 "evaluate" + (" and save" if args.save_params else ""))
    params = gather_params(stage, pp_comm)
    comm.EXPLAIN = False
    in_flight = [peak_in_flight(stage_schedule(args.schedule, n_stages, s, m, v))
                 for s in range(n_stages)]
    if pp_comm.rank != 0:
        return
    full = assemble_model(task, params)
    print(serial.report(task.evaluate(full.forward), loss), flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    oversubscribed = f" ({n_stages} ranks on {cores} cores)" if n_stages > cores else ""
    steps = f"steps 2..{args.steps}" if args.steps > 2 else \
        ("step 2" if args.steps == 2 else "step 1, the only one")
    print(f"bubble measured from the trace {median_bubble(all_summaries):.3f} (median over "
          f"{steps}), " + ("(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)")
          + f" = {bubble_formula(n_stages, m, args.schedule, v):.3f}"
          f"{oversubscribed}", flush=True)
    print("peak activation stash per stage: " + ", ".join(
        f"{_fmt_bytes(b)} ({k} {'chunk ' if v > 1 else ''}micro-batch{'es' if k > 1 else ''})"
        for b, k in zip(peaks, in_flight)), flush=True)
    if args.timeline and args.timeline.lower() != "none":
        i = median_step(all_summaries)
        title = (f"{args.model}, {args.schedule}, {n_stages} stages"
                 + (f" x {v} chunks" if v > 1 else "") + f", {m} micro-batches: step "
                 f"{i + 1} of {args.steps}, the median step by duration")
        gantt([events[i] for events in step_events], args.timeline, title=title)
        print(f"timeline of step {i + 1} (the median by duration): "
              f"{os.path.abspath(args.timeline)}", flush=True)
    if args.save_params:
        serial.save_params(args.save_params, params.items())
        print(f"saved parameters to {args.save_params}", flush=True)


if __name__ == "__main__":
    main()
