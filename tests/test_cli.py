"""Every refusal of the runner's table, without MPI ranks: each bad input ends with exit code 2
and one clear message (the distributed tests check that every rank of a job exits so)."""

import pytest
from conftest import assert_refused

from mpipar import serial
from mpipar.runner.cli import FLAG_RULES, MODEL_RULES, check_model, parse_args

CASES = [  # (scheme, ranks, flags, what the message says)
    ("serial", 2, [], "the serial trainer is one process, but this job has 2 ranks"),
    ("serial", 1, ["--steps", "0"], "--steps must be positive, got 0"),
    ("serial", 1, ["--lr", "nan"], "--lr must be positive and finite, got nan"),
    ("serial", 1, ["--lr", "inf"], "--lr must be positive and finite, got inf"),
    ("serial", 1, ["--seed", "-1"], "--seed must be 0 or more, got -1"),
    ("serial", 1, ["--log-every", "-5"], "--log-every must be 0 (never) or more"),
    ("serial", 1, ["--sizes", "64,0,10"], "every --sizes entry must be positive"),
    ("serial", 1, ["--model", "gpt", "--n-layers", "0"], "--n-layers and --seq-len must be"),
    ("serial", 1, ["--model", "gpt", "--seq-len", "-8"], "--n-layers and --seq-len must be"),
    ("serial", 1, ["--model", "gpt", "--batch-size", "100000000"],
     "GiB of activations in one step, more than this machine's"),
    ("serial", 1, ["--checkpoint-every", "5"], "--checkpoint-every 5 needs --checkpoint DIR"),
    ("serial", 1, ["--keep", "0"], "--keep must be at least 1, got 0"),
    ("serial", 1, ["--clip-grad", "0"], "--clip-grad must be a positive finite norm, got 0.0"),
    ("pipeline", 2, ["--clip-grad", "-1"], "--clip-grad must be a positive finite norm, got -1.0"),
    ("hybrid", 4, ["--clip-grad", "nan"], "--clip-grad must be a positive finite norm, got nan"),
    ("data_parallel", 2, ["--recompute"], "--recompute is for the serial, tensor-parallel"),
    ("serial", 1, ["--timeout", "nan"], "--timeout must be 0 (never) or a positive number"),
    ("data_parallel", 2, ["--sync", "ring", "--bucket-mb", "nan"],
     "--bucket-mb must be positive and needs --sync allreduce or ring (got nan"),
    ("serial", 1, ["--batch-size", "5000"], "--batch-size 5000 is more than the 1438 training"),
    ("serial", 1, ["--data", "synthetic", "--samples", "100", "--batch-size", "90"],
     "--batch-size 90 is more than the 80 training rows of the synthetic data"),
    ("serial", 1, ["--batch-size", "-1"], "--batch-size must be positive, got -1"),
    ("serial", 1, ["--batch-size", "0"], "--batch-size must be positive, got 0"),
    ("serial", 1, ["--save-params", ""], "argument --save-params: an empty value names nothing"),
    ("serial", 1, ["--checkpoint", " "], "argument --checkpoint: an empty value names nothing"),
    ("data_parallel", 2, ["--resume", ""], "argument --resume: an empty value names nothing"),
    ("pipeline", 2, ["--partition", ""], "argument --partition: an empty value names nothing"),
    ("pipeline", 2, ["--timeline", ""], "argument --timeline: an empty value names nothing"),
    ("serial", 1, ["--experts", "4"], "--experts 4: a mixture of experts replaces the GPT's"),
    ("serial", 1, ["--model", "gpt", "--experts", "-1"], "--experts -1: a mixture of experts"),
    ("serial", 1, ["--model", "gpt", "--experts", "4", "--top-k", "0"],
     "--top-k 0 of --experts 4: each token goes to between 1 and E experts"),
    ("serial", 1, ["--model", "gpt", "--experts", "4", "--top-k", "5"],
     "--top-k 5 of --experts 4: each token goes to between 1 and E experts"),
    ("serial", 1, ["--model", "gpt", "--experts", "2", "--aux-loss-coef", "-0.1"],
     "--aux-loss-coef must be 0 or more and finite, got -0.1"),
    ("serial", 1, ["--model", "gpt", "--experts", "2", "--aux-loss-coef", "nan"],
     "--aux-loss-coef must be 0 or more and finite, got nan"),
    ("data_parallel", 2, ["--model", "gpt", "--experts", "2"],
     "--experts trains on the serial, expert-parallel and hybrid trainers only so far"),
    ("hybrid", 4, ["--ep", "2"], "--ep 2 splits experts: give --experts E"),
    ("hybrid", 4, ["--model", "gpt", "--experts", "4", "--pp", "2", "--schedule", "1f1b"],
     "--experts in the hybrid runs --schedule gpipe: the load-balancing loss needs the whole "
     "batch's routing before the first backward, and 1f1b starts a backward"),
    ("hybrid", 4, ["--model", "gpt", "--experts", "4", "--tp", "2"],
     "--experts in the hybrid takes no --tp"),
    ("hybrid", 4, ["--model", "gpt", "--experts", "4", "--zero", "1"],
     "--experts in the hybrid takes no --zero, --overlap or --recompute"),
    ("hybrid", 4, ["--model", "gpt", "--experts", "4", "--ep", "3"],
     "--ep 3 must divide the 4 data-parallel replicas"),
    ("hybrid", 4, ["--model", "gpt", "--experts", "6", "--ep", "4"],
     "--experts 6 do not split over the 4 ranks of an expert-parallel group (--ep 4)"),
    ("expert_parallel", 4, ["--experts", "0"],
     "expert parallelism splits a mixture of experts: give --experts E of 1 or more, got 0"),
    ("expert_parallel", 4, ["--ep", "3"],
     "--ep 3 must be at least 1 and divide the job's 4 ranks into expert-parallel groups"),
    ("expert_parallel", 4, ["--ep", "0"], "--ep 0 must be at least 1"),
    ("expert_parallel", 4, ["--experts", "6"], "--experts 6 do not split over the 4 ranks of an "
     "expert-parallel group (--ep 4): use a multiple of 4 experts, or another --ep"),
    ("expert_parallel", 2, ["--recompute"], "--recompute is not in the expert-parallel trainer"),
    ("expert_parallel", 4, ["--micro-batches", "0"], "--micro-batches must be positive, got 0"),
    ("expert_parallel", 4, ["--batch-size", "4", "--micro-batches", "2"],
     "the global batch of 4 rows cannot be split over 4 ranks x 2 micro-batch(es)"),
    ("expert_parallel", 2, ["--model", "mlp"], "--experts 8: a mixture of experts replaces"),
    ("expert_parallel", 2, ["--top-k", "9"], "--top-k 9 of --experts 8: each token goes to"),
    ("hybrid", 4, ["--model", "mlp", "--dp", "4", "--cp", "2"],
     "--cp 2 in the hybrid splits the dense GPT's sequences: no --model mlp"),
    ("hybrid", 4, ["--model", "gpt", "--cp", "3"],
     "--cp 3 must be at least 1 and divide the 4 data-parallel replicas"),
    ("hybrid", 4, ["--model", "gpt", "--cp", "2", "--cp-algo", "zigzag", "--seq-len", "30"],
     "--cp-algo zigzag on --cp 2 cannot cut --seq-len 30 into its chunks"),
    ("hybrid", 4, ["--model", "gpt", "--dp", "2", "--tp", "2", "--cp", "2", "--cp-algo",
                   "ulysses", "--n-heads", "2", "--d-model", "16"],
     "--cp-algo ulysses gives each of the --tp 2 x --cp 2 ranks whole heads, but --n-heads 2"),
    ("hybrid", 4, ["--model", "gpt", "--dp", "2", "--tp", "2", "--cp", "2",
                   "--sequence-parallel", "--seq-len", "6"],
     "--sequence-parallel with --cp 2 splits each rank's 6 / 2 tokens over the 2"),
    ("data_parallel", 2, ["--precision", "bf16", "--sync", "master"],
     "--precision bf16 is not in the seed's master update (--sync master, --update master)"),
    ("data_parallel", 2, ["--sync", "allreduce", "--grad-sum", "bf16"],
     "--grad-sum bf16 sums bf16 gradients: it needs --precision bf16"),
    ("serial", 1, ["--precision", "fp16", "--dtype", "float64"],
     "--precision fp16 stores in 16 bits and computes in float32 with NumPy"),
    ("serial", 1, ["--precision", "fp16", "--loss-scale", "nan"],
     "--precision fp16 needs a positive, finite --loss-scale"),
    ("context_parallel", 2, ["--model", "mlp"], "context parallelism splits the GPT's sequences"),
    ("context_parallel", 4, ["--cp", "3"], "--cp 3 must be at least 1 and divide the job's 4"),
    ("context_parallel", 4, ["--cp", "0"], "--cp 0 must be at least 1"),
    ("context_parallel", 4, ["--cp-algo", "zigzag", "--seq-len", "20"],
     "--cp-algo zigzag cuts each sequence into 2 x 4 chunks, but --seq-len 20 is not divisible "
     "by 8: use a multiple of 8"),
    ("context_parallel", 4, ["--seq-len", "30"], "--cp-algo ring cuts each sequence into 4 "
                                                 "chunks, but --seq-len 30 is not divisible by 4"),
    ("context_parallel", 4, ["--cp-algo", "ulysses", "--n-heads", "2"],
     "--cp-algo ulysses gives each of the 4 ranks of a group whole heads, but --n-heads 2"),
    ("context_parallel", 2, ["--recompute"], "--recompute is not in the context-parallel"),
    ("context_parallel", 2, ["--experts", "4"], "--experts trains on the serial, expert-parallel"),
    ("context_parallel", 4, ["--micro-batches", "0"], "--micro-batches must be positive, got 0"),
    ("context_parallel", 4, ["--cp", "2", "--batch-size", "2", "--micro-batches", "2"],
     "the global batch of 2 rows cannot be split over 2 replicas x 2 micro-batch(es)"),
    ("serial", 1, ["--lr", "0"], "--lr must be positive and finite, got 0.0"),
    ("serial", 1, ["--sizes", "64,10,9"], "--sizes must start with 64 (pixels) and end with 10"),
    ("serial", 1, ["--data", "synthetic", "--samples", "5"], "--data synthetic needs --samples"),
    ("serial", 1, ["--model", "gpt", "--data", "synthetic"], "--data synthetic is for the MLP"),
    ("serial", 1, ["--model", "gpt", "--d-model", "10", "--n-heads", "3"],
     "--d-model 10 is not divisible by --n-heads 3"),
    ("hybrid", 4, ["--dp", "0"], "--dp must be at least 1, got 0"),
    ("hybrid", 4, ["--tp", "0"], "--tp must be at least 1, got 0"),
    ("hybrid", 4, ["--pp", "-1"], "--pp must be at least 1, got -1"),
    ("hybrid", 4, ["--tp", "2", "--model", "mlp", "--sequence-parallel"],
     "--sequence-parallel splits the GPT's sequence, and the MLP has none: use --model gpt"),
    ("tensor_parallel", 4, ["--model", "gpt", "--seq-len", "6", "--sequence-parallel"],
     "--seq-len 6 is not divisible by 4: use a multiple of 4"),
    ("pipeline", 2, ["--sequence-parallel"], "unrecognized arguments: --sequence-parallel"),
    ("data_parallel", 2, ["--micro-batches", "0"], "--micro-batches must be positive, got 0"),
    ("data_parallel", 4, ["--batch-size", "3"], "cannot be split over 4 ranks x 1 micro-batch"),
    ("hybrid", 4, ["--dp", "4", "--batch-size", "3"], "cannot be split over 4 replicas x 1"),
    ("data_parallel", 2, ["--zero", "1"], "use --sync allreduce --zero 1"),
    ("data_parallel", 2, ["--zero", "1", "--sync", "ring"], "which --sync ring does not use"),
    ("data_parallel", 2, ["--zero", "3", "--sync", "allreduce", "--bucket-mb", "1"],
     "--zero 3 takes no --bucket-mb"),
    ("data_parallel", 2, ["--zero", "1", "--sync", "allreduce", "--overlap"],
     "--zero 1 takes no --bucket-mb, and --zero 1 no --overlap"),
    ("data_parallel", 2, ["--zero", "2"], "use --sync allreduce --zero 2"),
    ("hybrid", 4, ["--zero", "3"], "--zero 3 is not in the hybrid: it would gather a stage's"),
    ("hybrid", 4, ["--tp", "2", "--sequence-parallel", "--zero", "2", "--overlap"],
     "--zero 2 --overlap takes no --sequence-parallel"),
    ("hybrid", 4, ["--zero", "2", "--checkpoint", "ck"], "--zero 2 in the hybrid takes no"),
    ("hybrid", 4, ["--zero", "4"], "argument --zero: invalid choice: 4"),
    ("hybrid", 4, ["--zero", "1", "--overlap"], "--zero 1 takes no --bucket-mb, and --zero 1"),
    ("hybrid", 4, ["--zero", "1", "--clip-grad", "1"], "in the hybrid takes no --clip-grad"),
    ("data_parallel", 2, ["--overlap"], "--overlap needs the non-blocking Iallreduce"),
    ("data_parallel", 2, ["--bucket-mb", "1"], "--bucket-mb must be positive and needs --sync"),
    ("hybrid", 4, ["--bucket-mb", "0"], "--bucket-mb must be positive, got 0.0"),
    ("pipeline", 2, ["--schedule", "zigzag"], "unknown --schedule 'zigzag'"),
    ("hybrid", 4, ["--schedule", "interleaved"], "the hybrid runs --schedule naive, gpipe, "
     "1f1b, not 'interleaved': its stages hold one model chunk"),
    ("hybrid", 4, ["--schedule", "zigzag"], "the hybrid runs --schedule naive, gpipe, 1f1b, "
     "not 'zigzag'"),
    ("pipeline", 2, ["--chunks", "2"], "--chunks 2 needs --schedule interleaved"),
    ("pipeline", 2, ["--schedule", "zb-h1", "--chunks", "2"],
     "--chunks 2 needs --schedule interleaved (zb-h1 runs one model chunk"),
    ("pipeline", 2, ["--schedule", "zb-h1", "--recompute"],
     "--schedule zb-h1 runs each backward as B and W apart, but --recompute"),
    ("hybrid", 4, ["--schedule", "zb-h1"], "not 'zb-h1': its stages hold one model chunk "
     "(interleaved needs several) and its --overlap hooks the last micro-batch's whole "
     "backward (zb-h1 splits it)"),
    ("pipeline", 2, ["--schedule", "interleaved", "--chunks", "0"], "--chunks must be positive"),
    ("pipeline", 2, ["--schedule", "zb-v", "--chunks", "3"],
     "--schedule zb-v places 2 model chunks on each rank in a V, not --chunks 3"),
    ("pipeline", 4, ["--schedule", "dualpipev", "--micro-batches", "6"],
     "--schedule dualpipev needs at least 2 x 4 = 8 micro-batches"),
    ("pipeline", 2, ["--schedule", "1f1b", "--warmup", "lean"],
     "--warmup lean is the interleaved schedule's (1f1b has one warm-up)"),
    ("pipeline", 1, ["--print-schedule", "--stages", "0"], "--stages must be positive, got 0"),
    ("pipeline", 2, ["--model", "mlp", "--micro-batches", "65"], "exceeds --batch-size 64"),
    ("pipeline", 2, ["--schedule", "interleaved", "--micro-batches", "3"],
     "multiple of the stages (2)"),
    ("data_parallel", 2, ["--sync", "tree"], "invalid choice: 'tree'"),
    ("data_parallel", 2, ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # the model's rules, checked with the task
    ("tensor_parallel", 4, ["--model", "gpt", "--d-model", "12", "--n-heads", "6"],
     "the head count --n-heads 6 is not divisible by the 4 tensor-parallel ranks"),
    ("hybrid", 4, ["--tp", "4", "--n-heads", "2"], "the head count --n-heads 2"),
    ("pipeline", 2, ["--model", "mlp", "--partition", "1,1"], "summing to 5"),
    ("pipeline", 2, ["--model", "mlp", "--partition", "a,b"], "expected layer counts like"),
    ("pipeline", 2, ["--model", "mlp", "--sizes", "64,16,10", "--schedule", "interleaved"],
     "4 model pieces but the mlp model has only 3 layers"),
    ("pipeline", 2, ["--model", "mlp", "--sizes", "64,16,10", "--schedule", "zb-v"],
     "4 model pieces but the mlp model has only 3 layers: use fewer ranks"),
    ("pipeline", 4, ["--model", "mlp", "--sizes", "64,10"],
     "4 pipeline stages but the mlp model has only 1 layers"),
]


@pytest.mark.parametrize("scheme,ranks,flags,message", CASES,
                         ids=[f"{c[0]}:{' '.join(c[2])}" for c in CASES])
def test_bad_input_is_refused_with_exit_code_2(capsys, scheme, ranks, flags, message):
    with pytest.raises(SystemExit) as stop:
        args = parse_args(scheme, flags, ranks)
        check_model(scheme, args, serial.Task(args))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1, err


def test_every_rule_of_the_tables_is_exercised():
    """Each rule is the first to refuse at least one case above: a rule no input can reach is
    dead code, and a table that grows must grow its cases too."""
    fired = set()
    for scheme, ranks, flags, _ in CASES:
        args = _unchecked(scheme, flags, ranks)
        if args is None:  # argparse's own refusal
            continue
        flag = next((i for i, (schemes, condition, _) in enumerate(FLAG_RULES)
                     if scheme in schemes and condition(args)), None)  # the first, as the runner
        if flag is not None:
            fired.add(("flag", flag))
            continue
        task = serial.Task(args)
        model = next((i for i, (schemes, problem) in enumerate(MODEL_RULES)
                      if scheme in schemes and problem(args, task)), None)
        if model is not None:
            fired.add(("model", model))
    want = {("flag", i) for i in range(len(FLAG_RULES))} | \
        {("model", i) for i in range(len(MODEL_RULES))}
    assert fired == want, sorted(want - fired)


def _unchecked(scheme, flags, ranks):
    """The flags parsed and completed as the runner does, before any rule runs (None when
    argparse itself refuses them)."""
    import mpipar.runner.cli as cli

    saved, cli.FLAG_RULES = cli.FLAG_RULES, []
    try:
        return parse_args(scheme, flags, ranks)
    except SystemExit:
        return None
    finally:
        cli.FLAG_RULES = saved


@pytest.mark.parametrize("ranks,scheme,flags,message", [
    (2, "serial", [], "the serial trainer is one process, but this job has 2 ranks"),
    (2, "data_parallel", ["--lr", "nan"], "--lr must be positive and finite, got nan"),
    (2, "pipeline", ["--seed", "-1"], "--seed must be 0 or more, got -1"),
    (4, "hybrid", ["--bucket-mb", "nan"], "--bucket-mb must be positive, got nan"),
    (2, "tensor_parallel", ["--model", "gpt", "--n-layers", "0"], "--n-layers and --seq-len"),
    (2, "data_parallel", ["--clip-grad", "-1"], "--clip-grad must be a positive finite norm"),
])
def test_new_refusals_end_every_rank_under_mpirun(ranks, scheme, flags, message):
    assert_refused(ranks, scheme, flags, message)


@pytest.mark.skipif(__import__("mpipar.engine.backend").engine.backend.cupy_problem() is None,
                    reason="CuPy and a GPU are here: --backend cupy runs")
def test_backend_cupy_without_cupy_or_a_gpu_is_one_message_and_exit_2_on_every_rank():
    """Without CuPy (or without a GPU) --backend cupy is refused once, with the reason, before
    any array exists; every rank exits with code 2."""
    from mpipar.engine.backend import cupy_problem

    assert_refused(2, "data_parallel", ["--backend", "cupy"], cupy_problem())
