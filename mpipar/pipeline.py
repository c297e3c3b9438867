"""Pipeline parallelism: the model cut by layer into consecutive stages, one stage per rank.

    mpirun -n 4 python -m mpipar.pipeline             # GPT on text, 4 stages, 1F1B, 4 micro-batches
    mpirun -n 4 python -m mpipar.pipeline --model mlp --schedule gpipe --micro-batches 8
    mpirun -n 2 python -m mpipar.pipeline --schedule interleaved --chunks 2 --micro-batches 4
    mpirun -n 4 python -m mpipar.pipeline --schedule zb-h1 --micro-batches 8
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
time; a schedule from :mod:`mpipar.parts.schedules` (naive, gpipe, 1f1b, interleaved, zb-h1) is a
list of instructions per stage, and :func:`run_pipeline` executes it. Interleaved 1F1B
(``--chunks v``) cuts the model into p*v consecutive pieces instead; rank r holds pieces r,
r+p, r+2p, ... as v chunks, each its own stage module, and every message is tagged with the
chunk it goes to: bubble (p-1)/(v*m+p-1), v times as many messages; m must be a multiple of p.
Zero bubble (``--schedule zb-h1``, Qi et al. 2024): Step 7 in two parts. B computes the input's
gradient and sends it at once; W, the parameters' gradients, which nobody downstream waits
for, runs later to fill the idle time (``nn.SplitBackward``): bubble (p-1)/(3m+p-1) when F, B
and W take equal times, a third of 1F1B's, with 1F1B's messages, for min(p, m) micro-batches
stashed on every stage (a micro-batch is held from its forward to its W).
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
The last stage then sends the step's loss (8 bytes) to each other stage.

Deadlock freedom: every send is non-blocking (Isend, completed at the end of the step) and
only receives block, so a stage waits only for data a schedule guarantees to come; the tests
rerun everything with synchronous sends (MPIPAR_SSEND=1) to prove it does not rely on MPI's
buffering. Each received micro-batch gets a fresh buffer, because the stage's first layer
caches its input by reference until backward.

References: GPipe, Huang et al. 2019 (arXiv:1811.06965), Sec. 2.2; 1F1B / PipeDream-Flush,
Narayanan et al. 2021 (arXiv:2104.04473), Sec. 2.2; ZB-H1, Qi et al. 2024 (arXiv:2401.10241),
Sec. 2-3.1; instruction lists after shallowspeed.

Left out on purpose: the other zero-bubble schedules (ZB-H2, which stashes more to leave no
bubble at all; the paper's automatic schedules; ZB-V, two chunks per stage) and the paper's
optimizer step that does not wait for a global check (its post-validation); overlapping the
next step's forward with this step's optimizer.
"""

from collections import namedtuple

import numpy as np

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.engine import nn, precision
from mpipar.engine.parameters import place
from mpipar.mpi import comm
from mpipar.mpi.trace import TRACE
from mpipar.parts.plan import plan_stages, stage_bounds
from mpipar.parts.schedules import (
    Backward,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    holder,
    neighbour,
    piece_of,
    placement_of,
    stage_schedule,
)
from mpipar.runner.trainer import Trainer

TAG_ACT, TAG_GRAD, TAG_LOSS = 11, 12, 13
CHUNK_TAG = 100  # a message to model chunk c has the tag TAG_ACT or TAG_GRAD + c * CHUNK_TAG
HEADER_LEN = 10  # tag, micro-batch id, dtype code, ndim, up to 6 dims


# ----------------------------------------------------------------------------- comm helpers
def send_tensor(pp_comm, a, dest, tag, micro_id, what="a tensor"):
    """Post a header (tag, micro-batch id, dtype, shape) and then the array; return both
    requests. Non-blocking, so a sender never waits for its receiver."""
    a = B.xp.ascontiguousarray(a)
    if a.ndim > HEADER_LEN - 4:
        raise ValueError(f"cannot send an array of {a.ndim} dimensions (at most {HEADER_LEN - 4})")
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[:4] = tag, micro_id, ord(a.dtype.char), a.ndim
    header[4:4 + a.ndim] = a.shape
    return [pp_comm.Isend(header, dest, tag, what=f"header of {what}"),
            pp_comm.Isend(a, dest, tag, what=what)]


