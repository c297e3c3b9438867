"""Pipeline schedules as plain lists of instructions, one list per stage.

    python -m mpipar.pipeline --print-schedule --schedule 1f1b --stages 4 --micro-batches 4

A schedule is a pure function ``schedule(n_stages, stage, n_micro) -> [Instruction, ...]``:
what one stage does in one training step, in order. :mod:`mpipar.pipeline` executes such a
list with MPI; this module needs no MPI at all, so a schedule can be printed, tested and
simulated on its own (the idea of shallowspeed's instruction lists).

- ``naive``: one micro-batch at a time, all the way forward and all the way back; only one
  stage ever works. Bubble (p-1)/p.
- ``gpipe`` (Huang et al. 2019, arXiv:1811.06965, Sec. 2.2): the forwards of all m
  micro-batches, then their backwards (last in, first out, as in the paper's Figure 2c).
  Bubble (p-1)/(m+p-1); every stage stashes the activations of all m micro-batches.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2): stage r runs
  min(p-r-1, m) warm-up forwards, then alternates one forward and one backward, then cools
  down with the remaining backwards. Same bubble as GPipe, but stage r stashes at most
  min(p-r, m) micro-batches.
- ``interleaved`` (Narayanan et al. 2021, Sec. 2.2.2): v model chunks per stage, the model cut
  into p*v pieces and stage r holding pieces r, r+p, ...; its instructions name their chunk
  (``F3.1``: forward of micro-batch 3 on chunk 1). Bubble (p-1)/(v*m+p-1), v times more
  messages; m must be a multiple of p. Called as ``interleaved(p, r, m, v, warmup)``: the
  warm-up of Megatron-LM and PyTorch (``production``, the default) or one that holds less
  and has no slack for a message's latency (``lean``).
- ``zb-v`` and ``dualpipev``: two chunks a stage placed in a V (stage r holds pieces r and
  2p-1-r, so the middle of the model never leaves stage p-1 and the loss is on stage 0); ZB-V
  with B and W apart, DualPipeV's eight phases with one micro-batch's forward beside
  another's backward. Both reach the least step with F, B and W equal: bubble (p-1)/(6m+p-1).
- ``zb-h1`` (Qi et al. 2024, arXiv:2401.10241, Sec. 3.1): 1F1B with each backward split into
  B (``Backward``: the input's gradient, sent at once) and W (``BackwardWeight``: the
  parameters' gradients, which no stage waits for), the W's held back to fill the cool-down.
  Bubble (p-1)/(3m+p-1) when F, B and W take equal times (m >= p), a third of 1F1B's; every
  stage stashes at most min(p, m) micro-batches (from F to W), 1F1B's first stage's count.

:func:`simulate` plays all stages' lists against each other (a send is delivered at once, a
receive waits for its send, forward costs 1 and backward 2 time units, a split backward's B
and W 1 each), checks every message against its receive and returns each instruction's start
and end: the tests read the happens-before order from it, and ``--print-schedule`` draws it.
"""

from collections import deque

from mpipar.parts.instructions import (  # noqa: F401 (the schedules' vocabulary, from here too)
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    _backward,
    _check,
    _forward,
    holder,
    neighbour,
    piece_of,
)
from mpipar.parts.v_schedules import dualpipev, zb_v


# ----------------------------------------------------------------------------- schedules
def naive(n_stages, stage, n_micro):
    """One micro-batch at a time: forward through every stage, backward through every stage."""
    _check(n_stages, stage, n_micro)
    out = []
    for k in range(n_micro):
        out += _forward(n_stages, stage, k) + _backward(n_stages, stage, k)
    return out + [OptimizerStep()]


def gpipe(n_stages, stage, n_micro):
    """All forwards, then all backwards in reverse order (GPipe, Figure 2c)."""
    _check(n_stages, stage, n_micro)
    out = []
    for k in range(n_micro):
        out += _forward(n_stages, stage, k)
    for k in reversed(range(n_micro)):
        out += _backward(n_stages, stage, k)
    return out + [OptimizerStep()]


