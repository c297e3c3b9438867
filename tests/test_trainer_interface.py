"""A trainer the runner has never seen (tests/mpi/owner_updates.py: the optimizer state sharded
by tensor) declares its placements, and clipping, checkpoints onto other layouts and
``--memory`` work for it with no change to mpipar.runner: the runner reads placements, never
which trainer it runs."""

from conftest import MPI_SCRIPTS, assert_matches_serial, run_mpi
from test_checkpoint import run_chain
from test_memory import rows_of

OWNER = str(MPI_SCRIPTS / "owner_updates.py")
MLP = ["--model", "mlp", "--sizes", "64,16,12,10", "--batch-size", "12", "--dtype", "float64"]
SIZES = [1024, 16, 192, 12, 120, 10]  # fc0.W, fc0.b, fc1.W, fc1.b, fc2.W, fc2.b


def test_it_clips_by_the_serial_norm(tmp_path, capsys):
    """Each tensor's gradient is counted by its owner alone (its copy is split over the
    ranks, the model's replicated): the norm is the serial model's, not 3 times its square."""
    flags = [*MLP, "--optim", "adam", "--lr", "0.01", "--steps", "5", "--clip-grad", "0.05",
             "--quiet"]
    saved = tmp_path / "p.npz"
    out = run_mpi(3, [OWNER, *flags, "--save-params", saved], timeout=120).stdout
    assert "scaled down, in 5 of 5 steps" in out, out
    assert_matches_serial(out, flags, saved, tmp_path, capsys)


def test_it_resumes_from_and_hands_over_to_other_layouts(tmp_path, capsys):
    """Loaded from a tensor-parallel checkpoint, written for a pipeline to continue: the end
    equals the serial run, Adam's moments included (each written by its tensor's owner)."""
    legs = [(2, ["tensor_parallel"], 2), (3, [OWNER], 4), (2, ["pipeline", "--timeline", "none"],
                                                           6)]
    run_chain([*MLP[:-2], "--optim", "adam"], legs, tmp_path, capsys)


def test_its_memory_ledger_counts_what_each_rank_holds(tmp_path):
    """Rank r owns tensors r, r+3: it holds the whole model and copies of its own tensors
    (values and gradients), and Adam's two moments of those only, 8 bytes a value."""
    out = run_mpi(3, [OWNER, *MLP, "--optim", "adam", "--steps", "2", "--quiet", "--memory"],
                  timeout=120).stdout
    table = rows_of(out)
    assert sorted(table) == [0, 1, 2], out
    for rank, row in table.items():
        owned = sum(SIZES[rank::3])
        assert row[:3] == [8 * (sum(SIZES) + owned)] * 2 + [2 * 8 * owned], (rank, out)
        assert row[4] == 0 and row[3] > 0, (rank, out)
