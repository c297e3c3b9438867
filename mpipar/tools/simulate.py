"""Cost model: predict a training step's time and memory per rank for a DP x TP x PP layout
(with experts split over EP of the DP replicas).

    python -m mpipar.tools.simulate --d-model 64 --n-layers 4 --dp 1 --tp 2 --pp 2 --micro-batches 4
    python -m mpipar.tools.simulate --preset gpt3 --hardware h100 --dp 8 --tp 8 --pp 16

    python -m mpipar.tools.simulate --dp 2 --zero 3 --recompute selective
    python -m mpipar.tools.simulate --dp 4 --ep 4 --experts 8 --top-k 2 --imbalance 1.5
    python -m mpipar.tools.simulate --cp 4 --cp-algo zigzag --seq-len 1024 --batch-size 4

From measured numbers (or published ones for other hardware): the FLOP rate of one device,
alpha (seconds per message) and beta (seconds per byte) of its links, and on this machine what
MPI's Allreduce cost at each size and rank count measured (:mod:`mpipar.tools.hardware`), it
predicts

- compute: each layer's forward FLOPs from :func:`mpipar.parts.plan.layer_flops` (backward
  counted as twice the forward), divided over the tensor-parallel ranks, plus a fixed time
  per layer and micro-batch that does not divide (``Hardware.layer_overhead``), and the
  optimizer update, which grows with a stage's parameters (``Hardware.update_per_param``).
  The rate is that of a rank while the ranks it works with compute too: ranks that share a
  machine's cores and memory run slower together than one alone (``compute_share``); for
  tensor parallelism on this machine it is measured directly, on one rank's block timed while
  its partner runs its own at the same moment (:func:`mpipar.tools.validate.tp_calibration`);
- tensor-parallel communication: per transformer block and micro-batch, 2 allreduces forward and
  2 backward of b*s*h elements (Megatron-LM); for a whole GPT one more each in the embedding
  and the head, and 3 of b*s in the loss. Every collective (these, and the data-parallel and
  ZeRO ones below) costs what the same call measured on as many ranks at that size where
  plots/net.csv has it (``--hardware this``), else a ring: 2(t-1) alpha + 2(t-1)/t n beta
  (:meth:`mpipar.tools.hardware.Hardware.collective_time`; an allgather or reduce-scatter half an
  allreduce of the same size);
- pipeline: the stages cut by :func:`mpipar.parts.plan.partition`, then the *actual* schedule
  (:func:`mpipar.parts.schedules.schedule`) replayed by :func:`mpipar.parts.schedules.simulate` with
  each stage's forward and backward times and alpha + n beta per activation or gradient message, so
  the bubble comes out of the replay, not out of the closed formula (p-1)/(m+p-1). Every
  schedule of the pipeline: with model chunks (``interleaved``, ``zb-v``, ``dualpipev``) the
  model is cut into p x v pieces as the pipeline cuts it, each chunk costs its own piece, the
  pieces sit where the placement puts them (:func:`mpipar.parts.instructions.piece_of`), and a
  stage's stash is walked chunk by chunk (a split backward's kept until its W);
- data-parallel gradient allreduce once per step (over d ranks, not overlapped); with
  ZeRO-3 each layer's two allgathers and one reduce-scatter per micro-batch instead, and with
  ZeRO-1 to 3 an update of 1/d of the parameters (``--zero 0..3``; with d = 1 nothing is
  sharded);
- ZeRO-3's work beyond its collectives (``Hardware.zero3_per_value``, measured by
  ``python -m mpipar.tools.bench memory`` on one rank: ZeRO-3's step less ZeRO-0's, divided by the
  values it gathers, each layer twice per micro-batch): a fresh buffer of the full layer per
  gather, filled, viewed and freed, and a fresh full gradient. It does not divide by d: the
  buffers are the whole layer on any number of ranks; only the copies of a rank's own block
  (the whole layer on one rank, 1/d of it on d) shrink, so on d > 1 it errs high by those;
- experts (``--experts E --top-k k --ep G``): every block's feed-forward a mixture of E
  experts, k a token; each of G replicas holds E/G of them (memory), and per MoE layer and
  micro-batch sends the counts and four all-to-alls of the routed rows (:func:`all_to_all_time`;
  the terms in :func:`predict`); ``--imbalance`` makes the busiest rank's experts slower;
- context parallelism (``--cp G --cp-algo ring|zigzag|ulysses``): the sequences of each
  replica split over G ranks, their exchanges (:func:`cp_exchange_time`) and the busiest
  rank's share of attention's core (``CORE_SHARE``);
- recomputation (``--recompute [full|selective]``): full, one more forward in the backward;
  selective, attention's core again;
- memory per rank: parameters, gradients, optimizer state (Adam: 2 values per parameter,
  divided by d with ZeRO-1; ZeRO-2 divides the gradients too, ZeRO-3 the parameters too) and
  the activations of the most micro-batches a stage stashes.

- ranks that share cores (more ranks than cores, as on a small build machine): given a table
  {k: speed of a rank while k compute}, the replay shares the cores among the stages that
  compute at each moment (:func:`shared_replay`).
What it leaves out: overlap of communication with compute, kernel efficiency beyond "a FLOP
rate plus a fixed cost per layer", contention of the links, the time ranks wait for one
another at a collective (an allreduce measured back to back finds its partner ready).
"""

