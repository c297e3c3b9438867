"""Pictures of the course's ideas, drawn from the code that carries them out.

    python -m mpipar.tools.figures [--out lessons/figures]

Each picture runs the real function it shows and draws what that function did:

1. ``ring.png``: :func:`mpipar.data_parallel.ring_allreduce` on P = 4 threads standing in for
   ranks (:class:`~mpipar.tools.figures.draw.ThreadRanks`); each panel shows which ranks'
   contributions every chunk holds after one Sendrecv step, and the chunk each rank sent.
2. ``master_vs_ring.png``: the seed's master scheme (everything through rank 0) against the ring
   (each rank talks to its two neighbours), with the bytes per rank the ring run above sent.
3. ``megatron_mlp.png``: which block of the MLP's two matrices each rank holds
   (:class:`~mpipar.parts.tp_layers.ColumnParallelLinear`, then ``RowParallelLinear``) and
   where ``f`` and ``g`` sit, with their forward/backward rules quoted from their docstrings.
4. ``vocab_cross_entropy.png``: :class:`~mpipar.parts.tp_layers.VocabParallelCrossEntropy` on
   3 threads: the logits each rank holds and its three Allreduces (MAX, SUM, SUM).
5. ``schedules.png``: every pipeline schedule of :mod:`mpipar.parts.schedules` on 4 stages and 4
   micro-batches, as :func:`~mpipar.parts.schedules.simulate` times its instruction lists.
6. ``grid.png``: the ranks of a 2 x 2 x 2 :class:`~mpipar.mpi.grid.Grid` and the groups its three
   ``Split`` calls form (a stand-in communicator records the colours).
7. ``dispatch.png``: :class:`~mpipar.expert_parallel.ExpertParallelMoE` on 4 threads: each rank's
   routing table, the rows it sends to each rank (the counts' Alltoall gives each rank its
   column), and every row that arrived, identified as (source, token, expert).
8. ``context_ring.png``: :class:`~mpipar.context_parallel.RingAttention` on 4 threads, plain and
   zigzag: at each step of the ring, whose keys a rank holds and which (query chunk, key chunk)
   pairs it attends, skips or masks; its output checked against the serial attention core.
9. ``precision_ranges.png``: every gradient entry of the serial GPT's first step, by power of two,
   against fp16's range, without a loss scale and with 2^16 (and bf16's, which holds them all).
10. ``warmup.png``: the interleaved schedule's production and lean warm-ups, simulated for a
    range of message latencies: the bubble of each, and each stage's stash.
11. ``v_schedules.png``: ZB-V and DualPipeV (two chunks a stage, in a V) beside 1F1B and
    ZB-H1 on 4 stages and 8 micro-batches, as ``schedules.png`` draws them.
12. ``collectives.png``: Scatter, Gather, Allgather, Reduce_scatter and Alltoall on 4 threads
    (each rank's buffer before and after, every element labelled with the rank it started on),
    and lesson 0's binomial-tree broadcast (``lessons/code/00_bcast_reduce.py``'s own
    ``bcast_tree``) on 8: which rank sends to which in each of its 3 rounds.

Pictures 1-4 live in :mod:`mpipar.tools.figures.collectives`, 5-6, 10 and 11 in
:mod:`mpipar.tools.figures.layouts`, 7 in :mod:`mpipar.tools.figures.experts`, 8 in
:mod:`mpipar.tools.figures.context`, 9 in :mod:`mpipar.tools.figures.precision`, 12 in
:mod:`mpipar.tools.figures.basics`, the stand-ins and shared settings in
:mod:`mpipar.tools.figures.draw`. Each figure function returns the data it
drew (lists and rounded numbers; a ``*_run`` or ``*_layout`` function computes it without
drawing); ``data.json`` next to the PNGs holds a SHA-256 of each, and the tests compare it with
a fresh run: a picture that no longer matches the code is caught, whichever matplotlib version
renders the pixels. Left out: a picture of ZeRO's shards and of the hybrid's pipeline of
tensor-parallel stages.
"""

import hashlib
import json
from pathlib import Path

from mpipar.tools.bench.common import OneLineParser

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "lessons" / "figures"


def figures():
    """name -> function(path) that draws the PNG and returns the data it drew."""
    from mpipar.tools.figures import basics as B
    from mpipar.tools.figures import collectives as C
    from mpipar.tools.figures import context as R
    from mpipar.tools.figures import experts as X
    from mpipar.tools.figures import layouts as L
    from mpipar.tools.figures import precision as P

    return {"ring": C.ring_figure, "master_vs_ring": C.master_vs_ring_figure,
            "megatron_mlp": C.megatron_figure, "vocab_cross_entropy": C.cross_entropy_figure,
            "schedules": L.schedules_figure, "grid": L.grid_figure, "dispatch": X.dispatch_figure,
            "context_ring": R.ring_figure, "precision_ranges": P.precision_figure,
            "warmup": L.warmup_figure, "v_schedules": L.v_schedules_figure,
            "collectives": B.collectives_figure}


def digest(data):
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def write_all(out):
    """Draw every figure into ``out`` and write data.json (name: SHA-256 of the data drawn)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hashes = {name: digest(fn(out / f"{name}.png")) for name, fn in figures().items()}
    (out / "data.json").write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return hashes


def main(argv=None):
    ap = OneLineParser(prog="python -m mpipar.tools.figures",
                       description="Draw the course's pictures of the ideas.")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the PNGs and data.json")
    args = ap.parse_args(argv)
    for name in write_all(args.out):
        print(Path(args.out) / f"{name}.png")
