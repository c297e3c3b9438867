"""python -m mpipar.tools.bench NAME (engine, flops, net, dp, pp, pp_wide, schedules, tp,
hybrid, experts, context, precision, ckpt, memory, overhead, link, warmup, wait): run one
benchmark, write its CSV and pictures into --out DIR (default: a scratch folder; --out plots
replaces the committed results, as make report does). Flags given beside --quick win over its
shorter defaults."""

import argparse
import importlib
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before NumPy loads: one BLAS thread

BENCHES = {
    "engine": "the autograd engine against bare NumPy (one MLP training step)",
    "net": "ping-pong latency/bandwidth (alpha, beta) and the allreduce algorithms",
    "dp": "data parallelism: step time and speedup per sync mode",
    "pp": "pipeline parallelism: bubble share, activation memory, step time",
    "pp_wide": "the pipeline at P = 2, m = 16 with micro-batches of 256 rows: the speedup",
    "schedules": "every pipeline schedule, V-shaped ones too: measured bubble, step against 1F1B",
    "tp": "tensor parallelism: step time and communication share against hidden size",
    "hybrid": "every DP x TP x PP layout of 4 ranks",
    "experts": "expert parallelism: a step with an unbalanced router against a balanced one",
    "context": "context parallelism: each rank's attention with the ring, zigzag and Ulysses",
    "precision": "fp32, bf16 and fp16 training losses; the bytes of each gradient sum",
    "flops": "the FLOP rate per rank while 1, 2 or 4 ranks compute at once",
    "ckpt": "checkpoint write and read time per rank against the model's size",
    "memory": "bytes each rank holds (the memory ledger) and step time: ZeRO 0-3, recomputation",
    "overhead": "the comm wrapper against raw mpi4py, the engine against bare NumPy (16-128 rows)",
    "link": "across an emulated cluster's link (root): ping-pong and data-parallel step time",
    "warmup": "the interleaved schedule's two warm-ups across an emulated link (root): bubble",
    "wait": "4 ranks on 2 cores: each waiting strategy per scheme; the main job on 4 against 2",
}


def main(argv=None):
    from mpipar.tools.bench.common import OneLineParser

    ap = OneLineParser(prog="python -m mpipar.tools.bench", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(f"  {k:8s} {v}" for k, v in BENCHES.items()),
                       add_help=False)  # `bench NAME --help` is NAME's help: passed on below
    ap.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    ap.add_argument("which", nargs="?", choices=list(BENCHES))
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args, rest = ap.parse_known_args(argv)
    if args.which is None:
        if args.help:
            return ap.print_help()
        ap.error("the following arguments are required: which")
    module = importlib.import_module(f"mpipar.tools.bench.{args.which}")
    module.main(rest + (["--help"] if args.help else []) + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    main()