import argparse
import json
from dataclasses import asdict

import numpy as np

from mpipar.parts import plan, schedules
from mpipar.parts.instructions import piece_of
from mpipar.tools.bench.common import OneLineParser, number
from mpipar.tools.hardware import (  # noqa: F401 (the model's machines, imported from here too)
    PRESETS,
    Hardware,
    measured_machine,
    ring_allreduce_time,
    this_machine,
)
from mpipar.tools.model_specs import (  # noqa: F401 (the priced models, imported from here too)
    GPT3,
    ZERO3_CALLS,
    GPTSpec,
    MLPSpec,
    layer_table,
    layout_problem,
)


def shared_replay(lists, fwd, bwd, extra, message, share, group=1, rounds=20, placement="loop"):
    """Replay a pipeline schedule on ranks that share cores (processor sharing).

    ``share[k]``: the speed of a computing rank, relative to one rank alone, while k ranks
    compute (measured by ``python -m mpipar.tools.bench flops``: with more ranks than cores it falls
    with k; ranks that wait cost a little too). A stage is ``group`` ranks (its data- and
    tensor-parallel peers) that compute together. Which stages compute at once depends on the
    timing, and the timing on how fast they compute, so this iterates: replay, find for each
    forward and backward the mean of 1/share over its span, scale its compute time ``fwd[s]``
    or ``bwd[s]`` by that (``extra[s]``, the stage's collectives in either pass, is not
    scaled), replay again; halfway steps (damping) until the slowdowns settle. With model
    chunks each of ``fwd[s]``, ``bwd[s]``, ``extra[s]`` may be one value per chunk; a split
    backward's W takes its B's slowdown."""
    top = max(share)
    first = 1 / share[group]  # the first guess: the stage's own ranks computing
    slow = {}  # (stage, micro, chunk, "F" or "B") -> slowdown of that compute

    def of(values, s, c):
        return values[s][c] if hasattr(values[s], "__len__") else values[s]

    def costs(kind, base):
        return lambda s, k, c: of(base, s, c) * slow.get((s, k, c, kind), first) + of(extra, s, c)

    for _ in range(rounds):
        timeline = schedules.simulate(lists, costs("F", fwd), costs("B", bwd), message,
                                      placement=placement)
        spans = [(t0, t1, (s, ins.micro, ins.chunk, ins.code)) for s, events in enumerate(timeline)
                 for ins, t0, t1 in events if ins.code in ("F", "B", "W") and t1 > t0]
        edges = sorted({t for t0, t1, _ in spans for t in (t0, t1)})
        # 1/share for each interval between consecutive span edges
        pieces = []
        for a, b in zip(edges, edges[1:]):
            k = group * sum(t0 <= a and b <= t1 for t0, t1, _ in spans)
            pieces.append((a, b, 1 / share[min(max(k, 1), top)]))
        new = {}
        for t0, t1, key in spans:
            mean = sum((b - a) * inv for a, b, inv in pieces if t0 <= a and b <= t1) / (t1 - t0)
            new[key] = 0.5 * slow.get(key, first) + 0.5 * mean
        slow = new
    return timeline