def dtype_of_code(code):
    """The NumPy dtype a header's code names, or a description of a code that names none (bf16's
    'E' names nothing to np.dtype: it is recognised as the expected dtype's own code)."""
    try:
        return np.dtype(chr(code))
    except (TypeError, ValueError, OverflowError):  # not a header at all
        return f"<dtype code {code}>"


def recv_tensor(pp_comm, source, tag, micro_id, rows, dtype, what="a tensor"):
    """Receive the header, check it names the expected micro-batch, dtype and row count, then
    receive the array into a FRESH buffer (the stage caches it by reference until backward)."""
    header = np.empty(HEADER_LEN, dtype=np.int64)
    pp_comm.Recv(header, source, tag, what=f"header of {what}")
    got_tag, got_micro, code, ndim = (int(v) for v in header[:4])
    shape = tuple(int(v) for v in header[4:4 + ndim])
    got_dtype = np.dtype(dtype) if code == ord(np.dtype(dtype).char) else dtype_of_code(code)
    kind = "activation" if tag % CHUNK_TAG == TAG_ACT else "gradient"
    if (got_tag, got_micro, got_dtype) != (tag, micro_id, np.dtype(dtype)) or \
            not shape or shape[0] != rows:
        raise ValueError(
            f"stage {pp_comm.rank} expected the {kind} of micro-batch {micro_id} ({rows} rows, "
            f"{np.dtype(dtype)}) from stage {source}, but the header says micro-batch {got_micro}, "
            f"shape {shape}, {got_dtype} (tag {got_tag}): the two stages' schedules disagree")
    buf = B.xp.empty(shape, dtype=dtype)
    pp_comm.Recv(buf, source, tag, what=what)
    return buf