def one_f_one_b(n_stages, stage, n_micro):
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    _check(n_stages, stage, n_micro)
    warmup = min(n_stages - stage - 1, n_micro)
    out = []
    for k in range(warmup):
        out += _forward(n_stages, stage, k)
    for i in range(n_micro - warmup):  # steady state: micro-batch warmup+i in, micro-batch i out
        out += _forward(n_stages, stage, warmup + i) + _backward(n_stages, stage, i)
    for k in range(n_micro - warmup, n_micro):
        out += _backward(n_stages, stage, k)
    return out + [OptimizerStep()]


WARMUPS = ("production", "lean")  # the interleaved schedule's warm-ups


def interleaved(n_stages, stage, n_micro, n_chunks=2, warmup="production"):
    """Interleaved 1F1B: v = ``n_chunks`` model chunks per stage (Narayanan et al. 2021,
    Sec. 2.2.2). The model is cut into p*v pieces; stage r holds pieces r, r+p, r+2p, ..., so
    an activation goes from chunk c of stage p-1 to chunk c+1 of stage 0. Micro-batches go
    through in groups of p: chunk 0 of the group, then chunk 1, ...; backwards in the reverse
    chunk order. Stage r runs w warm-up chunk-forwards, then one forward one backward, then
    cools down. The warm-up:

    - ``production`` (Megatron-LM's and PyTorch's ScheduleInterleaved1F1B):
      w = min(2(p-r-1) + (v-1)p, v*m). Each steady-state step's message was sent one step
      earlier, so it has a step's slack to arrive: the bubble grows slowly with latency.
    - ``lean``: w = min((p-r-1) + (v-1)p, v*m), p-r-1 fewer. With zero latency it is as fast
      and stashes p-r-1 fewer chunk activations, but every steady-state step waits for the
      message its neighbour has just sent, so each latency adds to every step.

    With v = 1 the lean warm-up is 1F1B's. Bubble (p-1)/(v*m+p-1) with zero latency and the
    costs of one chunk 1/v of the stage's; stage r stashes at most min(w + 1, v*m) chunk
    activations; m must be a multiple of p.
    """
    _check(n_stages, stage, n_micro)
    p, v = n_stages, n_chunks
    if v < 1:
        raise ValueError(f"the number of model chunks must be positive, got {v}")
    if warmup not in WARMUPS:
        raise ValueError(f"unknown warm-up {warmup!r}: choose one of {', '.join(WARMUPS)}")
    if n_micro % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({n_micro}) to be a "
                         f"multiple of the stages ({p})")
    total = n_micro * v

    def unit(j, forward):
        group, i = divmod(j, p * v)
        chunk = i // p
        return group * p + i % p, (chunk if forward else v - 1 - chunk)

    ahead = (p - stage - 1) * (2 if warmup == "production" else 1)  # forwards before the
    warmup = min(ahead + (v - 1) * p, total)  # first backward, on top of the other chunks'
    out = []
    for j in range(warmup):
        out += _forward(p, stage, *unit(j, True), v)
    for j in range(total - warmup):
        out += _forward(p, stage, *unit(warmup + j, True), v)
        out += _backward(p, stage, *unit(j, False), v)
    for j in range(total - warmup, total):
        out += _backward(p, stage, *unit(j, False), v)
    return out + [OptimizerStep()]


