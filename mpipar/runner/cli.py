"""The command line of every scheme: the flags, their defaults, and the refusals as data.

Every trainer shares the flags of :func:`mpipar.runner.flags.common_flags`; each scheme adds
its own (:func:`mpipar.runner.flags.scheme_flags`). Bad input is refused by two tables of
(schemes, condition, message), checked in order on every rank: :data:`FLAG_RULES` on the
flags alone, :data:`MODEL_RULES` once the model is known. The first rule that holds ends the
job with one message (from world rank 0) and exit code 2 on every rank
(:func:`mpipar.mpi.comm.refuse`), never a traceback.
"""

import argparse
import math

from mpi4py import MPI

from mpipar.engine import backend as B
from mpipar.engine import precision
from mpipar.mpi import comm
from mpipar.parts.plan import DEFAULTS, activation_bytes, memory_bytes, tp_size_problem
from mpipar.parts.schedules import CHOICES, CHUNKED, SCHEDULES, SPLIT, V_SHAPED
from mpipar.runner.flags import PROGS, common_flags, scheme_flags

SCHEMES = ("serial", "data_parallel", "tensor_parallel", "pipeline", "hybrid", "expert_parallel",
           "context_parallel")

# ----------------------------------------------------------------------------- refusals
def layer_names(task):
    return [name for name, _ in task.build_model().layers]


def _bad_partition(a, n_pieces, task):
    try:
        counts = [int(v) for v in a.partition.split(",")]
    except ValueError:
        return f"--partition {a.partition!r}: expected layer counts like 2,1,1"
    names = layer_names(task)
    if len(counts) != n_pieces or min(counts) < 1 or sum(counts) != len(names):
        return (f"--partition {a.partition}: need {n_pieces} positive layer counts (one per "
                f"stage, or per piece, stages x chunks, with model chunks) summing to "
                f"{len(names)}, the model's layers: {', '.join(names)}")
    return None