# ----------------------------------------------------------------------------- the scheme
class Pipeline(Trainer):
    """One stage of the pipeline (one rank). ``__init__`` is Step 1; :meth:`step` runs the
    schedule's instructions, which carry out Steps 2 to 8 for one global batch."""

    def __init__(self, task, grid, args):
        self.task, self.comm = task, grid.pp_comm
        self.schedule, self.n_micro, self.n_chunks = args.schedule, args.micro_batches, args.chunks
        self.warmup = args.warmup or "production"  # (interleaved only)
        v, self.placement = self.n_chunks, placement_of(args.schedule)
        p, stage = self.comm.size, self.comm.rank
        self.is_first_stage = stage == 0  # the first piece's (and in a V, the last piece's)
        self.is_last_stage = holder(self.placement, p, p * v - 1)[0] == stage  # the loss's

        # -- PP Step 1: split the model by layer into consecutive stages, one per rank --
        counts, self.flops = plan_stages(task, p * v, self.n_micro, args.partition)
        self.bounds = stage_bounds(counts)  # piece x: chunk c of rank r, as the placement says
        model = task.build_model()
        mine = [piece_of(self.placement, p, stage, c) for c in range(v)]
        names = [name for x in mine for name, _ in model.layers[slice(*self.bounds[x])]]
        comm.narrate(f"PP Step 1: stage {stage} holds layers " + "; ".join(
            f"{self.bounds[x][0]}..{self.bounds[x][1] - 1}" for x in mine)
            + f" of {len(model.layers)}: {', '.join(names)}")
        chunks = [build_stage(model, self.bounds[x], args.seed) for x in mine]
        self.module = chunks[0] if v == 1 else chunks
        self.loss_fn = task.loss_fn if self.is_last_stage else None
        params = place([p for chunk in chunks for p in chunk.parameters()], split=[self.comm])
        self.opt = serial.make_optimizer(args, params)
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None
        self.update = self.opt if self.scaler is None else precision.Guarded(
            self.opt, self.scaler, lambda bad: comm.any_rank(
                self.comm, bad, "did any stage's gradients overflow?"))
        self.instructions = self.schedule_of(stage)
        self.micro_rows = comm.split_rows(args.batch_size, self.n_micro)
        self.peak_stash_bytes = 0

    def schedule_of(self, stage):
        """A stage's instruction list (pure: the report asks for every stage's)."""
        return stage_schedule(self.schedule, self.comm.size, stage, self.n_micro, self.n_chunks,
                              self.warmup)

    def step(self, step):
        x, y = self.task.to_device(*self.task.batch(step))  # every rank makes the global batch
        m = self.n_micro
        result = run_pipeline(
            self.module, self.instructions, self.comm, self.micro_rows,
            inputs=micro_batches(x, m) if self.is_first_stage else None,
            targets=micro_batches(y, m) if self.is_last_stage else None,
            loss_fn=self.loss_fn, normalizer=y.size, optimizer=self.update,
            measure_stash=not self.peak_stash_bytes,  # the first step's is every step's
            loss_scale=precision.scale_of(self.scaler),
            placement=self.placement)
        self.peak_stash_bytes = max(self.peak_stash_bytes, result.peak_stash_bytes)
        return share_loss(self.comm, result.loss, holder(self.placement, self.comm.size,
                                                         self.comm.size * self.n_chunks - 1)[0])

    def parameters(self):
        return self.opt.params

    def split_groups(self):
        return [self.comm]  # a stage without parameters still adds its zero to a norm

    def units(self):
        return chunks_of(self.module)  # a stage (each model chunk) runs whole

    def wrap_units(self, wrap):
        self.module = wrap(self.module) if self.n_chunks == 1 else [wrap(c) for c in self.module]

    def full_params(self):
        comm.narrate("PP Step 9: the parameters stay on their stage; gather them to rank 0 only "
                     "to evaluate or save")
        return gather_params(self.module, self.comm, placement=self.placement)


def build_stage(model, bounds, seed):
    """This rank's stage: its layers, keeping the canonical names and the serial weights."""
    a, b = bounds
    return nn.Sequential(model.layers[a:b]).init(seed)


def micro_batches(a, n_micro):
    """Cut the rows of a batch into n_micro micro-batches (sizes differ by at most one)."""
    # -- PP Step 2: the first stage takes the batch (as micro-batches) and runs forward --
    rows = comm.split_rows(a.shape[0], n_micro)
    return [a[lo:lo + n] for lo, n in zip(comm.offsets(rows), rows)]


StepResult = namedtuple("StepResult", "loss peak_stash_bytes")


def chunks_of(module):
    """The model chunks a rank holds: a list of stage modules (interleaved), else [module]."""
    return list(module) if isinstance(module, (list, tuple)) else [module]


