"""The student track's exercises: for each, the file and functions the learner writes, the task
(the stub's message), and how :mod:`mpipar.tools.student` grades it: the training run against
the serial trainer (ranks, scheme, flags, model) and the direct tests that run first; and the
minutes it may take a learner who has read its lesson.

The first nine are the core of one piece each (3 to 15 lines). The last three build a scheme
(30 to 80 lines): the seed's data parallelism from the bare trainer, ZeRO-1 with its shard
bookkeeping, and Megatron's MLP block of a column- and a row-parallel layer with f and g. A
function can belong to a small exercise and to a large one (f's backward is part of the MLP
block); the stub names both, and each exercise is graded with its own functions as written."""

from collections import namedtuple

MLP = ["--model", "mlp", "--sizes", "64,16,16,16,10", "--batch-size", "12", "--steps", "3"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "4", "--steps", "3"]

ZERO_MLP = [*MLP, "--optim", "adam"]  # 1,754 parameters: 3 blocks of 585 hold 1 padding value

Exercise = namedtuple("Exercise",
                      "name path functions task ranks scheme flags model tests minutes")

EXERCISES = [
    Exercise(
        "ring-allreduce", "mpipar/data_parallel.py", ("ring_allreduce",),
        "sum `buf` over the ranks in place: P-1 reduce-scatter steps, then P-1 allgather "
        "steps, each one Sendrecv to the right neighbour and from the left (lesson 3)",
        4, "data_parallel", ["--sync", "ring"], MLP,
        ("tests/test_data_parallel.py::test_the_ring_alone_chunk_by_chunk[4]",), 30),
    Exercise(
        "overlap-hook", "mpipar/data_parallel.py", ("GradSync.grads_ready",),
        "count the parameters whose gradients are final; with overlap, launch every bucket "
        "whose gradients are all final, in order, and progress the posted requests (lesson 3)",
        2, "data_parallel", ["--sync", "allreduce", "--overlap", "--bucket-mb", "0.002"], MLP,
        ("tests/test_data_parallel.py::test_every_mode_equals_serial[2]",), 20),
    Exercise(
        "zero1", "mpipar/data_parallel.py",
        ("ZeroOptimizer.reduce_scatter_grads", "ZeroOptimizer.allgather_params"),
        "ZeRO-1: reduce-scatter the flat, padded gradient so that this rank holds the sum of "
        "its block; after the update, allgather every rank's shard back into the parameters",
        3, "data_parallel", ["--sync", "allreduce", "--zero", "1"], ZERO_MLP, (), 20),
    Exercise(
        "f-backward", "mpipar/parts/tp_layers.py", ("CopyToTP.backward",),
        "Megatron's f: the input gradient of a column-parallel layer is the SUM over the "
        "tensor-parallel ranks of each rank's part (lesson 4)",
        2, "tensor_parallel", [], GPT, (), 10),
    Exercise(
        "g-forward", "mpipar/parts/tp_layers.py", ("ReduceFromTP.forward",),
        "Megatron's g: the output of a row-parallel layer is the SUM over the ranks of their "
        "partial products (lesson 4)",
        2, "tensor_parallel", [], GPT, (), 10),
    Exercise(
        "row-parallel", "mpipar/parts/tp_layers.py",
        ("RowParallelLinear.forward", "RowParallelLinear.backward_input"),
        "the row-parallel Linear: forward caches its input slice, sums the partial products "
        "through g and adds the replicated bias once; backward needs no message (lesson 4)",
        2, "tensor_parallel", [], GPT,
        ("tests/test_tensor_parallel.py::test_each_layer_matches_its_dense_twin[2]",), 20),
    Exercise(
        "1f1b", "mpipar/parts/schedules.py", ("one_f_one_b",),
        "the 1F1B instruction list of one stage: warm-up forwards, then one forward one "
        "backward, then the remaining backwards, then the optimizer step (lesson 5)",
        2, "pipeline", ["--schedule", "1f1b", "--micro-batches", "4"], MLP,
        ("tests/test_schedules.py::test_1f1b_runs_for_every_p_and_m_and_keeps_its_stash",
         "tests/test_schedules.py::test_exact_1f1b_three_stages_four_micro_batches",
         "tests/test_schedules.py::test_happens_before_and_matched_messages"), 30),
    Exercise(
        "dispatch", "mpipar/expert_parallel.py",
        ("pairwise_alltoallv", "ExpertParallelMoE.dispatch", "ExpertParallelMoE.arrivals"),
        "the dispatch: exchange the pair counts per expert (Alltoall), send each token's row "
        "to its expert's rank by P-1 rounds of Sendrecv at the counts' displacements, and "
        "find each expert's rows in what arrived (lesson 11)",
        4, "expert_parallel", ["--a2a", "pairwise", "--micro-batches", "2"],
        [*GPT[:-4], "--batch-size", "8", "--steps", "3", "--experts", "8", "--top-k", "2"],
        (), 45),
    Exercise(
        "online-softmax", "mpipar/context_parallel.py", ("block_attention", "merge"),
        "the online softmax: one block's attention output and log-sum-exp with the maximum "
        "taken first, and the merge of two partial attentions by their log-sum-exps, which "
        "must not overflow at logits of 1e4 (lesson 12)",
        4, "context_parallel", ["--cp-algo", "zigzag", "--micro-batches", "2"], GPT,
        ("tests/test_context_parallel.py::test_the_merge_of_blocks_is_the_softmax_over_their_"
         "union",), 40),
    # -- the larger ones: a scheme, or a scheme's core, from what the reference leaves --
    Exercise(
        "seed-dp", "mpipar/data_parallel.py", ("bcast_params", "MasterScheme.step"),
        "the seed's data parallelism, Steps 1 to 5: the master broadcasts the parameters "
        "(one flat buffer), scatters the batch's rows, every rank runs forward and backward "
        "on its rows, Reduce sums the flat gradients on the master, which updates and "
        "broadcasts the new parameters (lesson 3)",
        3, "data_parallel", ["--sync", "master"], MLP, (), 60),
    Exercise(
        "zero1-shards", "mpipar/data_parallel.py",
        ("ZeroOptimizer.__init__", "ZeroOptimizer.reduce_scatter_grads",
         "ZeroOptimizer.allgather_params"),
        "ZeRO-1 with its bookkeeping: lay the parameters and gradients end to end in two flat "
        "buffers padded to P equal blocks, make each parameter a view into them, give this "
        "rank's block to the optimizer as its shard, then reduce-scatter and allgather "
        "(lesson 3)",
        3, "data_parallel", ["--sync", "allreduce", "--zero", "1"], ZERO_MLP, (), 45),
    Exercise(
        "tp-mlp", "mpipar/parts/tp_layers.py",
        ("CopyToTP.forward", "CopyToTP.backward", "ReduceFromTP.forward",
         "ReduceFromTP.backward", "ColumnParallelLinear.forward",
         "ColumnParallelLinear.backward_input", "RowParallelLinear.forward",
         "RowParallelLinear.backward_input"),
        "Megatron's MLP block: a column-parallel Linear behind f, a row-parallel Linear "
        "followed by g, each layer's forward and input gradient and the two conjugate "
        "operators, so that a block on t ranks computes what the dense block computes "
        "(lesson 4)",
        2, "tensor_parallel", [], MLP,  # two blocks: the second's f sums dx
        ("tests/test_tensor_parallel.py::test_each_layer_matches_its_dense_twin[2]",), 60),
]


EXERCISE_FILES = sorted({ex.path for ex in EXERCISES})


def find(name):
    for ex in EXERCISES:
        if ex.name == name:
            return ex
    raise SystemExit(f"error: no exercise {name!r}; "
                     "`python -m mpipar.tools.student list` names them")
