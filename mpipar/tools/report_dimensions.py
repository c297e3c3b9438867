"""The sections of ``plots/REPORT.md`` on the field's newer dimensions: expert parallelism's
load imbalance (``experts.csv``), each context-parallel rank's attention (``context.csv``) and
16-bit training against float32 (``precision.csv``). Each reads its numbers from its CSV in
plots/ and returns its lines; :func:`mpipar.tools.report_text.write_report` places them."""

from mpipar.tools.bench.common import PLOTS, read_csv
from mpipar.tools.bench.common import csv_float as _f


def experts_section():
    """What an unbalanced router costs an expert-parallel step (experts.csv), when measured."""
    if not (PLOTS / "experts.csv").exists():
        return []
    rows = read_csv("experts.csv")
    coefs = sorted({_f(r, "aux_coef") for r in rows})
    by = {c: [r for r in rows if _f(r, "aux_coef") == c] for c in coefs}

    def median(key, c):
        values = sorted(_f(r, key) for r in by[c])
        return values[len(values) // 2]

    def spread(key, c):
        values = sorted(_f(r, key) for r in by[c])
        return f"{median(key, c):.2f} ({values[0]:.2f}-{values[-1]:.2f})"

    first, base = by[coefs[0]][0], coefs[-1]
    runs = "; ".join(
        f"with `--aux-loss-coef {c:g}` the busiest rank's experts run "
        f"{median('busiest_over_mean', c):.2f} times the mean rows (tokens per expert up to "
        f"{median('tokens_per_expert_max_over_mean', c):.2f} times the mean) and a step takes "
        + ("the baseline time" if c == base else
           f"{spread('ratio_to_balanced', c)} times the baseline's (the cost model: "
           f"{median('predicted_ratio', c):.2f})") for c in coefs)
    return [
        "## Expert parallelism: what load imbalance costs",
        "",
        "![load imbalance](experts.png)",
        "",
        f"The mixture-of-experts GPT of lesson 11 (8 experts a block, top-2) on 2 ranks, "
        f"`--ep 2`, 4 experts a rank, a core each (`python -m mpipar.tools.bench experts`, "
        f"`experts.csv`), trained {first['warmup']} steps from one seed, then timed in turns "
        f"in the same launch ({first['steps']} steps each, medians, the spread over "
        f"{len(by[base])} launches; the busiest rank's rows summed over the 2 MoE layers): "
        f"{runs}.",
        "",
        "The cost model (`simulate --ep 2 --imbalance X`) leaves out two things that pull "
        "opposite ways: it counts the experts' FLOPs at one rank's GEMM rate (`flops.csv`), "
        "which the experts' small products (a few hundred rows by 64 x 256, one call each) may "
        "not reach (then the imbalance costs more), and it has no term for the work of a step "
        "that is not FLOPs (Python, the all-to-alls' copies), which the imbalance does not "
        "grow (then it costs less). On 4 ranks of this machine's 2 cores the busiest rank "
        "would share its core with a waiting one, so the ratio is measured on 2.",
        "",
    ]


def context_section():
    """Each cp rank's attention compute and the step, by algorithm (context.csv), if measured."""
    if not (PLOTS / "context.csv").exists():
        return []
    rows = read_csv("context.csv")
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    by = {a: [r for r in rows if r["algo"] == a] for a in algos}

    def spread(key, a):
        values = sorted(_f(r, key) for r in by[a])
        return f"{values[len(values) // 2]:.2f} ({values[0]:.2f}-{values[-1]:.2f})"

    first = by[algos[0]][0]
    parts = "; ".join(
        f"`--cp-algo {a}`: rank 0 {spread('attention_ms_rank0', a)} ms and rank 1 "
        f"{spread('attention_ms_rank1', a)} ms of attention a step, a balance of "
        f"{spread('balance', a)}" + ("" if a == "ring" else
                                      f", a step {spread('ratio_to_ring', a)} of the ring's")
        for a in algos)
    return [
        "## Context parallelism: each rank's attention",
        "",
        "![attention per cp rank](context.png)",
        "",
        f"The GPT of lesson 12 with 256 tokens a sequence on 2 ranks, `--cp 2`, a core each "
        f"(`python -m mpipar.tools.bench context`, `context.csv`): three trainers from one seed "
        f"timed in turns in the same launch ({first['steps']} steps each, medians; the spread "
        f"over {len(by[algos[0]])} launches), each rank's attention compute from the trace. "
        f"{parts}. The causal work allows the ring G/(2G-1) = 0.67 on 2 ranks, and 0.75 for "
        "the blocks this code computes (each diagonal block whole, its masked half included), "
        "the zigzag and Ulysses 1. Ulysses computes every score of its heads, the masked half "
        "too, where the zigzag skips the masked chunk pairs: its ranks are even but each does "
        "more. On 4 ranks of this machine's 2 cores a waiting rank would lend its core to a "
        "busy one, so the balance is measured on 2.",
        "",
    ]


def precision_section():
    """The 16-bit runs' losses against float32's, and the gradient sums' bytes
    (precision.csv), when measured."""
    if not (PLOTS / "precision.csv").exists():
        return []
    rows = read_csv("precision.csv")
    final = {r["precision"]: r for r in rows if r["kind"] == "final"}
    sums = {r["precision"]: r for r in rows if r["kind"] == "grad_sum"}
    base = final["fp32"]
    runs = "; ".join(
        f"{p}: train loss {_f(r, 'loss'):.4f}, val loss {_f(r, 'val_loss'):.4f} "
        f"({_f(r, 'val_loss') - _f(base, 'val_loss'):+.4f} from fp32), {r['skipped']} steps "
        f"skipped" for p, r in final.items() if p != "fp32")
    return [
        "## Mixed precision: 16-bit training against float32",
        "",
        "![loss curves by precision](precision.png)",
        "",
        f"The serial GPT of the lessons, {base['step']} steps from one seed "
        f"(`python -m mpipar.tools.bench precision`, `precision.csv`): fp32 ends at train "
        f"loss {_f(base, 'loss'):.4f}, val loss {_f(base, 'val_loss'):.4f}; {runs}. A gradient "
        f"sum of {int(sums['fp32']['gradients']):,} bf16 gradients on 4 replicas sends "
        f"{int(sums['fp32']['sent_bytes']):,} bytes a rank widened to float32 (`--grad-sum "
        f"fp32`) and {int(sums['bf16']['sent_bytes']):,} as bf16 words (`--grad-sum bf16`, "
        "every partial sum rounded; `tests/mpi/bf16_checks.py` measures its error). These "
        "are not timings: the same run gives the same numbers on this machine. bf16 keeps 7 "
        "mantissa bits to fp16's 10, and drifts further from the float32 curve.",
        "",
    ]