class StageRunner:
    """Executes one stage's instruction list for one training step.

    Any module with nn.Module's ``forward(x, micro_id)`` / ``backward(dout, micro_id)`` can be
    the stage (a tensor-parallel block too; a schedule with W instructions calls its
    ``backward_input`` and ``backward_weight`` instead, the two parts of nn.SplitBackward);
    a list of such modules is the stage's model chunks, placed as ``placement`` says
    (:func:`mpipar.parts.schedules.piece_of`: interleaved 1F1B's chunk c of rank r is piece
    c*p + r; a V's chunks are pieces r and 2p-1-r). Buffers are keyed by (micro-batch id,
    chunk), because a stage holds several micro-batches in flight; an output for the next
    piece on the same rank goes straight into its input buffer, without a message.
    """

    def __init__(self, module, pp_comm, micro_rows, inputs=None, targets=None, loss_fn=None,
                 normalizer=None, optimizer=None, loss_scale=1.0, placement="loop"):
        self.module, self.comm, self.micro_rows = module, pp_comm, micro_rows
        self.chunks = chunks_of(module)
        self.stage, self.n_stages = pp_comm.rank, pp_comm.size
        self.placement = placement
        self.is_first_stage = self.stage == 0
        self.inputs, self.targets = inputs, targets  # first stage / last stage only
        self.loss_fn, self.normalizer, self.optimizer = loss_fn, normalizer, optimizer
        self.loss_scale = loss_scale  # fp16: backward starts from the loss times it
        self.acts_in, self.acts_out = {}, {}  # (micro id, chunk) -> received input / output
        self.grads_in, self.grads_out = {}, {}  # (micro id, chunk) -> output's grad / input's
        self.sends = []  # posted sends, completed at the end of the step
        self.split = set()  # (micro id, chunk) whose B and W run apart: those with a W
        self.loss = 0.0
        self.peak_stash_bytes = 0

    def next_of(self, c, step):
        """The (rank, chunk) of the piece ``step`` after chunk c's, or None past the model."""
        return neighbour(self.placement, self.n_stages, len(self.chunks), self.stage, c, step)

    def first_piece(self, c):
        return self.next_of(c, -1) is None

    def last_piece(self, c):
        return self.next_of(c, 1) is None

    def name(self, k, c):
        return f"micro-batch {k}" + (f" (chunk {c})" if len(self.chunks) > 1 else "")

    def forward(self, k, c=0):
        if self.first_piece(c):
            comm.narrate(f"PP Step 2: stage 0 runs forward on micro-batch {k}")
            x = self.inputs[k]
        else:
            x = self.acts_in.pop((k, c))  # received in Step 4
        self.output(k, c, self.chunks[c].forward(x, k))

    def send_act(self, k, c=0):
        """To the rank and chunk of the next piece (:meth:`next_of`)."""
        # -- PP Step 3: the stage passes its output activations to the next stage --
        dest, to = self.next_of(c, 1)
        comm.narrate(f"PP Step 3: stage {self.stage} sends {self.name(k, c)}'s activations "
                     f"to stage {dest}")
        self.sends += send_tensor(self.comm, self.acts_out.pop((k, c)), dest,
                                  TAG_ACT + to * CHUNK_TAG, k, f"{self.name(k, c)}'s activations")

    def recv_act(self, k, c=0):
        # -- PP Step 4: the next stage receives them and continues the forward pass --
        source, _ = self.next_of(c, -1)
        comm.narrate(f"PP Step 4: stage {self.stage} receives {self.name(k, c)}'s activations "
                     f"from stage {source}, then runs forward on them")
        self.acts_in[k, c] = recv_tensor(self.comm, source, TAG_ACT + c * CHUNK_TAG, k,
                                         self.micro_rows[k], B.dtype,
                                         f"{self.name(k, c)}'s activations")

    def output(self, k, c, y):
        # -- PP Step 5: the last stage finishes forward and produces the final output --
        if self.last_piece(c):
            comm.narrate(f"PP Step 5: stage {self.stage} produced the logits of micro-batch {k}")
            self.compute_loss(k, y)
        elif self.next_of(c, 1)[0] == self.stage:  # the next piece is here: no message
            self.acts_in[k, self.next_of(c, 1)[1]] = y
        else:
            self.acts_out[k, c] = y  # Step 3 sends it

    def compute_loss(self, k, logits):
        """The loss object caches what its backward needs under k; the normaliser is the
        target count of the whole batch, so the micro-batch losses (and gradients) sum."""
        # -- PP Step 6: compute the loss from the output and start backpropagation --
        comm.narrate(f"PP Step 6: stage {self.stage} computes the loss of micro-batch {k}")
        self.loss += self.loss_fn.forward(logits, self.targets[k], self.normalizer, k)

    def output_grad(self, k, c=0):
        """The gradient that starts backward: from the loss on the last piece, else received."""
        if self.last_piece(c):
            return self.loss_fn.backward(self.loss_scale, k)
        return self.grads_in.pop((k, c))

    def recv_grad(self, k, c=0):
        # -- PP Step 7: backward stage by stage; each passes its input's gradient back --
        source, _ = self.next_of(c, 1)
        comm.narrate(f"PP Step 7: stage {self.stage} receives {self.name(k, c)}'s gradient "
                     f"from stage {source}")
        self.grads_in[k, c] = recv_tensor(self.comm, source, TAG_GRAD + c * CHUNK_TAG, k,
                                          self.micro_rows[k], B.dtype,
                                          f"{self.name(k, c)}'s gradient")

    def backward(self, k, c=0):
        """The whole backward, or where the schedule has a W for it, B alone (the input's
        gradient: what the previous stage waits for)."""
        split = (k, c) in self.split
        comm.narrate(f"PP Step 7: stage {self.stage} runs backward on {self.name(k, c)} "
                     + ("(B: the input's gradient; W later)" if split else
                        "(parameter gradients accumulate with +=)"))
        chunk = self.chunks[c]
        dx = (chunk.backward_input if split else chunk.backward)(self.output_grad(k, c), k)
        if self.first_piece(c):
            return
        before = self.next_of(c, -1)
        if before[0] == self.stage:  # the previous piece is here: no message
            self.grads_in[k, before[1]] = dx
        else:
            self.grads_out[k, c] = dx

    def backward_weight(self, k, c=0):
        """W: the parameters' gradients from what B kept (they accumulate with +=)."""
        comm.narrate(f"PP Step 7: stage {self.stage} runs W on {self.name(k, c)}: the "
                     "parameter gradients, which no stage waits for")
        self.chunks[c].backward_weight(k)

    def send_grad(self, k, c=0):
        """To the rank and chunk of the previous piece (:meth:`next_of`)."""
        dest, to = self.next_of(c, -1)
        comm.narrate(f"PP Step 7: stage {self.stage} sends {self.name(k, c)}'s input gradient "
                     f"to stage {dest}")
        self.sends += send_tensor(self.comm, self.grads_out.pop((k, c)), dest,
                                  TAG_GRAD + to * CHUNK_TAG, k, f"{self.name(k, c)}'s gradient")

    def optimizer_step(self, _k=None, _c=0):
        # -- PP Step 8: with every micro-batch through, each stage updates its own parameters --
        comm.narrate(f"PP Step 8: stage {self.stage} updates its parameters")
        if self.optimizer is not None:
            self.optimizer.step()

    # ---- the interpreter
    HANDLERS = {Forward: forward, Backward: backward, BackwardWeight: backward_weight,
                SendAct: send_act, RecvAct: recv_act, SendGrad: send_grad, RecvGrad: recv_grad,
                OptimizerStep: optimizer_step}

    def run(self, instructions, measure_stash=True):
        """Execute the instructions in order, each timed into the trace (the bubble and the
        timeline are read from it); with ``measure_stash``, also find the most bytes of
        activations the stage holds at once (a walk over its modules after every forward and
        B, which keeps the output's gradient for W; so the trainer measures its first step
        only: the schedule repeats every step)."""
        handlers, add, now = self.HANDLERS, TRACE.add, TRACE.now
        self.split = {(i.micro, i.chunk) for i in instructions if isinstance(i, BackwardWeight)}
        for ins in instructions:
            t0 = now()
            handlers[type(ins)](self, ins.micro, ins.chunk)
            add(t0, now(), ins.kind, ins, micro=ins.micro, part=ins.part)  # labelled by itself
            if measure_stash and isinstance(ins, (Forward, Backward)):  # what adds to the stash
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
        has_loss = any(self.last_piece(c) for c in range(len(self.chunks)))
        return StepResult(self.loss if has_loss else None, self.peak_stash_bytes)