def all_to_all_time(n_bytes, p, hw):
    """One all-to-all in which a rank sends n_bytes in all to its p - 1 partners, pairwise
    (:func:`mpipar.expert_parallel.pairwise_alltoallv`): p - 1 rounds of one message each, on
    the data-parallel links (the ranks of an ep group are replicas of the rest)."""
    return (p - 1) * hw.net_alpha + n_bytes * hw.net_beta if p > 1 else 0.0


def moe_exchange_time(spec, hw, micro_rows, ep, imbalance, dtype_bytes):
    """One MoE layer's all-to-alls for one micro-batch, both passes: the counts (E/ep int64 to
    each partner), then dispatch, combine and both reversed, each of the busiest rank's
    ``imbalance`` times k N (ep-1)/ep rows of d_model values."""
    if not getattr(spec, "experts", 0) or ep == 1:
        return 0.0
    rows_sent = spec.top_k * micro_rows * spec.seq_len * (ep - 1) / ep
    return all_to_all_time((ep - 1) * spec.experts // ep * 8, ep, hw) \
        + 4 * all_to_all_time(imbalance * rows_sent * spec.d_model * dtype_bytes, ep, hw)


# the busiest cp rank's share of the serial attention core's FLOPs, by algorithm
CORE_SHARE = {"ring": lambda g: 1 / g, "ulysses": lambda g: 1 / g,
              "zigzag": lambda g: (2 * g + 1) / (4 * g * g)}


def cp_exchange_time(spec, hw, micro_rows, cp, cp_algo, dtype_bytes):
    """One attention layer's exchanges for one micro-batch, both passes, of a rank of a cp
    group (lessons/formulas.md#context-parallelism): the ring's K and V (2 b n h values, n =
    s/cp) cp-1 times forward and cp-1 backward, and dK, dV cp times, each one message
    (alpha + bytes beta); Ulysses' q, k, v and output all-to-alls, 4 b n h (cp-1)/cp values
    each way, pairwise (:func:`all_to_all_time`). Links: the data-parallel ones."""
    if cp == 1 or not isinstance(spec, GPTSpec):
        return 0.0
    block = micro_rows * spec.seq_len / cp * spec.d_model * dtype_bytes  # b n h values
    if cp_algo == "ulysses":
        return 2 * (all_to_all_time(3 * block * (cp - 1) / cp, cp, hw)
                    + all_to_all_time(block * (cp - 1) / cp, cp, hw))
    return (3 * cp - 2) * (hw.net_alpha + 2 * block * hw.net_beta)


def predict(spec, hw, dp=1, tp=1, pp=1, global_batch=32, n_micro=1, schedule="1f1b",
            dtype_bytes=2, zero=0, recompute=False, compute_share=1.0, stage_share=None,
            ep=1, imbalance=1.0, cp=1, cp_algo="ring", n_chunks=None, warmup="production"):
    """Predicted step time (and its parts) and memory per rank.

    ``recompute``: keep only each block's input and recompute its forward in backward (the
    backward then costs 3 forwards instead of 2); "selective": keep all but attention's
    softmax part, whose forward (the table's ``core``) the backward runs again. ``zero`` 3: each
    layer's parameters are allgathered twice and its gradient reduce-scattered once per
    micro-batch, in place of the one allreduce: each half an allreduce of the layer's bytes
    (an allreduce is a reduce-scatter and an allgather), 1.5 allreduces in all, and its work
    beyond them, ``hw.zero3_per_value`` per value of each gather (the full layer at any d).
    ``compute_share`` scales the FLOP rate when
    ranks share a core (oversubscription): one number for every moment, or a table
    {k: share while k ranks compute}, for which the pipeline is replayed with the cores shared
    among the stages that compute at each moment (:func:`shared_replay`). Such a table is the
    pace of ranks in lockstep (the last of k to finish: replicas or tensor-parallel peers
    wait for one another). ``stage_share``, a table of the mean speed of each of k ranks, is
    used instead where every stage is one rank: stages that do not wait for each other are not
    held back by the slowest.

    With experts (``spec.experts``), ``ep`` of the ``dp`` replicas split them (each holds E/ep
    of every layer; :mod:`mpipar.expert_parallel`). Per MoE layer and micro-batch a rank sends
    an Alltoall of E/ep counts to each of its ep - 1 partners, then four all-to-alls of rows
    (dispatch and combine forward, both again backward) of about k N (ep-1)/ep rows of d_model
    values for its N tokens, if the router spreads them evenly; each costs (ep-1) alpha
    (pairwise rounds) + its bytes beta on the data-parallel links (``all_to_all_time``).
    ``imbalance`` (the busiest expert's tokens over the mean, as the run prints) scales the
    busiest rank's expert FLOPs and the rows it receives and sends back. The experts' gradients
    are summed over their dp/ep replicas, the rest over all dp.

    With ``cp`` > 1 each of the dp replicas is a cp group that splits every sequence
    (:mod:`mpipar.context_parallel`, ``cp_algo``): everything but attention's core runs on s/cp
    tokens; the core's FLOPs of the busiest rank are the serial core's (every s x s score,
    the masked ones included, as the serial code computes them) times 1/cp for the ring
    (its last rank computes all cp blocks of (s/cp)^2) and Ulysses (all s tokens, H/cp
    heads), and (2cp+1)/(4cp^2) for the zigzag (2cp+1 chunk pairs of (s/2cp)^2), which skips
    the masked pairs the serial code computes; the exchanges of ``cp_exchange_time`` per
    attention layer and micro-batch; activations over cp (the ring and zigzag keep no s x s
    weights); the gradients summed over dp x cp ranks. Messages between stages and tensor-
    parallel allreduces carry s/cp tokens."""
    micro_rows = global_batch / (dp * n_micro)
    if micro_rows < 1:
        raise ValueError(f"global batch {global_batch} is too small for dp={dp} x m={n_micro}")
    if cp > 1 and getattr(spec, "experts", 0):
        raise ValueError("the cost model has context parallelism for the dense GPT only")
    v = n_chunks or (2 if schedule in schedules.CHUNKED else 1)
    placement = schedules.placement_of(schedule)
    lists = schedules.schedule(schedule, pp, n_micro, v, warmup)  # raises if it cannot run
    rows = max(1, round(micro_rows))
    table = layer_table(spec, rows, tp, dtype_bytes, recompute, cp, cp_algo)
    scale = micro_rows / rows
    # as the pipeline cuts: into p stages, or p x v pieces, v chunks a stage
    counts = plan.partition([row["dense_flops"] for row in table], pp * v)
    table_share = compute_share if isinstance(compute_share, dict) else None
    if table_share:  # everything outside the pipeline replay runs with every rank computing
        compute_share = table_share[min(dp * tp * pp, max(table_share))]
    rate = hw.flops * (1.0 if table_share else compute_share)
    act_bytes = spec.message_bytes(micro_rows, dtype_bytes) / cp  # an activation, a gradient
    allreduce = hw.collective_time("allreduce", act_bytes, tp, hw.tp_alpha, hw.tp_beta)
    per_token = hw.collective_time("allreduce", act_bytes / spec.d_model if isinstance(
        spec, GPTSpec) else 0.0, tp, hw.tp_alpha, hw.tp_beta)
    backward_factor = 3.0 if recompute and recompute != "selective" else 2.0
    a2a = moe_exchange_time(spec, hw, micro_rows, ep, imbalance, dtype_bytes)
    a2a += cp_exchange_time(spec, hw, micro_rows, cp, cp_algo, dtype_bytes)
    core_share = CORE_SHARE[cp_algo](cp) if cp > 1 else 1.0  # the busiest rank's, of the core

    fwd, bwd, comm, ep_comm, params, experts, stash, rows_of = [], [], [], [], [], [], [], []
    start = 0
    for c in counts:  # each piece: a stage, or with model chunks one chunk of a stage
        layers = table[start:start + c]
        start += c
        flops = sum((r["flops"] - r["core"]) / cp + core_share * r["core"]
                    + (imbalance - 1) * r["expert_flops"] / cp for r in layers) * scale / tp
        big = sum(r["tp_allreduces"][0] for r in layers)
        small = sum(r["tp_allreduces"][1] for r in layers)
        fixed = c * hw.layer_overhead
        core = (recompute == "selective") * sum(r["core"] for r in layers) * scale / tp
        fwd.append(fixed + flops / rate)
        bwd.append(2 * fixed + (backward_factor * flops + core) / rate)
        comm.append((big * allreduce + small * per_token) / 2)  # in each pass: half of them
        ep_comm.append(sum(r["core"] > 0 for r in layers) * a2a / 2)  # per block, as comm
        experts.append(sum(r["expert_params"] for r in layers) / (ep * tp))
        params.append(sum(r["params"] - r["expert_params"] for r in layers) / tp + experts[-1])
        stash.append(sum(r["stash"] for r in layers) * scale)
        rows_of.append(layers)
    comm = [c + e for c, e in zip(comm, ep_comm)]  # the passes wait for both alike
    # stage s's chunk c is piece mine[s][c] (the loop, or the V: schedules.placement_of)
    mine = [[piece_of(placement, pp, s, c) for c in range(v)] for s in range(pp)]

    def chunks(values):  # per stage, one value per chunk
        return [[values[x] for x in pieces] for pieces in mine]

    message = hw.net_alpha + act_bytes * hw.net_beta if pp > 1 else 0.0
    if table_share:
        replay_share = stage_share if stage_share and dp * tp == 1 else table_share
        timeline = shared_replay(lists, chunks(fwd), chunks(bwd), chunks(comm), message,
                                 replay_share, dp * tp, placement=placement)
        fwd = [f / compute_share for f in fwd]  # for the split below: all ranks computing
        bwd = [b / compute_share for b in bwd]
    fwd = [f + c for f, c in zip(fwd, comm)]
    bwd = [b + c for b, c in zip(bwd, comm)]
    if not table_share:
        timeline = schedules.simulate(lists, chunks(fwd), chunks(bwd), message,
                                      placement=placement)
    pipeline_time = max(end for events in timeline for _, _, end in events)
    activations = max(schedules.peak_stash(ins, held, held)  # a split B's stash kept to its W
                      for ins, held in zip(lists, chunks(stash)))
    # from here on per stage: the sums over its chunks
    fwd, bwd, comm, ep_comm, stage_params, stage_experts = (
        [sum(row) for row in chunks(values)]
        for values in (fwd, bwd, comm, ep_comm, params, experts))
    busiest = int(np.argmax([n_micro * (f + b) for f, b in zip(fwd, bwd)]))

    big = int(np.argmax(stage_params))  # the stage of the most parameters
    dense_bytes = (stage_params[big] - stage_experts[big]) * dtype_bytes
    dp_time = hw.collective_time("allreduce", dense_bytes, dp * cp, hw.net_alpha, hw.net_beta)
    if stage_experts[big]:  # each expert's gradient over its dp/ep replicas
        dp_time += hw.collective_time("allreduce", stage_experts[big] * dtype_bytes, dp // ep,
                                      hw.net_alpha, hw.net_beta)
    if zero >= 3:  # per micro-batch and layer Allgather, Allgather, Reduce_scatter
        layers = [r for x in mine[busiest] for r in rows_of[x]]  # the busiest stage's
        dp_time = n_micro * sum(hw.collective_time(kind, r["params"] / tp * dtype_bytes, dp,
                                                   hw.net_alpha, hw.net_beta)
                                for r in layers if r["params"] for kind in ZERO3_CALLS)
    # the optimizer update: of a stage's parameters, of 1/d of them with ZeRO-1
    update = max(stage_params) * hw.update_per_param / (dp if zero else 1) / compute_share
    # ZeRO-3's own work per gather (twice per layer and micro-batch): the full layer at any d
    update += (zero >= 3) * 2 * n_micro * stage_params[busiest] * hw.zero3_per_value \
        / compute_share
    total = pipeline_time + dp_time + update

    compute = update + n_micro * (fwd[busiest] + bwd[busiest]
                                  - 2 * comm[busiest])
    a2a_comm = n_micro * 2 * ep_comm[busiest]
    tp_comm = n_micro * 2 * comm[busiest] - a2a_comm
    pp_comm = 2 * n_micro * v * message if pp > 1 else 0.0  # in and back, on every chunk
    bubble = max(0.0, pipeline_time + update - compute - tp_comm - a2a_comm - pp_comm)

    params = max(stage_params)
    memory = dict(
        params=params * dtype_bytes / (dp if zero >= 3 else 1),
        grads=params * dtype_bytes / (dp if zero >= 2 else 1),
        # Adam's m and v in the parameters' precision, float32 at the least, plus a float32
        # master copy of 16-bit weights: 12 bytes per parameter in mixed precision (16 with the
        # 16-bit weights and gradients, ZeRO), 16 in float64
        optimizer=params * (2 * max(dtype_bytes, 4) + (4 if dtype_bytes < 4 else 0))
        / (dp if zero else 1),
        activations=activations,
    )
    memory["total"] = sum(memory.values())
    tokens = global_batch * getattr(spec, "seq_len", 1)
    return dict(
        dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, devices=dp * tp * pp * cp, n_micro=n_micro,
        schedule=schedule, n_chunks=v,
        step_s=total, compute_s=compute, tp_comm_s=tp_comm, pp_comm_s=pp_comm, bubble_s=bubble,
        dp_comm_s=dp_time, ep_comm_s=0.0 if cp > 1 else a2a_comm,
        cp_comm_s=a2a_comm if cp > 1 else 0.0, tokens_per_s=tokens / total,
        model_flops_per_s=6 * sum(r["params"] for r in table) * tokens / total,
        fits=memory["total"] <= hw.memory, partition=counts,
        replay_bubble=schedules.simulated_bubble(timeline) if pp > 1 else 0.0,
        bubble_formula=schedules.bubble_formula(pp, n_micro, schedule, v) if pp > 1 else 0.0,
        **{f"mem_{k}_bytes": v for k, v in memory.items()},
    )


# ----------------------------------------------------------------------------- extrapolation
def gpt3_layouts(n_devices, per_node=8):
    """Layouts for n devices: TP inside a node (at most 8), PP across nodes, DP for the rest."""
    return [(n_devices // (tp * pp), tp, pp) for tp in (1, 2, 4, 8)
            for pp in (1, 2, 4, 8, 16, 32, 64) if tp <= per_node and not n_devices % (tp * pp)]


def extrapolate(hw_name="a100", global_batch=1536, devices=(8, 16, 32, 64, 128, 256, 512, 1024)):
    """Best predicted layout per device count, and a few fixed layout families, for GPT-3."""
    hw = PRESETS[hw_name]
    rows = []
    for n in devices:
        for dp, tp, pp in gpt3_layouts(n):
            if global_batch % dp:
                continue
            # micro-batches of one sequence, as Megatron-LM ran; without a pipeline, one pass
            n_micro = global_batch // dp if pp > 1 else 1
            r = predict(GPT3, hw, dp, tp, pp, global_batch, n_micro, "1f1b", dtype_bytes=2,
                        zero=1, recompute=True)
            r["efficiency"] = r["model_flops_per_s"] / (n * hw.flops / 0.5)  # of peak
            rows.append(r)
    return rows


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    ap = OneLineParser(prog="python -m mpipar.tools.simulate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    count, rate, cost = number(int), number(float), number(float, zero_ok=True)
    ap.add_argument("--preset", choices=["gpt3"], help="a published model instead of the flags")
    ap.add_argument("--vocab", type=count, default=94)  # the corpus's characters
    ap.add_argument("--d-model", type=count, default=64)
    ap.add_argument("--n-heads", type=count, default=4)
    ap.add_argument("--n-layers", type=count, default=2)
    ap.add_argument("--seq-len", type=count, default=32)
    ap.add_argument("--batch-size", type=count, default=32, help="global batch")
    ap.add_argument("--dp", type=count, default=1)
    ap.add_argument("--tp", type=count, default=1)
    ap.add_argument("--pp", type=count, default=1)
    ap.add_argument("--micro-batches", type=count, default=1)
    ap.add_argument("--schedule", choices=schedules.CHOICES, default="1f1b")
    ap.add_argument("--chunks", type=count,
                    help="model chunks a stage (interleaved; default 2, as the V schedules')")
    ap.add_argument("--warmup", choices=schedules.WARMUPS,
                    help="interleaved 1F1B's warm-up (default production)")
    ap.add_argument("--hardware", choices=["this", *PRESETS], default="this")
    ap.add_argument("--flops", type=rate, help="FLOP/s, --hardware this (default: flops.csv)")
    ap.add_argument("--alpha", type=cost, help="s per message, --hardware this (0: free)")
    ap.add_argument("--beta", type=cost, help="s per byte, --hardware this (default: net.csv)")
    ap.add_argument("--dtype-bytes", type=count, default=4)
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                    help="ZeRO stage: shard optimizer state (1), gradients (2), parameters (3)")
    ap.add_argument("--recompute", nargs="?", const="full", choices=["full", "selective"],
                    help="recompute activations in backward (alone: full)")
    ap.add_argument("--experts", type=number(int, zero_ok=True), default=0,
                    help="a mixture of E experts as every block's feed-forward (default: dense)")
    ap.add_argument("--top-k", type=count, default=2, help="experts a token (with --experts)")
    ap.add_argument("--ep", type=count, default=1,
                    help="expert-parallel size: the replicas that split the experts")
    ap.add_argument("--imbalance", type=rate, default=1.0,
                    help="the rows for the busiest rank's experts over the mean (1: even)")
    ap.add_argument("--cp", type=count, default=1,
                    help="context-parallel size: each replica's sequences split over cp ranks")
    ap.add_argument("--cp-algo", choices=["ring", "zigzag", "ulysses"], default="ring",
                    help="context parallelism's attention (default ring)")
    ap.add_argument("--json", action="store_true", help="print the prediction as JSON")
    args = ap.parse_args(argv)
    spec = GPT3 if args.preset == "gpt3" else GPTSpec(args.vocab, args.d_model, args.n_heads,
                                                       args.n_layers, args.seq_len)
    spec = GPTSpec(**dict(asdict(spec), experts=args.experts, top_k=args.top_k))
    problem = layout_problem(spec, args)
    if problem:
        ap.error(problem)
    hw = measured_machine(args.flops, args.alpha, args.beta) if args.hardware == "this" \
        else PRESETS[args.hardware]
    r = predict(spec, hw, args.dp, args.tp, args.pp, args.batch_size, args.micro_batches,
                args.schedule, args.dtype_bytes, args.zero, args.recompute, ep=args.ep,
                imbalance=args.imbalance, cp=args.cp, cp_algo=args.cp_algo,
                n_chunks=args.chunks, warmup=args.warmup or "production")
    if args.json:  # allow_nan=False: a NaN is an error here, never a silent "NaN" in the output
        print(json.dumps(dict(r, hardware=asdict(hw)), allow_nan=False))
        return
    print(f"{hw.name}: GPT {spec}")
    print(f"layout dp={args.dp} tp={args.tp} pp={args.pp}, {args.micro_batches} micro-batches, "
          f"{args.schedule}"
          + (f", {r['n_chunks']} chunks a stage ({args.warmup or 'production'} warm-up)"
             if args.schedule == "interleaved" else "")
          + f"; {_cut(args.schedule, r)}"
          + (f"; ZeRO-{args.zero}" if args.zero else "")
          + (f"; recompute {args.recompute}" if args.recompute else "")
          + (f"; {args.experts} experts, top-{args.top_k}, ep={args.ep}, imbalance "
             f"{args.imbalance:g}" if args.experts else "")
          + (f"; cp={args.cp} {args.cp_algo}" if args.cp > 1 else ""))
    print(f"predicted step {_ms(r['step_s'])}: compute {_ms(r['compute_s'])}, tensor-parallel "
          f"comm {_ms(r['tp_comm_s'])}, pipeline comm {_ms(r['pp_comm_s'])}, bubble "
          f"{_ms(r['bubble_s'])}, data-parallel comm {_ms(r['dp_comm_s'])}"
          + (f", expert all-to-alls {_ms(r['ep_comm_s'])}" if args.experts else "")
          + (f", context-parallel comm {_ms(r['cp_comm_s'])}" if args.cp > 1 else ""))
    if args.pp > 1:
        print(f"idle share of all stages in the replayed step {r['replay_bubble']:.3f}; for "
              f"equal stages and free messages {r['bubble_formula']:.3f} "
              f"({schedules.BUBBLE_LAWS[args.schedule]})")
    print(f"throughput {r['tokens_per_s']:,.0f} tokens/s")
    mem = {k[4:-6]: v for k, v in r.items() if k.startswith("mem_")}
    print("memory per rank: " + ", ".join(f"{k} {_gb(v)}" for k, v in mem.items())
          + ("" if r["fits"] else "  (does not fit)"))


def _cut(schedule, r):
    """The layers of each stage, or of each piece where a stage holds model chunks."""
    if r["n_chunks"] == 1:
        return f"layers per stage {r['partition']}"
    held = "c*p + s" if schedule == "interleaved" else "s and 2p-1-s"
    return f"layers per piece {r['partition']} (stage s holds pieces {held})"


def _ms(seconds):
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _gb(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


if __name__ == "__main__":
    main()