ALL, DP, TP, PP, HY = SCHEMES, ("data_parallel",), ("tensor_parallel",), ("pipeline",), ("hybrid",)
EP, CP = ("expert_parallel",), ("context_parallel",)
# (schemes, condition(a), message): checked in order on the flags alone; the first that holds
# is refused. ``a.n`` is the number of ranks, ``a.stages`` the pipeline's.
FLAG_RULES = [
    (("serial",), lambda a: a.n > 1,
     "the serial trainer is one process, but this job has {a.n} ranks: run it without mpirun "
     "(each copy would train alone and write the same files)"),
    (ALL, lambda a: a.steps <= 0, "--steps must be positive, got {a.steps}"),
    (ALL, lambda a: a.batch_size <= 0, "--batch-size must be positive, got {a.batch_size}"),
    (ALL, lambda a: not 0 < a.lr < math.inf, "--lr must be positive and finite, got {a.lr}"),
    (ALL, lambda a: a.seed < 0, "--seed must be 0 or more, got {a.seed}"),
    (ALL, lambda a: a.log_every < 0, "--log-every must be 0 (never) or more, got {a.log_every}"),
    (ALL, lambda a: a.model == "mlp" and min(a.sizes) < 1,
     "every --sizes entry must be positive, got {a.sizes}"),
    (ALL, lambda a: a.model == "mlp" and a.data == "digits" and (a.sizes[0] != 64
                                                                  or a.sizes[-1] != 10),
     "--sizes must start with 64 (pixels) and end with 10 (classes) for the digits, got "
     "{a.sizes} (--data synthetic takes any widths)"),
    (ALL, lambda a: a.model == "mlp" and a.data == "synthetic" and (a.samples < 10
                                                                    or a.sizes[-1] < 2),
     "--data synthetic needs --samples of at least 10 and 2 classes or more (the last --sizes "
     "entry), got --samples {a.samples}, --sizes {a.sizes}"),
    (ALL, lambda a: a.model != "mlp" and a.data != "digits",
     "--data {a.data} is for the MLP: the GPT trains on its text"),
    (ALL, lambda a: a.model == "gpt" and min(a.d_model, a.n_heads, a.n_layers, a.seq_len) < 1,
     "--d-model, --n-heads, --n-layers and --seq-len must be positive, got {a.d_model}, "
     "{a.n_heads}, {a.n_layers}, {a.seq_len}"),
    (ALL, lambda a: a.experts < 0 or (a.experts and a.model != "gpt"),
     "--experts {a.experts}: a mixture of experts replaces the GPT's feed-forwards (--model gpt), "
     "with E of 1 or more (0: none)"),
    (ALL, lambda a: a.experts and not 1 <= a.top_k <= a.experts,
     "--top-k {a.top_k} of --experts {a.experts}: each token goes to between 1 and E experts"),
    (ALL, lambda a: a.experts and not 0 <= a.aux_loss_coef < math.inf,
     "--aux-loss-coef must be 0 or more and finite, got {a.aux_loss_coef}"),
    (DP + TP + PP + CP, lambda a: a.experts,
     "--experts trains on the serial, expert-parallel and hybrid trainers only so far: run "
     "python -m mpipar.serial, mpipar.expert_parallel or mpipar.hybrid"),
    (HY, lambda a: not a.experts and a.ep != 1, "--ep {a.ep} splits experts: give --experts E"),
    (HY, lambda a: a.experts and a.schedule != "gpipe",
     "--experts in the hybrid runs --schedule gpipe: the load-balancing loss needs the whole "
     "batch's routing before the first backward, and {a.schedule} starts a backward before the "
     "last micro-batch's forward"),
    (HY, lambda a: a.experts and a.tp > 1,
     "--experts in the hybrid takes no --tp: its experts are split over the replicas of a "
     "stage, not over tensor-parallel ranks (use --tp 1)"),
    (HY, lambda a: a.experts and (a.zero or a.overlap or a.recompute),
     "--experts in the hybrid takes no --zero, --overlap or --recompute: its experts' "
     "gradients are summed over their own replicas, apart from the rest"),
    (HY, lambda a: a.experts and (a.ep < 1 or (a.dp or 1) % a.ep),
     "--ep {a.ep} must divide the {a.dp} data-parallel replicas: the experts are split over "
     "ep replicas of each stage"),
    (HY, lambda a: a.experts and a.experts % a.ep,
     "--experts {a.experts} do not split over the {a.ep} ranks of an expert-parallel group "
     "(--ep {a.ep}): use a multiple of {a.ep} experts, or another --ep"),
    (EP, lambda a: a.experts < 1,
     "expert parallelism splits a mixture of experts: give --experts E of 1 or more, got "
     "{a.experts}"),
    (EP, lambda a: a.ep < 1 or a.n % a.ep,
     "--ep {a.ep} must be at least 1 and divide the job's {a.n} ranks into expert-parallel "
     "groups"),
    (EP, lambda a: a.experts % a.ep,
     "--experts {a.experts} do not split over the {a.ep} ranks of an expert-parallel group "
     "(--ep {a.ep}): use a multiple of {a.ep} experts, or another --ep"),
    (EP, lambda a: a.recompute,
     "--recompute is not in the expert-parallel trainer: running a layer's forward again would "
     "repeat its all-to-alls"),
    (HY, lambda a: a.cp != 1 and (a.model != "gpt" or a.experts or a.recompute),
     "--cp {a.cp} in the hybrid splits the dense GPT's sequences: no --model mlp, --experts or "
     "--recompute with it"),
    (HY, lambda a: a.cp < 1 or (a.dp or 1) % a.cp,
     "--cp {a.cp} must be at least 1 and divide the {a.dp} data-parallel replicas: each "
     "sequence is split over cp replicas of a stage"),
    (HY, lambda a: a.cp > 1 and a.seq_len % (a.cp2 if a.cp_algo == "zigzag" else a.cp),
     "--cp-algo {a.cp_algo} on --cp {a.cp} cannot cut --seq-len {a.seq_len} into its chunks "
     "(zigzag: 2 x cp of them): use a multiple of {a.cp2}"),
    (HY, lambda a: a.cp > 1 and a.cp_algo == "ulysses" and a.n_heads % (a.tp * a.cp),
     "--cp-algo ulysses gives each of the --tp {a.tp} x --cp {a.cp} ranks whole heads, but "
     "--n-heads {a.n_heads} is not divisible by {a.tp} x {a.cp}"),
    (HY, lambda a: a.cp > 1 and a.sequence_parallel and (a.seq_len // a.cp) % a.tp,
     "--sequence-parallel with --cp {a.cp} splits each rank's {a.seq_len} / {a.cp} tokens "
     "over the {a.tp} tensor-parallel ranks: use a --seq-len that divides into cp x tp pieces"),
    (CP, lambda a: a.model != "gpt",
     "context parallelism splits the GPT's sequences, and the MLP has none: use --model gpt"),
    (CP, lambda a: a.cp < 1 or a.n % a.cp,
     "--cp {a.cp} must be at least 1 and divide the job's {a.n} ranks into context-parallel "
     "groups"),
    (CP, lambda a: a.cp_algo == "zigzag" and a.seq_len % (2 * a.cp),
     "--cp-algo zigzag cuts each sequence into 2 x {a.cp} chunks, but --seq-len {a.seq_len} is "
     "not divisible by {a.cp2}: use a multiple of {a.cp2}"),
    (CP, lambda a: a.cp_algo != "zigzag" and a.seq_len % a.cp,
     "--cp-algo {a.cp_algo} cuts each sequence into {a.cp} chunks, but --seq-len {a.seq_len} "
     "is not divisible by {a.cp}: use a multiple of {a.cp}"),
    (CP, lambda a: a.cp_algo == "ulysses" and a.n_heads % a.cp,
     "--cp-algo ulysses gives each of the {a.cp} ranks of a group whole heads, but --n-heads "
     "{a.n_heads} is not divisible by {a.cp}: use ring or zigzag, or another --cp"),
    (CP, lambda a: a.recompute,
     "--recompute is not in the context-parallel trainer: running attention's forward again "
     "would repeat its exchanges"),
    (ALL, lambda a: a.precision != "fp32" and (
        a.scheme == "data_parallel" and a.sync == "master"
        or a.scheme == "tensor_parallel" and a.update == "master"),
     "--precision {a.precision} is not in the seed's master update (--sync master, --update "
     "master), whose one rank sums and updates in full precision: use --sync allreduce or "
     "ring, or --update local"),
    (DP, lambda a: a.grad_sum == "bf16" and a.precision != "bf16",
     "--grad-sum bf16 sums bf16 gradients: it needs --precision bf16"),
    (ALL, lambda a: a.precision != "fp32" and (a.dtype != "float32" or a.backend != "numpy"),
     "--precision {a.precision} stores in 16 bits and computes in float32 with NumPy: it takes "
     "no --dtype float64 (the exactness mode) and no --backend cupy yet"),
    (ALL, lambda a: a.precision == "fp16" and not (0 < a.loss_scale < math.inf
                                                   and a.loss_scale_interval >= 1),
     "--precision fp16 needs a positive, finite --loss-scale and a --loss-scale-interval of 1 "
     "or more, got {a.loss_scale} and {a.loss_scale_interval}"),
    (ALL, lambda a: activation_bytes(a) > memory_bytes(),
     "--batch-size {a.batch_size} would need about {a.need_gib:.1f} GiB of activations in one "
     "step, more than this machine's {a.have_gib:.1f} GiB: use a smaller batch or model"),
    (ALL, lambda a: a.checkpoint_every < 0 or (a.checkpoint_every and not a.checkpoint),
     "--checkpoint-every {a.checkpoint_every} needs --checkpoint DIR and a count of 0 or more"),
    (ALL, lambda a: a.keep < 1, "--keep must be at least 1, got {a.keep}"),
    (ALL, lambda a: a.clip_grad is not None and not 0 < a.clip_grad < math.inf,
     "--clip-grad must be a positive finite norm, got {a.clip_grad}"),
    (DP, lambda a: a.recompute,
     "--recompute is for the serial, tensor-parallel, pipeline and hybrid trainers (a "
     "data-parallel replica can hold less with --micro-batches or --zero 3)"),
    (ALL, lambda a: not 0 <= a.timeout < math.inf,
     "--timeout must be 0 (never) or a positive number of seconds, got {a.timeout}"),
    (ALL, lambda a: a.model == "gpt" and a.d_model % a.n_heads,
     "--d-model {a.d_model} is not divisible by --n-heads {a.n_heads}"),
    (HY, lambda a: a.dp is not None and a.dp < 1, "--dp must be at least 1, got {a.dp}"),
    (HY, lambda a: a.tp < 1, "--tp must be at least 1, got {a.tp}"),
    (HY, lambda a: a.pp < 1, "--pp must be at least 1, got {a.pp}"),
    (TP + HY, lambda a: a.sequence_parallel and a.model != "gpt",
     "--sequence-parallel splits the GPT's sequence, and the MLP has none: use --model gpt"),
    (TP + HY, lambda a: a.sequence_parallel and a.model == "gpt" and a.seq_len % a.tp,
     "--sequence-parallel splits each sequence over the {a.tp} tensor-parallel ranks, but "
     "--seq-len {a.seq_len} is not divisible by {a.tp}: use a multiple of {a.tp}"),
    (DP + PP + HY + EP + CP, lambda a: a.micro_batches < 1,
     "--micro-batches must be positive, got {a.micro_batches}"),
    (DP + HY + EP + CP, lambda a: a.batch_size < a.replicas * a.micro_batches,
     "the global batch of {a.batch_size} rows cannot be split over {a.replicas} {a.replica} x "
     "{a.micro_batches} micro-batch(es): every {a.one_replica} needs at least one row per "
     "micro-batch (use --batch-size >= {a.rows_needed}, or fewer {a.replica} or micro-batches)"),
    (DP, lambda a: a.zero and a.sync != "allreduce",
     "--zero {a.zero} shards the update over every rank with MPI's Reduce_scatter and "
     "Allgather, which --sync {a.sync} does not use: use --sync allreduce --zero {a.zero}"),
    (DP + HY, lambda a: a.bucket_mb is not None and a.zero in (1, 3) or a.overlap and a.zero == 1,
     "--zero {a.zero} takes no --bucket-mb, and --zero 1 no --overlap: ZeRO-1 moves one flat "
     "buffer, ZeRO-3 one per layer (--overlap prefetches); buckets are ZeRO-2's: use --zero 2"),
    (HY, lambda a: a.zero == 3, "--zero 3 is not in the hybrid: it would gather a stage's "
     "parameters for every micro-batch's forward and backward (use data_parallel, or --zero 2)"),
    (HY, lambda a: a.zero == 2 and a.overlap and a.sequence_parallel, "--zero 2 --overlap takes "
     "no --sequence-parallel: its tp sum of LayerNorm gradients must precede the reduce-scatter"),
    (HY, lambda a: a.zero and (a.clip_grad is not None or a.checkpoint or a.resume),
     "--zero {a.zero} in the hybrid takes no --clip-grad, --checkpoint or --resume: they read "
     "each rank's whole optimizer, and ZeRO-{a.zero} keeps 1/D of it"),
    (DP, lambda a: a.overlap and a.sync != "allreduce",
     "--overlap needs the non-blocking Iallreduce of --sync allreduce (got --sync {a.sync})"),
    (DP, lambda a: a.bucket_mb is not None and (not 0 < a.bucket_mb < math.inf or a.sync ==
     "master"), "--bucket-mb must be positive and needs --sync allreduce or ring (got "
     "{a.bucket_mb} with --sync {a.sync})"),
    (HY, lambda a: a.bucket_mb is not None and not 0 < a.bucket_mb < math.inf,
     "--bucket-mb must be positive, got {a.bucket_mb}"),
    (PP, lambda a: a.schedule not in CHOICES,
     "unknown --schedule {a.schedule!r}: choose one of " + ", ".join(CHOICES)),
    (HY, lambda a: a.schedule not in SCHEDULES, "the hybrid runs --schedule " + ", ".join(
        SCHEDULES) + ", not {a.schedule!r}: its stages hold one model chunk (interleaved needs "
     "several) and its --overlap hooks the last micro-batch's whole backward (zb-h1 "
     "splits it)"),
    (PP, lambda a: a.schedule in V_SHAPED and a.chunks != 2,
     "--schedule {a.schedule} places 2 model chunks on each rank in a V, not --chunks "
     "{a.chunks}"),
    (PP, lambda a: a.schedule not in CHUNKED and a.chunks != 1,
     "--chunks {a.chunks} needs --schedule interleaved ({a.schedule} runs one model chunk "
     "per rank)"),
    (PP, lambda a: a.chunks <= 0, "--chunks must be positive, got {a.chunks}"),
    (PP, lambda a: a.warmup is not None and a.schedule != "interleaved",
     "--warmup {a.warmup} is the interleaved schedule's ({a.schedule} has one warm-up)"),
    (PP, lambda a: a.schedule in SPLIT and a.recompute == "full",
     "--schedule {a.schedule} runs each backward as B and W apart, but --recompute runs a "
     "stage's backward whole (recompute.Recomputed does not split it): every W would be "
     "empty and fill no bubble; drop one of the two"),
    (PP, lambda a: a.stages <= 0, "--stages must be positive, got {a.stages}"),
    (PP, lambda a: a.micro_batches > a.batch_size,
     "--micro-batches {a.micro_batches} exceeds --batch-size {a.batch_size}: a micro-batch "
     "would be empty"),
    (PP, lambda a: a.schedule == "dualpipev" and a.micro_batches < 2 * a.stages,
     "--schedule dualpipev needs at least 2 x {a.stages} = {a.stages2} micro-batches (its "
     "phases fill both chunks of every stage), got --micro-batches {a.micro_batches}"),
    (PP, lambda a: a.schedule == "interleaved" and a.micro_batches % a.stages,
     "--schedule interleaved needs --micro-batches ({a.micro_batches}) to be a multiple of the "
     "stages ({a.stages})"),
]
# (schemes, problem(a, task)): checked after the flags, with the model built; a problem is
# its own message (a sentence), no problem is None.
MODEL_RULES = [
    (ALL, lambda a, task: a.model == "mlp" and a.batch_size > len(task.data.y_train) and (
        f"--batch-size {a.batch_size} is more than the {len(task.data.y_train)} training rows "
        f"of the {a.data} data: a batch would repeat rows")),
    (TP + HY, lambda a, task: tp_size_problem(a, a.tp, task.data.vocab if a.model == "gpt"
                                               else None)),
    (PP + HY, lambda a, task: a.partition and _bad_partition(a, a.stages * a.chunks, task)),
    (PP, lambda a, task: a.chunks > 1 and a.stages * a.chunks > len(layer_names(task)) and (
        f"{a.stages} stages x {a.chunks} chunks = {a.stages * a.chunks} model pieces but the "
        f"{a.model} model has only {len(layer_names(task))} layers: use "
        + ("fewer ranks" if a.schedule in V_SHAPED else "fewer --chunks or ranks")
        + " (or a deeper model)")),
    (PP + HY, lambda a, task: a.stages > len(layer_names(task)) and (
        f"{a.stages} pipeline stages but the {a.model} model has only {len(layer_names(task))} "
        f"layers ({', '.join(layer_names(task))}): each stage needs at least one layer, so run "
        f"with at most {len(layer_names(task))} ranks (or a deeper model)")),
]


def parse_args(scheme, argv=None, n_ranks=None):
    """The flags of ``scheme`` parsed, completed (:func:`complete`) and checked (FLAG_RULES),
    the same way on every rank; ``n_ranks`` is the job's size (COMM_WORLD's by default)."""
    launch = "" if scheme == "serial" else f"mpirun -n {'N' if scheme == 'hybrid' else 'P'} "
    ap = argparse.ArgumentParser(prog=f"{launch}python -m mpipar.{scheme}",
                                 description=PROGS[scheme])
    ap.error = lambda message: comm.refuse(f"{message} (see --help)")
    common_flags(ap, scheme)
    scheme_flags(ap, scheme)
    a = complete(ap.parse_args(argv), scheme,
                 MPI.COMM_WORLD.Get_size() if n_ranks is None else n_ranks)
    for schemes, condition, message in FLAG_RULES:
        if scheme in schemes and condition(a):
            comm.refuse(message.format(a=a))
    a.bucket_mb = 25.0 if a.overlap and a.bucket_mb is None else a.bucket_mb  # DDP's default
    if a.backend == "cupy" and (problem := B.cupy_problem()):  # on every rank, before arrays
        comm.refuse(problem)
    if a.precision == "bf16" and (problem := precision.bf16_problem()):
        comm.refuse(problem)
    B.use(a.backend, a.dtype)
    if a.precision != "fp32":
        B.set_precision(a.precision)  # 16-bit storage, float32 compute
    return a


def complete(a, scheme, n):
    """Fill what the flags leave open: the model's defaults, the flags a scheme does not have,
    and the grid (dp, tp, pp) of n ranks, so that every scheme's options look alike."""
    a.scheme, a.n = scheme, n
    if scheme in ("pipeline", "hybrid") and a.schedule is None:  # the aux loss needs GPipe's
        a.schedule = "gpipe" if a.experts else "1f1b"  # order (every forward first)
    for key, value in DEFAULTS[a.model].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    absent = dict(explain=False, micro_batches=1, chunks=1, warmup=None, partition=None,
                  bucket_mb=None, overlap=False, dp=1, tp=1, pp=1, sequence_parallel=False, ep=1,
                  a2a="mpi", cp=1, cp_algo="ring", grad_sum="fp32")
    for key in [key for key in absent if not hasattr(a, key)]:
        setattr(a, key, absent[key])
    a.dp, a.tp, a.pp = {"data_parallel": (n, 1, 1), "tensor_parallel": (1, n, 1),
                        "pipeline": (1, 1, n), "expert_parallel": (n, 1, 1)}.get(
        scheme, (a.dp, a.tp, a.pp))
    if scheme == "expert_parallel" and a.ep is None:
        a.ep = n  # every rank holds E/n experts
    if scheme == "hybrid" and a.ep is None:
        a.ep = 1  # every replica holds every expert
    if scheme == "context_parallel":
        a.cp = n if a.cp is None else a.cp  # every rank holds 1/n of each sequence
        a.dp = max(n // a.cp, 1) if a.cp >= 1 else 1  # the replicas
    a.cp2 = 2 * a.cp
    if scheme == "hybrid" and a.dp is None and min(a.tp, a.pp) >= 1:
        a.dp = max(n // (a.tp * a.pp), 1)
    # the groups that take different rows: the hybrid's cp replicas of a stage share theirs
    a.data_groups = max((a.dp or 1) // max(a.cp, 1), 1) if scheme == "hybrid" else a.dp
    if scheme == "pipeline":
        a.chunks = (2 if a.schedule in CHUNKED else 1) if a.chunks is None else a.chunks
        a.stages = a.stages if a.print_schedule else n
        a.stages2 = 2 * a.stages
        if a.micro_batches is None:  # 4; dualpipev's least, 2 a stage, if that is more
            a.micro_batches = max(4, a.stages2) if a.schedule == "dualpipev" else 4
    if scheme == "hybrid":
        a.stages = a.pp
        if a.micro_batches is None:  # 4, or fewer when a replica has fewer rows
            a.micro_batches = max(1, min(4, a.batch_size // a.data_groups))
    a.replicas, a.one_replica = a.data_groups, "replica" \
        if scheme in ("hybrid", "context_parallel") else "rank"
    a.replica = a.one_replica + "s"  # the words of the batch refusal
    a.rows_needed = (a.data_groups or 1) * a.micro_batches
    return a


def check_model(scheme, a, task):
    """MODEL_RULES: what the flags allow but this model cannot do."""
    for schemes, problem in MODEL_RULES:
        message = scheme in schemes and problem(a, task)
        if message:
            comm.refuse(message)