def run_pipeline(module, instructions, pp_comm, micro_rows, inputs=None, targets=None,
                 loss_fn=None, normalizer=None, optimizer=None, zero_grad=True,
                 measure_stash=True, loss_scale=1.0, placement="loop"):
    """One training step of one stage: zero the gradients, run the schedule's instructions.

    ``module``: the stage, or the list of its model chunks (interleaved).
    ``micro_rows[k]``: rows of micro-batch k (every stage knows them, to check each message).
    ``inputs``: the micro-batches of the inputs (first stage); ``targets`` theirs (last stage).
    ``loss_fn``: forward(logits, targets, normalizer, micro_id) / backward(dout, micro_id), as
    nn.SoftmaxCrossEntropy; ``normalizer``: the target count of the whole batch.
    ``optimizer``: anything with ``step()`` (a hybrid scheme can allreduce inside it).
    ``loss_scale``: fp16's loss scale, which the last stage's backward starts from.
    ``placement``: which model piece each chunk is ("loop" or "v", :func:`piece_of`).
    Returns StepResult(loss summed over micro-batches on the last stage else None, peak bytes
    of activations the module stashed, 0 without ``measure_stash``).
    """
    if zero_grad:
        for chunk in chunks_of(module):
            chunk.zero_grad()
    runner = StageRunner(module, pp_comm, micro_rows, inputs, targets, loss_fn, normalizer,
                         optimizer, loss_scale, placement)
    return runner.run(instructions, measure_stash)