def zb_h1(n_stages, stage, n_micro):
    """ZB-H1 (Qi et al. 2024, arXiv:2401.10241, Sec. 3.1): 1F1B with each backward split into
    B (the input's gradient, which the previous stage waits for) and W (the parameters'
    gradients, which nobody waits for). Stage r runs 1F1B's min(p-r-1, m) warm-up forwards,
    then one forward and one B, adding the W of its oldest micro-batch from the (r+1)-th
    B on; in the cool-down each B is followed by a W; the W's still owed close the step.
    Stage r thus holds up to r more micro-batches than in 1F1B (forward done, W not yet):
    min(p, m) on every stage, the most 1F1B holds on its first. B's travel back one stage per
    B, not per B+W, and the W's fill the cool-down: each stage idles (p-1)(TF+TB-TW) against
    1F1B's (p-1)(TF+TB+TW) (m >= p), a third when the three are equal. That needs W no longer
    than F and no longer than B: a W fills the gap one F or one B leaves, so a longer W fills
    only that much, and each stage idles (p-1) max(TF, TB) (:func:`zb_h1_idle`).
    """
    _check(n_stages, stage, n_micro)
    warmup = min(n_stages - stage - 1, n_micro)
    out, owed = [], deque()  # micro-batches whose B ran and whose W did not
    for k in range(warmup):
        out += _forward(n_stages, stage, k)
    for i in range(n_micro - warmup):  # steady state: micro-batch warmup+i in, i back
        out += _forward(n_stages, stage, warmup + i) + _backward(n_stages, stage, i)
        owed.append(i)
        if i >= stage:  # the W that 1F1B would have run r steps ago
            out.append(BackwardWeight(owed.popleft()))
    for k in range(n_micro - warmup, n_micro):
        out += _backward(n_stages, stage, k)
        owed.append(k)
        out.append(BackwardWeight(owed.popleft()))
    return out + [BackwardWeight(k) for k in owed] + [OptimizerStep()]


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}  # the hybrid's too
SPLIT = {"zb-h1": zb_h1}  # B and W apart: the pipeline's own stages (not the hybrid's)
V_SHAPED = {"zb-v": zb_v, "dualpipev": dualpipev}  # two chunks a rank, placed in a V

CHOICES = (*SCHEDULES, "interleaved", *SPLIT, *V_SHAPED)
CHUNKED = ("interleaved", *V_SHAPED)  # model chunks on every stage: 2 unless told


def placement_of(name):
    """How the schedule ``name`` places its model chunks: "v" or "loop" (:func:`piece_of`)."""
    return "v" if name in V_SHAPED else "loop"


def stage_schedule(name, n_stages, stage, n_micro, n_chunks=1, warmup="production"):
    """One stage's instruction list; ``n_chunks`` and ``warmup`` are used by (and only by)
    ``interleaved``."""
    if name not in CHOICES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(CHOICES)}")
    if name == "interleaved":
        return interleaved(n_stages, stage, n_micro, n_chunks, warmup)
    if name in V_SHAPED:
        if n_chunks != 2:
            raise ValueError(f"schedule {name} runs two model chunks per stage, not {n_chunks}")
        return V_SHAPED[name](n_stages, stage, n_micro)
    if n_chunks != 1:
        raise ValueError(f"schedule {name} runs one model chunk per stage, not {n_chunks}")
    return {**SCHEDULES, **SPLIT}[name](n_stages, stage, n_micro)


def schedule(name, n_stages, n_micro, n_chunks=1, warmup="production"):
    """Every stage's instruction list for one step."""
    return [stage_schedule(name, n_stages, s, n_micro, n_chunks, warmup)
            for s in range(n_stages)]


def bubble_formula(n_stages, n_micro, name="gpipe", n_chunks=1):
    """Idle share of a step with equal stages: (p-1)/(m+p-1), or (p-1)/p for naive, or
    (p-1)/(v*m+p-1) for interleaved with v chunks. For zb-h1, F, B and W of equal times T:
    each stage idles (p-1)(TF+TB-TW) = (p-1)T of its m(TF+TB+TW) + (p-1)T, so (p-1)/(3m+p-1)
    for m >= p; with fewer micro-batches there are too few W's to fill the cool-down, and
    p-m units more idle: (2p-m-1)/(2m+2p-1). For the V-shaped schedules (zb-v, dualpipev) with
    F, B and W equal and m >= 2p-1: (p-1)/(6m+p-1), the ramp alone."""
    p, m = n_stages, n_micro
    if name == "naive":
        return (p - 1) / p
    if name in V_SHAPED:  # F, B, W equal, m >= 2p-1: the least step, 6m + p - 1 chunk-units
        return (p - 1) / (6 * m + p - 1)
    if name in SPLIT:
        idle = (p - 1) + max(p - m, 0)
        return idle / (3 * m + idle)
    v = n_chunks if name == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


