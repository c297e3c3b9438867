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

:func:`simulate` plays all stages' lists against each other (a send is delivered at once, a
receive waits for its send, forward costs 1 and backward 2 time units), checks every message
against its receive and returns each instruction's start and end: the tests read the
happens-before order from it, and ``--print-schedule`` draws it.
"""

from collections import deque
from dataclasses import dataclass
from typing import Optional


# ----------------------------------------------------------------------------- instructions
@dataclass(frozen=True)
class Instruction:
    micro: Optional[int] = None  # the micro-batch id (None for the optimizer step)
    code = "?"  # short name for printing
    kind = "?"  # trace kind: forward, backward, send, recv, optimizer

    def __str__(self):
        return self.code if self.micro is None else f"{self.code}{self.micro}"


class Forward(Instruction):
    """Run the stage forward on micro-batch ``micro`` (the last stage also computes the loss)."""
    code, kind = "F", "forward"


class Backward(Instruction):
    """Run the stage backward on micro-batch ``micro`` (the last stage starts from the loss)."""
    code, kind = "B", "backward"


class SendAct(Instruction):
    """Send the stage's output activation of ``micro`` to the next stage."""
    code, kind = "SA", "send"


class RecvAct(Instruction):
    """Receive the input activation of ``micro`` from the previous stage."""
    code, kind = "RA", "recv"


class SendGrad(Instruction):
    """Send the gradient of the stage's input of ``micro`` to the previous stage."""
    code, kind = "SG", "send"


class RecvGrad(Instruction):
    """Receive the gradient of the stage's output of ``micro`` from the next stage."""
    code, kind = "RG", "recv"


class OptimizerStep(Instruction):
    """Update the stage's parameters with the gradients summed over all micro-batches."""
    code, kind = "OPT", "optimizer"


# ----------------------------------------------------------------------------- schedules
def _forward(n_stages, stage, k):
    """Receive the input (unless first), run forward, send the output (unless last)."""
    return ([RecvAct(k)] if stage > 0 else []) + [Forward(k)] + \
        ([SendAct(k)] if stage < n_stages - 1 else [])


def _backward(n_stages, stage, k):
    """Receive the output's gradient (unless last), run backward, send the input's gradient
    (unless first)."""
    return ([RecvGrad(k)] if stage < n_stages - 1 else []) + [Backward(k)] + \
        ([SendGrad(k)] if stage > 0 else [])


