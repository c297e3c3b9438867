"""Every scheme's flags, for :func:`mpipar.runner.cli.parse_args`: the ones every trainer
shares (:func:`common_flags`) and each scheme's own (:func:`scheme_flags`), with their help.

Defaults that depend on the model (steps, batch size, learning rate, optimizer) are None here
and filled in after parsing (:func:`mpipar.runner.cli.complete`), so that ``--help`` names them
per model; what a flag may not be is checked there too, by the refusal tables.
"""

import argparse

from mpipar.parts.schedules import CHOICES, SCHEDULES, WARMUPS

DEFAULT_TIMELINE = "pipeline-timeline.png"


# ----------------------------------------------------------------------------- flags
def given(value):
    """An argparse type for a path or a list: an empty string names nothing, so it is refused
    (a run would otherwise finish and save nothing)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value names nothing: give one, or leave "
                                         "the flag out")
    return value


def common_flags(ap, scheme):
    """The flags every trainer shares. Per-model defaults (steps, batch, lr, optimizer) are
    filled in after parsing (:data:`mpipar.parts.plan.DEFAULTS`), so ``--help`` names them per
    model."""
    deep = scheme in ("pipeline", "hybrid", "expert_parallel", "context_parallel")  # the GPT
    g = ap.add_argument_group("training (shared by every scheme)")
    g.add_argument("--model", choices=["mlp", "gpt"], default="gpt" if deep else "mlp",
                   help="mlp: MLP on 8x8 digits; gpt: character-level GPT on text (default "
                        f"{'gpt' if deep else 'mlp'})")
    g.add_argument("--steps", type=int, help="optimizer steps (mlp 300, gpt 250)")
    g.add_argument("--batch-size", type=int, help="global batch size (mlp 64, gpt 32)")
    g.add_argument("--lr", type=float, help="learning rate (mlp 0.05, gpt 3e-3)")
    g.add_argument("--optim", choices=["sgd", "adam", "adamw"], help="mlp: sgd, gpt: adam")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="float64 for exact comparisons between schemes")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16 or fp16: parameters, gradients and activations stored in 16 bits, "
                        "computed in float32, updated through float32 master weights (every "
                        "scheme but the seed's master updates)")
    g.add_argument("--loss-scale", type=float, default=2.0 ** 16, metavar="S",
                   help="fp16: the dynamic loss scale's start (default 65536; see "
                        "mpipar/engine/precision.py for its rules)")
    g.add_argument("--loss-scale-interval", type=int, default=1000, metavar="N",
                   help="fp16: finite steps in a row before the loss scale doubles (1000)")
    g.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    g.add_argument("--save-params", metavar="FILE.npz", type=given,
                   help="write the trained parameters under their canonical names")
    g.add_argument("--log-every", type=int, default=0, help="print the loss every N steps")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--clip-grad", type=float, metavar="X",
                   help="scale the gradients to a global norm of at most X before each update")
    g.add_argument("--recompute", nargs="?", const="full", choices=["full", "selective"],
                   help="full: keep only each layer's (stage's) input, run its forward again in "
                        "the backward; selective: only attention's softmax part (GPT)")
    g.add_argument("--memory", action="store_true",
                   help="after training, print every rank's bytes by kind, counted from its arrays")
    c = ap.add_argument_group("checkpoints and failures")
    c.add_argument("--checkpoint", metavar="DIR", type=given,
                   help="write a checkpoint into DIR at the end (and every --checkpoint-every)")
    c.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="also write one every K steps (default 0: only at the end)")
    c.add_argument("--keep", type=int, default=2, metavar="N",
                   help="checkpoints kept in DIR (default 2)")
    c.add_argument("--resume", metavar="DIR", type=given,
                   help="continue from DIR's newest checkpoint, written by any scheme and layout")
    c.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="end the job when a rank waits more than S seconds in one MPI call, "
                        "naming the call (default 600; 0: never)")
    if scheme != "serial":
        g.add_argument("--explain", action="store_true",
                       help="narrate the first step: each seed step and each MPI call, every rank")
    m = ap.add_argument_group("model sizes and data")
    m.add_argument("--data", choices=["digits", "synthetic"], default="digits",
                   help="the MLP's data: the 8x8 digits (64 features, 10 classes), or synthetic "
                        "rows of any width, classes from a fixed random teacher (default digits)")
    m.add_argument("--samples", type=int, default=4096,
                   help="rows of the synthetic data set (default 4096)")
    m.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                   default=[64, 128, 64, 10], help="MLP widths (default 64,128,64,10)")
    m.add_argument("--d-model", type=int, default=64, help="GPT width (default 64)")
    m.add_argument("--n-heads", type=int, default=4, help="GPT attention heads (default 4)")
    m.add_argument("--n-layers", type=int, default=4 if scheme == "pipeline" else 2,
                   help="GPT blocks (default " + ("4 here: about one per stage)"
                                                  if scheme == "pipeline" else "2)"))
    m.add_argument("--seq-len", type=int, default=32, help="GPT context length (default 32)")
    ep = scheme == "expert_parallel"
    m.add_argument("--experts", type=int, default=8 if ep else 0, metavar="E",
                   help="GPT: a mixture of E expert feed-forwards in every block, top-k routed "
                        + ("(default 8)" if ep else "(default 0: one dense feed-forward; the "
                                                    "serial and expert-parallel trainers)"))
    m.add_argument("--top-k", type=int, default=2, metavar="K",
                   help="experts per token with --experts (default 2)")
    m.add_argument("--aux-loss-coef", type=float, default=0.01, metavar="X",
                   help="weight of the load-balancing loss with --experts (default 0.01)")


def bucket_flags(g):
    g.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient buckets of about X MiB, reverse layer order (default: one "
                        "bucket; 25 with --overlap, as PyTorch DDP)")
    g.add_argument("--overlap", action="store_true",
                   help="start each bucket's Iallreduce during the last backward")


def sequence_flag(g):
    g.add_argument("--sequence-parallel", action="store_true",
                   help="GPT: also split the LayerNorm regions along the sequence over the tp "
                        "ranks (reduce-scatter + allgather in place of each Allreduce)")


def pipeline_flags(g, schedules, micro_help):
    g.add_argument("--schedule", metavar="{" + ",".join(schedules) + "}",
                   help=f"{', '.join(schedules)} (default 1f1b; gpipe with --experts)")
    g.add_argument("--micro-batches", type=int, metavar="M", help=micro_help)
    g.add_argument("--partition", metavar="N,N,...", type=given,
                   help="layers per stage by hand, e.g. 2,1,1 (default: balance the FLOPs)")


def expert_flags(g, ep_help):
    g.add_argument("--ep", type=int, metavar="G", help=ep_help)
    g.add_argument("--a2a", choices=["mpi", "pairwise"], default="mpi",
                   help="the all-to-all: MPI's Alltoallv (default) or P-1 rounds of Sendrecv "
                        "by hand (the same results, bit for bit)")


def context_flags(g, cp_help, default=None):
    g.add_argument("--cp", type=int, metavar="G", default=default, help=cp_help)
    g.add_argument("--cp-algo", choices=["ring", "zigzag", "ulysses"], default="ring",
                   help="ring: K and V around the ring, contiguous chunks (default); zigzag: "
                        "the ring with chunks r and 2G-1-r, balanced; ulysses: all-to-alls "
                        "from sequence shards to head shards")


def scheme_flags(ap, scheme):
    if scheme == "data_parallel":
        g = ap.add_argument_group("data parallelism")
        g.add_argument("--sync", default="master", choices=["master", "allreduce", "ring"],
                       help="master: the seed's Reduce + Bcast through rank 0 (default); "
                            "allreduce: MPI Allreduce; ring: a ring allreduce from Sendrecv")
        bucket_flags(g)
        g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                       help="shard over the ranks (ZeRO): 1 the optimizer state, 2 also the "
                            "gradients (in --bucket-mb buckets, --overlap), 3 also the "
                            "parameters, layer by layer (as FSDP; --overlap prefetches)")
        g.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
        g.add_argument("--grad-sum", choices=["fp32", "bf16"], default="fp32",
                       help="with --precision bf16: sum the gradients in float32 (twice the "
                            "bytes, default) or as bf16 through a user-defined MPI operation")
    elif scheme == "tensor_parallel":
        ap.add_argument("--update", choices=["local", "master"], default="local",
                        help="local: each rank updates its shards (Megatron); master: rank 0 "
                             "gathers the gradients, updates, scatters the shards (the seed)")
        sequence_flag(ap)
    elif scheme == "pipeline":
        g = ap.add_argument_group("pipeline")
        pipeline_flags(g, CHOICES, "micro-batches per step (default 4)")
        g.add_argument("--chunks", type=int, metavar="V",
                       help="model chunks per rank for --schedule interleaved (default 2; the "
                            "model is cut into P*V pieces)")
        g.add_argument("--warmup", choices=WARMUPS, default=None,
                       help="the interleaved schedule's warm-up: production (Megatron-LM's and "
                            "PyTorch's, the default: 2(P-r-1) more chunk-forwards on rank r, a "
                            "step of slack for each message) or lean (P-r-1 fewer: holds less, "
                            "waits for every message)")
        g.add_argument("--timeline", default=DEFAULT_TIMELINE, metavar="FILE.png", type=given,
                       help="Gantt chart of a real step's trace, the median step by duration "
                            f"(default {DEFAULT_TIMELINE}; 'none' for no chart)")
        g.add_argument("--print-schedule", action="store_true",
                       help="print every stage's instruction list and exit (no MPI ranks needed)")
        g.add_argument("--stages", type=int, default=4,
                       help="number of stages for --print-schedule (default 4)")
    elif scheme == "expert_parallel":
        expert_flags(g := ap.add_argument_group("expert parallelism"),
                     "ranks an expert-parallel group holds the experts over (default: all P; "
                     "with G < P the P/G groups replicate the experts)")
        g.add_argument("--micro-batches", type=int, default=1,
                       help="pieces of each rank's rows, every forward before any backward "
                            "(default 1)")
    elif scheme == "context_parallel":
        context_flags(g := ap.add_argument_group("context parallelism"),
                      "ranks each sequence is split over (default: all P; with G < P the P/G "
                      "groups are data-parallel replicas)")
        g.add_argument("--micro-batches", type=int, default=1,
                       help="pieces of each replica's rows (default 1)")
    elif scheme == "hybrid":
        g = ap.add_argument_group("the process grid")
        g.add_argument("--dp", type=int, help="data-parallel replicas (default: N // (tp*pp))")
        g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (1)")
        g.add_argument("--pp", type=int, default=1, help="pipeline stages (1)")
        g.add_argument("--print-grid", action="store_true",
                       help="print every rank's (dp, tp, pp) coordinate and groups, then exit")
        sequence_flag(g)
        pipeline_flags(ap.add_argument_group("pipeline"), list(SCHEDULES),
                       "micro-batches per replica and step (default: 4, or fewer if a replica "
                       "has fewer rows)")
        bucket_flags(g := ap.add_argument_group("gradient sum over the data-parallel group"))
        g.add_argument("--zero", type=int, default=0, choices=range(4),
                       help="shard over dp (ZeRO): 1 the optimizer state, 2 also the gradients")
        expert_flags(ap.add_argument_group("experts (--experts E)"),
                     "replicas of a stage its experts are split over (default 1: every "
                     "replica holds them all)")
        context_flags(ap.add_argument_group("context parallelism (--cp G)"),
                      "replicas of a stage each sequence is split over (default 1: every "
                      "replica holds whole sequences)", default=1)


PROGS = {"serial": "Train the reference model on one process.",  # each scheme's --help line
         "data_parallel": "Train with P data-parallel replicas.",
         "tensor_parallel": "Train with every large matrix split over P ranks.",
         "pipeline": "Train across P pipeline stages (one per rank).",
         "hybrid": "Train with data x tensor x pipeline parallelism on N = dp*tp*pp ranks.",
         "expert_parallel": "Train a mixture of experts with its experts split over P ranks.",
         "context_parallel": "Train the GPT with every sequence split over P ranks."}