BUBBLE_LAWS = {  # bubble_formula's laws, as the cost model prints them
    "naive": "(p-1)/p", "gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
    "interleaved": "(p-1)/(vm+p-1)", "zb-h1": "(p-1)/(3m+p-1) for F = B = W, m >= p",
    "zb-v": "(p-1)/(6m+p-1) for F = B = W, m >= 2p-1",
    "dualpipev": "(p-1)/(6m+p-1) for F = B = W, m >= 2p-1"}


def zb_h1_idle(n_stages, tf, tb, tw):
    """The time each stage of ZB-H1 idles in a step (m >= p), forward, B and W taking tf, tb
    and tw: (p-1)(tf + tb - tw) when W is no longer than F or B, else (p-1) max(tf, tb); in
    one formula (p-1)(tf + tb - min(tf, tb, tw))."""
    return (n_stages - 1) * (tf + tb - min(tf, tb, tw))


# ----------------------------------------------------------------------------- analysis
def in_flight(instructions):
    """Micro-batches whose activations a stage holds after each instruction: forward done,
    backward not finished (its B, or its W where the schedule splits it: B frees what only B
    needs, W the rest)."""
    split = {(i.micro, i.chunk) for i in instructions if isinstance(i, BackwardWeight)}
    held, out = 0, []
    for ins in instructions:
        done = isinstance(ins, BackwardWeight) or \
            (isinstance(ins, Backward) and (ins.micro, ins.chunk) not in split)
        held += isinstance(ins, Forward) - done
        out.append(held)
    return out


def peak_in_flight(instructions):
    """The most micro-batches a stage stashes at once: GPipe m, 1F1B min(p - r, m), zb-h1
    min(p, m)."""
    return max(in_flight(instructions), default=0)


def peak_stash(instructions, forward_bytes, weight_bytes=0):
    """The most bytes a stage stashes at once when a forward stashes ``forward_bytes`` for its
    micro-batch, a B that has a W keeps ``weight_bytes`` of them (what W needs: each layer's
    input and output gradient) until that W, and a whole backward frees them all. Either may
    be one number per model chunk (the chunks of a stage are different pieces of the model)."""
    split = {(i.micro, i.chunk) for i in instructions if isinstance(i, BackwardWeight)}

    def of(n_bytes, chunk):
        return n_bytes[chunk] if hasattr(n_bytes, "__len__") else n_bytes

    held = peak = 0
    for ins in instructions:
        f, w = of(forward_bytes, ins.chunk), of(weight_bytes, ins.chunk)
        if isinstance(ins, Forward):
            held += f
        elif isinstance(ins, Backward):
            held += (w if (ins.micro, ins.chunk) in split else 0) - f
        elif isinstance(ins, BackwardWeight):
            held -= w
        peak = max(peak, held)
    return peak


class ScheduleError(Exception):
    """A schedule that would deadlock, mismatch a message, or run an instruction too early."""