def _check(n_stages, stage, n_micro):
    if n_stages < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is not one of {n_stages} stages")
    if n_micro < 1:
        raise ValueError(f"the number of micro-batches must be positive, got {n_micro}")


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


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name, n_stages, n_micro):
    """Every stage's instruction list for one step."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return [SCHEDULES[name](n_stages, s, n_micro) for s in range(n_stages)]


def bubble_formula(n_stages, n_micro, name="gpipe"):
    """Idle share of a step with equal stages: (p-1)/(m+p-1), or (p-1)/p for naive."""
    if name == "naive":
        return (n_stages - 1) / n_stages
    return (n_stages - 1) / (n_micro + n_stages - 1)


# ----------------------------------------------------------------------------- analysis
def in_flight(instructions):
    """Micro-batches whose activations a stage holds after each instruction (forwards done,
    backwards not yet)."""
    held, out = 0, []
    for ins in instructions:
        held += isinstance(ins, Forward) - isinstance(ins, Backward)
        out.append(held)
    return out


def peak_in_flight(instructions):
    """The most micro-batches a stage stashes at once: GPipe m, 1F1B min(p - r, m)."""
    return max(in_flight(instructions), default=0)


class ScheduleError(Exception):
    """A schedule that would deadlock, mismatch a message, or run an instruction too early."""


def simulate(lists, forward_cost=1.0, backward_cost=2.0, message_cost=0.0):
    """Execute every stage's list against the others; return per stage [(ins, start, end)].

    A send does not hold up its sender (MPI's non-blocking send); a receive waits until its
    message has arrived, ``message_cost`` after the send, and must get the micro-batch it names.
    Forward and backward take the given times: one number for every stage, or one per stage
    (the cost model, :mod:`mpipar.simulate`, passes each stage's own). Raises
    :class:`ScheduleError` on a deadlock, a receive matched to another micro-batch, an
    instruction without its input, or a send nobody receives.
    """
    n = len(lists)
    forward_cost = _per_stage(forward_cost, n)
    backward_cost = _per_stage(backward_cost, n)
    channels = {}  # (src, dst, what) -> deque of (micro, time sent)
    done = [[] for _ in range(n)]  # per stage: (ins, start, end)
    clock = [0.0] * n
    pos = [0] * n
    state = [dict(fwd=set(), bwd=set(), act=set(), grad=set()) for _ in range(n)]

    def channel(src, dst, what):
        return channels.setdefault((src, dst, what), deque())

    def step(s, ins):
        """Run ins on stage s if it can run now; return False if it must wait."""
        st, k, t = state[s], ins.micro, clock[s]
        cost = 0.0
        if isinstance(ins, (RecvAct, RecvGrad)):
            src, what = (s - 1, "act") if isinstance(ins, RecvAct) else (s + 1, "grad")
            if not 0 <= src < n:
                raise ScheduleError(f"stage {s}: {ins} has no stage {src} to receive from")
            queue = channel(src, s, what)
            if not queue:
                return False
            got, sent_at = queue.popleft()
            if got != k:
                raise ScheduleError(f"stage {s}: {ins} expects the {what} of micro-batch {k} "
                                    f"from stage {src}, but the next message is micro-batch {got}")
            st[what].add(k)
            t = max(t, sent_at)
        elif isinstance(ins, Forward):
            if k in st["fwd"] or (s > 0 and k not in st["act"]):
                raise ScheduleError(f"stage {s}: {ins} without its input activation (or twice)")
            st["fwd"].add(k)
            cost = forward_cost[s]
        elif isinstance(ins, Backward):
            if k in st["bwd"] or k not in st["fwd"] or (s < n - 1 and k not in st["grad"]):
                raise ScheduleError(f"stage {s}: {ins} before its forward or its output's "
                                    "gradient (or twice)")
            st["bwd"].add(k)
            cost = backward_cost[s]
        elif isinstance(ins, (SendAct, SendGrad)):
            dst, what, need = (s + 1, "act", "fwd") if isinstance(ins, SendAct) else \
                (s - 1, "grad", "bwd")
            if not 0 <= dst < n:
                raise ScheduleError(f"stage {s}: {ins} has no stage {dst} to send to")
            if k not in st[need]:
                raise ScheduleError(f"stage {s}: {ins} before the {need} that computes it")
            channel(s, dst, what).append((k, t + message_cost))
        elif isinstance(ins, OptimizerStep):
            if st["fwd"] != st["bwd"]:
                raise ScheduleError(f"stage {s}: optimizer step with micro-batches "
                                    f"{sorted(st['fwd'] - st['bwd'])} not yet backpropagated")
        clock[s] = t + cost
        done[s].append((ins, t, t + cost))
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
    left = {key: list(q) for key, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    return done


def _per_stage(cost, n):
    costs = list(cost) if hasattr(cost, "__len__") else [cost] * n
    if len(costs) != n:
        raise ValueError(f"{len(costs)} costs for {n} stages")
    return costs


def simulated_bubble(timeline):
    """Idle share of the simulated step: 1 - busy / (stages * span of forward/backward)."""
    spans = [(t0, t1) for events in timeline for ins, t0, t1 in events
             if isinstance(ins, (Forward, Backward))]
    begin, end = min(t0 for t0, _ in spans), max(t1 for _, t1 in spans)
    return 1.0 - sum(t1 - t0 for t0, t1 in spans) / (len(timeline) * (end - begin))


def format_schedule(name, n_stages, n_micro):
    """Every stage's instruction list, and the simulated timeline (forward 1 unit, backward 2)."""
    lists = schedule(name, n_stages, n_micro)
    timeline = simulate(lists)
    lines = [f"schedule {name}: {n_stages} stages, {n_micro} micro-batches",
             "  F/B forward/backward, SA/RA send/receive activation, SG/RG send/receive "
             "gradient, OPT optimizer step; the number is the micro-batch"]
    for s, ins in enumerate(lists):
        lines.append(f"  stage {s} (stashes at most {peak_in_flight(ins)}): "
                     + " ".join(map(str, ins)))
    lines.append("simulated timeline (one cell per time unit; forward 1 unit, backward 2):")
    end = int(max(t1 for events in timeline for _, _, t1 in events))
    for s, events in enumerate(timeline):
        cells = ["  ."] * end
        for ins, t0, t1 in events:
            for t in range(int(t0), int(t1)):
                cells[t] = f"{ins.code}{ins.micro}".rjust(3)
        lines.append(f"  stage {s} |" + "".join(cells))
    lines.append(f"bubble {simulated_bubble(timeline):.3f} (formula "
                 f"{bubble_formula(n_stages, n_micro, name):.3f})")
    return "\n".join(lines)
