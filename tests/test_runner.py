"""The runner never fails silently: a diverging run stops and saves nothing, a failed save
leaves the previous file whole, a long pipeline run keeps a bounded trace."""

import numpy as np
import pytest
from conftest import run_mpi

from mpipar import train
from mpipar.runner import reports as R

MLP = ["--model", "mlp", "--sizes", "64,16,10", "--batch-size", "16", "--quiet"]


@pytest.mark.parametrize("ranks,scheme", [(1, "serial"), (2, "pipeline"), (2, "data_parallel"),
                                          (2, "tensor_parallel"), (4, "hybrid")])
def test_a_diverging_run_stops_every_rank_and_saves_nothing(tmp_path, ranks, scheme):
    saved = tmp_path / "p.npz"
    proc = run_mpi(ranks, ["-m", f"mpipar.{scheme}", *MLP, "--lr", "1e12", "--steps", "50",
                           "--save-params", saved, "--checkpoint", tmp_path / "ckpt"],
                   timeout=60, check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("training diverged") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "RuntimeWarning" not in proc.stderr
    assert not saved.exists() and not list((tmp_path / "ckpt").iterdir())


def test_a_failed_save_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "p.npz"
    train.save_params(str(path), [("w", np.ones(3))])

    def broken(f, **arrays):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        train.save_params(str(path), [("w", np.zeros(3))])
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left either
    np.testing.assert_array_equal(train.load_params(path)["w"], np.ones(3))


def test_a_long_pipeline_run_keeps_the_last_steps_only(capsys, monkeypatch):
    monkeypatch.setattr(R, "WINDOW", 3)
    reports = []
    original = R.PipelineReport.record

    def record(self):
        original(self)
        reports.append(self)

    monkeypatch.setattr(R.PipelineReport, "record", record)
    train.main("pipeline", [*MLP, "--steps", "10", "--timeline", "none"])
    out = capsys.readouterr().out
    assert "median over steps 8..10" in out, out
    assert reports and max(len(r.summaries) for r in reports) == 3
    assert max(len(r.step_events) for r in reports) == 3


def test_the_trace_holds_one_step_at_most(capsys):
    """With TRACE.calls on, every MPI call records a span; the loop clears them each step, so a
    long run's memory stays flat (the trace of a run of 40 steps is that of its last step)."""
    from mpipar.mpi.trace import TRACE

    TRACE.calls = True
    try:
        train.main("data_parallel", [*MLP, "--steps", "40"])  # the seed's master scheme
    finally:
        TRACE.calls = False  # as in a training run
    capsys.readouterr()
    calls = [e[3] for e in TRACE.events if e[2] == "comm"]
    assert sorted(calls) == ["Bcast", "Reduce", "Scatterv", "Scatterv"], calls  # one step's