def simulate(lists, forward_cost=1.0, backward_cost=2.0, message_cost=0.0, weight_share=0.5,
             placement="loop"):
    """Execute every stage's list against the others; return per stage [(ins, start, end)].

    A send does not hold up its sender (MPI's non-blocking send); a receive waits until its
    message has arrived, ``message_cost`` after the send, and must get the micro-batch it names.
    Forward and backward take the given times: one number for every stage, one per stage (the
    cost model, :mod:`mpipar.tools.simulate`, passes each stage's own; with model chunks, a
    stage's may be one per chunk), or a function (stage, micro, chunk) -> time. Where a list
    splits a micro-batch's backward, its W takes ``weight_share`` of the backward's time and
    its B the rest (half each: for a matrix product dx and dW cost the same FLOPs, so F, B and
    W take equal times). With model chunks (interleaved 1F1B, v = 1 +
    the largest chunk in the lists) the activation of chunk c goes to chunk c of the next
    stage, and from the last stage to chunk c+1 of stage 0; gradients go the reverse way; a
    cost is then that of one chunk. ``placement`` "v" (the V-shaped schedules) routes as
    :func:`holder` says, and a piece's output for the next piece on the same rank (or its
    input's gradient for the previous one) is handed over without a message. Raises
    :class:`ScheduleError` on a deadlock, a receive matched to another micro-batch, an
    instruction without its input (a W before its B), or a send nobody receives.
    """
    n = len(lists)
    n_chunks = 1 + max((i.chunk for ins in lists for i in ins), default=0)
    forward_cost = _per_stage(forward_cost, n)
    backward_cost = _per_stage(backward_cost, n)
    channels = {}  # (src, dst, what, receiving chunk) -> deque of (micro, time sent)
    done = [[] for _ in range(n)]  # per stage: (ins, start, end)
    clock = [0.0] * n
    pos = [0] * n
    state = [dict(fwd=set(), bwd=set(), wgt=set(), act=set(), grad=set()) for _ in range(n)]
    split = [{(i.micro, i.chunk) for i in ins if isinstance(i, BackwardWeight)} for ins in lists]

    def cost(costs, s, k, c):
        mine = costs[s]
        return mine(s, k, c) if callable(mine) else mine[c] if hasattr(mine, "__len__") else mine

    def channel(src, dst, what, chunk):
        return channels.setdefault((src, dst, what, chunk), deque())

    def step(s, ins):
        """Run ins on stage s if it can run now; return False if it must wait."""
        st, k, c, t = state[s], ins.micro, ins.chunk, clock[s]
        before, after = (neighbour(placement, n, n_chunks, s, c, d) for d in (-1, 1))
        first, last = before is None, after is None
        took = 0.0
        if isinstance(ins, (RecvAct, RecvGrad)):
            is_act = isinstance(ins, RecvAct)
            src_at, what = before if is_act else after, "act" if is_act else "grad"
            if src_at is None or src_at[0] == s:
                side = "previous" if is_act else "next"
                raise ScheduleError(f"stage {s}: {ins} has no {side} stage to receive from")
            src = src_at[0]
            queue = channel(src, s, what, c)
            if not queue:
                return False
            got, sent_at = queue.popleft()
            if got != k:
                raise ScheduleError(f"stage {s}: {ins} expects the {what} of micro-batch {k} "
                                    f"from stage {src}, but the next message is micro-batch {got}")
            st[what].add((k, c))
            t = max(t, sent_at)
        elif isinstance(ins, Forward):
            if (k, c) in st["fwd"] or (not first and (k, c) not in st["act"]):
                raise ScheduleError(f"stage {s}: {ins} without its input activation (or twice)")
            st["fwd"].add((k, c))
            took = cost(forward_cost, s, k, c)
            if after is not None and after[0] == s:  # handed to this rank's next piece
                st["act"].add((k, after[1]))
        elif isinstance(ins, Backward):
            if (k, c) in st["bwd"] or (k, c) not in st["fwd"] or \
                    (not last and (k, c) not in st["grad"]):
                raise ScheduleError(f"stage {s}: {ins} before its forward or its output's "
                                    "gradient (or twice)")
            st["bwd"].add((k, c))
            took = cost(backward_cost, s, k, c) * (1 - weight_share if (k, c) in split[s] else 1)
            if before is not None and before[0] == s:  # to this rank's previous piece
                st["grad"].add((k, before[1]))
        elif isinstance(ins, BackwardWeight):
            if (k, c) in st["wgt"] or (k, c) not in st["bwd"]:
                raise ScheduleError(f"stage {s}: {ins} before its B (or twice)")
            st["wgt"].add((k, c))
            took = cost(backward_cost, s, k, c) * weight_share
        elif isinstance(ins, (SendAct, SendGrad)):
            is_act = isinstance(ins, SendAct)
            dst_at, what = after if is_act else before, "act" if is_act else "grad"
            need = "fwd" if is_act else "bwd"
            if dst_at is None or dst_at[0] == s:
                side = "next" if is_act else "previous"
                raise ScheduleError(f"stage {s}: {ins} has no {side} stage to send to")
            if (k, c) not in st[need]:
                raise ScheduleError(f"stage {s}: {ins} before the {need} that computes it")
            channel(s, dst_at[0], what, dst_at[1]).append((k, t + message_cost))
        elif isinstance(ins, OptimizerStep):
            if st["fwd"] != st["bwd"] or split[s] - st["wgt"]:
                late = (st["fwd"] - st["bwd"]) | (split[s] - st["wgt"])
                raise ScheduleError(f"stage {s}: optimizer step with micro-batches "
                                    f"{sorted({k for k, _ in late})} not yet backpropagated "
                                    "(B, or W where split)")
        clock[s] = t + took
        done[s].append((ins, t, t + took))
        return True

    while any(pos[s] < len(lists[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while pos[s] < len(lists[s]) and step(s, lists[s][pos[s]]):
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {lists[s][pos[s]]}" for s in range(n)
                                if pos[s] < len(lists[s]))
            raise ScheduleError(f"deadlock: every unfinished stage waits ({waiting})")
    left = {key[:3]: list(q) for key, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    return done


def _per_stage(cost, n):
    if callable(cost):
        return [cost] * n
    costs = list(cost) if hasattr(cost, "__len__") else [cost] * n
    if len(costs) != n:
        raise ValueError(f"{len(costs)} costs for {n} stages")
    return costs


def simulated_bubble(timeline):
    """Idle share of the simulated step: 1 - busy / (stages * span of forward/backward)."""
    spans = [(t0, t1) for events in timeline for ins, t0, t1 in events
             if isinstance(ins, (Forward, Backward, BackwardWeight))]
    begin, end = min(t0 for t0, _ in spans), max(t1 for _, t1 in spans)
    return 1.0 - sum(t1 - t0 for t0, t1 in spans) / (len(timeline) * (end - begin))


def format_schedule(name, n_stages, n_micro, n_chunks=1, warmup="production"):
    """Every stage's instruction list, and the simulated timeline (forward 1 unit, backward 2,
    per chunk; a split backward B 1 and W 1: the bubble share does not depend on the unit)."""
    lists = schedule(name, n_stages, n_micro, n_chunks, warmup)
    timeline = simulate(lists, placement=placement_of(name))
    chunked, split = name == "interleaved" or name in V_SHAPED, name in SPLIT or name in V_SHAPED
    lines = [f"schedule {name}: {n_stages} stages, {n_micro} micro-batches"
             + (f", {n_chunks} model chunks per stage, {warmup} warm-up"
                if name == "interleaved" else "")
             + (", 2 model chunks per stage in a V (stage r holds pieces r and "
                f"{2 * n_stages - 1}-r)" if name in V_SHAPED else ""),
             "  F/B forward/backward" + (" (B: the input's gradient only), W the weights' "
                                         "gradient" if split else "")
             + ", SA/RA send/receive activation, SG/RG send/receive "
             "gradient, OPT optimizer step; the number is the micro-batch"
             + (" (.c: on model chunk c)" if chunked else "")]
    for s, ins in enumerate(lists):
        lines.append(f"  stage {s} (stashes at most {peak_in_flight(ins)}): "
                     + " ".join(map(str, ins)))
    lines.append("simulated timeline (one cell per time unit; forward 1 unit, backward 2"
                 + (" = B 1 + W 1" if split else "") + "):")
    end = int(max(t1 for events in timeline for _, _, t1 in events))
    width = 5 if chunked else 3
    for s, events in enumerate(timeline):
        cells = [".".rjust(width)] * end
        for ins, t0, t1 in events:
            label = f"{ins.code}{ins.micro}" + (f".{ins.chunk}" if chunked else "")
            for t in range(int(t0), int(t1)):
                cells[t] = label.rjust(width)
        lines.append(f"  stage {s} |" + "".join(cells))
    lines.append(f"bubble {simulated_bubble(timeline):.3f} (formula "
                 f"{bubble_formula(n_stages, n_micro, name, n_chunks):.3f})")
    return "\n".join(lines)
