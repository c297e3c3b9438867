"""The memory ledger (mpipar.runner.memory): each buffer counted once, whatever views alias it;
every scheme's bytes per rank equal to the formula, exactly, under mpirun
(tests/mpi/memory_checks.py); ``--memory`` prints every rank's row beside the cost model's
prediction."""

import re

import numpy as np
import pytest
from conftest import MPI_SCRIPTS

from mpipar.runner import memory
from mpipar.tools import simulate as S


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_scheme_holds_what_the_formula_says(mpirun, n):
    out = mpirun(n, [MPI_SCRIPTS / "memory_checks.py"], timeout=120).stdout
    assert f"memory checks passed on {n} ranks" in out


def test_each_buffer_is_counted_once_under_its_first_kind():
    """Gradients as views into a bucket, q/k/v as views into one array, a micro-batch as a view
    into the batch: each owner once, whole; one value more is 4 bytes more, one array less is
    its bytes less."""
    bucket = np.zeros(10, dtype=np.float32)
    grads = [bucket[:4].reshape(2, 2), bucket[4:]]  # as Bucket makes them
    params = [np.zeros((2, 2), np.float32), np.zeros(6, np.float32)]
    qkv = np.zeros((3, 8), np.float32)
    acts = [qkv[:, :4].T, qkv[:, 4:], qkv, None, (3, 8), 1.0]  # a shape and a number: no bytes
    arrays = dict(params=params, grads=grads + grads, optimizer=[], activations=acts,
                  buffers=[bucket, bucket[2:]])
    assert memory.count(arrays) == dict(params=40, grads=40, optimizer=0, activations=96,
                                        buffers=0)
    arrays["params"] = [np.zeros((2, 2), np.float32), np.zeros(7, np.float32)]  # one value more
    assert memory.count(arrays)["params"] == 44
    arrays["grads"] = grads[:1]  # one view left: its bucket still counts whole
    assert memory.count(arrays)["grads"] == 40
    arrays["grads"] = []  # no gradient names the bucket: it counts as a buffer
    assert memory.count(arrays)["buffers"] == 40


def rows_of(out):
    """{rank: [parameters, gradients, optimizer, activations, buffers, step peak]} of the table."""
    table = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\s*(\d+)  (.{12})((?:\s+[\d,]+){6})", line)
        if m:
            table[int(m.group(1))] = [int(v.replace(",", "")) for v in m.group(3).split()]
    return table


def test_memory_flag_shows_zero_3_at_a_quarter(mpirun):
    """The MLP's 17,226 parameters in 3 layers of 8,320, 8,256 and 650 over 4 ranks: 2,080 +
    2,064 + 163 (650 padded to 652) = 4,307 values a rank, 17,228 bytes of parameters and of
    gradients, 34,456 of Adam's moments; the cost model predicts the same without padding."""
    out = mpirun(4, ["-m", "mpipar.data_parallel", "--sync", "allreduce", "--zero", "3",
                     "--optim", "adam", "--steps", "2", "--quiet", "--memory"], timeout=90).stdout
    table = rows_of(out)
    assert sorted(table) == [0, 1, 2, 3], out
    for row in table.values():
        assert row[:3] == [17_228, 17_228, 34_456] and row[4] == 0, out
        assert row[3] > 0 and row[5] > sum(row[:5]) - row[3], out  # one layer gathered at once
    assert ("its largest rank: parameters 17,226, gradients 17,226, optimizer 34,452, "
            "activations ") in out, out


@pytest.mark.parametrize("ranks, flags, predicted", [
    (1, ["serial", "--model", "gpt", "--n-layers", "1"], True),  # the GPT trains with Adam
    (2, ["tensor_parallel", "--update", "master"], False),  # the master's full copy: no model
    (2, ["pipeline", "--model", "mlp", "--recompute", "--timeline", "none"], False),  # SGD
    (4, ["hybrid", "--dp", "2", "--tp", "2", "--model", "mlp", "--optim", "adam"], True),
])
def test_memory_flag_in_every_scheme(mpirun, ranks, flags, predicted):
    scheme, *rest = flags
    out = mpirun(ranks, ["-m", f"mpipar.{scheme}", *rest, "--steps", "2", "--quiet",
                         "--memory"], timeout=90).stdout
    assert sorted(rows_of(out)) == list(range(ranks)), out
    last = out.splitlines()[-1]
    assert last.startswith("cost model") and ("no prediction" not in last) == predicted, out


@pytest.mark.parametrize("schedule", [["interleaved", "--chunks", "2"], ["zb-h1"], ["zb-v"],
                                      ["dualpipev"]])
def test_the_cost_model_predicts_the_chunked_and_split_pipelines(mpirun, schedule):
    """Two chunks a stage (looped or in a V) and split backwards: the cost model's largest
    rank holds the ledger's largest parameters, gradients and Adam's moments to the byte, and
    its activations (the replayed schedule's stash, without the loss's own cache) within 5%."""
    out = mpirun(2, ["-m", "mpipar.pipeline", "--schedule", *schedule, "--micro-batches", "4",
                     "--steps", "1", "--quiet", "--timeline", "none", "--dtype", "float64",
                     "--memory"], timeout=90).stdout
    table = rows_of(out)
    got = re.search(r"its largest rank: parameters ([\d,]+), gradients ([\d,]+), optimizer "
                    r"([\d,]+), activations ([\d,]+)", out)
    assert got, out
    predicted = [int(v.replace(",", "")) for v in got.groups()]
    assert predicted[:3] == [max(row[k] for row in table.values()) for k in range(3)], out
    largest = max(row[3] for row in table.values())
    assert abs(predicted[3] - largest) <= 0.05 * largest, (predicted[3], largest)


def test_the_cost_model_shards_by_zero_stage():
    spec = S.GPTSpec(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    hw = S.this_machine(1e9, 0.0, 0.0)
    plain, *zero = (S.predict(spec, hw, dp=4, global_batch=8, dtype_bytes=4, zero=z)
                    for z in range(4))
    for stage, r in enumerate(zero, 1):
        for kind, from_stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
            ratio = r[f"mem_{kind}_bytes"] / plain[f"mem_{kind}_bytes"]
            assert ratio == pytest.approx(1 / 4 if stage >= from_stage else 1), (stage, kind)
