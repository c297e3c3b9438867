"""The student track's exercises: for each, the file and functions the learner writes, the task
(the stub's message), and how :mod:`mpipar.tools.student` grades it: the training run against
the serial trainer (ranks, scheme, flags, model) and the direct tests that run first."""

from collections import namedtuple

MLP = ["--model", "mlp", "--sizes", "64,16,16,16,10", "--batch-size", "12", "--steps", "3"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "4", "--steps", "3"]

Exercise = namedtuple("Exercise", "name path functions task ranks scheme flags model tests")

EXERCISES = [
    Exercise(
        "ring-allreduce", "mpipar/data_parallel.py", ("ring_allreduce",),
        "sum `buf` over the ranks in place: P-1 reduce-scatter steps, then P-1 allgather "
        "steps, each one Sendrecv to the right neighbour and from the left (lesson 3)",
        4, "data_parallel", ["--sync", "ring"], MLP,
        ("tests/test_data_parallel.py::test_the_ring_alone_chunk_by_chunk[4]",)),
    Exercise(
        "overlap-hook", "mpipar/data_parallel.py", ("GradSync.grads_ready",),
        "count the parameters whose gradients are final; with overlap, launch every bucket "
        "whose gradients are all final, in order, and progress the posted requests (lesson 3)",
        2, "data_parallel", ["--sync", "allreduce", "--overlap", "--bucket-mb", "0.002"], MLP,
        ("tests/test_data_parallel.py::test_every_mode_equals_serial[2]",)),
    Exercise(
        "zero1", "mpipar/data_parallel.py",
        ("ZeroOptimizer.reduce_scatter_grads", "ZeroOptimizer.allgather_params"),
        "ZeRO-1: reduce-scatter the flat, padded gradient so that this rank holds the sum of "
        "its block; after the update, allgather every rank's shard back into the parameters",
        3, "data_parallel", ["--sync", "allreduce", "--zero", "1"], [*MLP, "--optim", "adam"], ()),
    Exercise(
        "f-backward", "mpipar/parts/tp_layers.py", ("CopyToTP.backward",),
        "Megatron's f: the input gradient of a column-parallel layer is the SUM over the "
        "tensor-parallel ranks of each rank's part (lesson 4)",
        2, "tensor_parallel", [], GPT, ()),
    Exercise(
        "g-forward", "mpipar/parts/tp_layers.py", ("ReduceFromTP.forward",),
        "Megatron's g: the output of a row-parallel layer is the SUM over the ranks of their "
        "partial products (lesson 4)",
        2, "tensor_parallel", [], GPT, ()),
    Exercise(
        "row-parallel", "mpipar/parts/tp_layers.py",
        ("RowParallelLinear.forward", "RowParallelLinear.backward_input"),
        "the row-parallel Linear: forward caches its input slice, sums the partial products "
        "through g and adds the replicated bias once; backward needs no message (lesson 4)",
        2, "tensor_parallel", [], GPT,
        ("tests/test_tensor_parallel.py::test_each_layer_matches_its_dense_twin[2]",)),
    Exercise(
        "1f1b", "mpipar/parts/schedules.py", ("one_f_one_b",),
        "the 1F1B instruction list of one stage: warm-up forwards, then one forward one "
        "backward, then the remaining backwards, then the optimizer step (lesson 5)",
        2, "pipeline", ["--schedule", "1f1b", "--micro-batches", "4"], MLP,
        ("tests/test_schedules.py::test_exact_1f1b_three_stages_four_micro_batches",
         "tests/test_schedules.py::test_happens_before_and_matched_messages")),
    Exercise(
        "dispatch", "mpipar/expert_parallel.py",
        ("pairwise_alltoallv", "ExpertParallelMoE.dispatch", "ExpertParallelMoE.arrivals"),
        "the dispatch: exchange the pair counts per expert (Alltoall), send each token's row "
        "to its expert's rank by P-1 rounds of Sendrecv at the counts' displacements, and "
        "find each expert's rows in what arrived (lesson 11)",
        4, "expert_parallel", ["--a2a", "pairwise", "--micro-batches", "2"],
        [*GPT[:-4], "--batch-size", "8", "--steps", "3", "--experts", "8", "--top-k", "2"],
        ()),
    Exercise(
        "online-softmax", "mpipar/context_parallel.py", ("block_attention", "merge"),
        "the online softmax: one block's attention output and log-sum-exp with the maximum "
        "taken first, and the merge of two partial attentions by their log-sum-exps, which "
        "must not overflow at logits of 1e4 (lesson 12)",
        4, "context_parallel", ["--cp-algo", "zigzag", "--micro-batches", "2"], GPT,
        ("tests/test_context_parallel.py::test_the_merge_of_blocks_is_the_softmax_over_their_"
         "union",)),
]


EXERCISE_FILES = sorted({ex.path for ex in EXERCISES})


def find(name):
    for ex in EXERCISES:
        if ex.name == name:
            return ex
    raise SystemExit(f"error: no exercise {name!r}; "
                     "`python -m mpipar.tools.student list` names them")