def share_loss(pp_comm, loss, last=None):
    """The last stage has the loss; every stage gets it, so that every rank can print it and
    stop at once if it is not finite. The last stage, whose backwards end first, sends it to
    each other stage (p-1 messages of one number, which MPI delivers at once, eagerly) and the
    message waits for them: a Bcast would hold the first stage, which finishes last, until the
    last stage, idle and asleep by then, woke to pass the number on (MPI moves a collective
    only inside calls on every rank)."""
    last = pp_comm.size - 1 if last is None else last  # the rank of the loss (a V: rank 0)
    what = "the step's loss, to print and check"
    if pp_comm.size == 1:
        return loss
    buf = np.array([0.0 if loss is None else loss])
    if pp_comm.rank == last:
        for dest in (r for r in range(pp_comm.size) if r != last):
            pp_comm.Send(buf, dest, TAG_LOSS, what)
    else:
        pp_comm.Recv(buf, last, TAG_LOSS, what)
    return float(buf[0])


def gather_params(module, pp_comm, root=0, placement="loop"):
    """{canonical name: host array} of the WHOLE model on root (None elsewhere), in the model's
    order: each stage's parameters (of all its chunks) flattened into one buffer, one Gatherv."""
    # -- PP Step 9: the parameters stay on their stage; gather them to rank 0 to evaluate or save --
    chunks = chunks_of(module)
    named = [pair for chunk in chunks for pair in chunk.named_parameters()]
    flat = comm.flatten([p.data for _, p in named])
    counts = pp_comm.allgather_obj(int(flat.size), what="each stage's parameter count")
    layout = pp_comm.gather_obj([[(name, p.shape) for name, p in chunk.named_parameters()]
                                 for chunk in chunks], root=root, what="names and shapes")
    recv = B.xp.empty(sum(counts), dtype=flat.dtype) if pp_comm.rank == root else None
    pp_comm.Gatherv(flat, counts, recv, root=root, what="every stage's parameters, flat")
    if pp_comm.rank != root:
        return None
    pieces, offset, host = {}, 0, B.to_numpy(recv)
    for rank, stage_layout in enumerate(layout):
        for c, chunk_layout in enumerate(stage_layout):  # chunk c of rank r: its piece
            piece = pieces.setdefault(piece_of(placement, pp_comm.size, rank, c), {})
            for name, shape in chunk_layout:
                size = int(np.prod(shape))
                piece[name] = host[offset:offset + size].reshape(shape)
                offset += size
    return {name: value for x in sorted(pieces) for name, value in pieces[x].items()}


if __name__ == "__main__":  # python -m mpipar.pipeline
    from mpipar.runner import hand_over

    hand_over(__name__, "pipeline")
