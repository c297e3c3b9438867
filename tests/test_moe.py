"""The mixture-of-experts GPT on the serial trainer: it trains, its load-balancing loss is in
the loss it reports, and a checkpoint of it resumes to the same parameters (the layer's own
gradients: tests/test_layers.py; its refusals: tests/test_cli.py)."""

import numpy as np
import pytest

from mpipar import serial, train
from mpipar.engine import moe
from mpipar.runner.cli import parse_args

MOE = ["--model", "gpt", "--experts", "4", "--top-k", "2", "--dtype", "float64", "--d-model",
       "16", "--n-heads", "2", "--n-layers", "2", "--seq-len", "8", "--batch-size", "8",
       "--quiet"]


def trainer(flags):
    a = parse_args("serial", [*MOE, *flags], 1)
    return serial.Serial(serial.Task(a), None, a), a


def test_the_serial_moe_gpt_trains_and_reports_its_aux_loss():
    t, a = trainer(["--steps", "40", "--aux-loss-coef", "0.5"])
    losses = [t.step(step) for step in range(40)]
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses  # it learns
    layers = [m for m in t.model.modules() if isinstance(m, moe.MoE)]
    assert len(layers) == 2 and all(m.tokens_per_expert.sum() == 2 * 8 * 8 for m in layers)
    x, y = t.task.to_device(*t.task.batch(40))
    ce = t.loss_fn.forward(t.model.forward(x), y, normalizer=y.size)
    aux = moe.balance(t.model)
    assert aux == sum(m.aux for m in layers) and 2 * 0.5 <= aux < 2 * 0.5 * 4
    assert t.step(40) == ce + aux  # the step's loss is the cross-entropy plus the aux losses


def test_without_aux_loss_only_the_cross_entropy_is_trained():
    t, _ = trainer(["--steps", "3", "--aux-loss-coef", "0"])
    x, y = t.task.to_device(*t.task.batch(0))
    ce = t.loss_fn.forward(t.model.forward(x), y, normalizer=y.size)
    assert moe.balance(t.model) == 0.0 and t.step(0) == ce


def test_a_checkpoint_of_the_moe_gpt_resumes_to_the_same_parameters(tmp_path):
    whole, part = tmp_path / "whole.npz", tmp_path / "part.npz"
    train.main("serial", [*MOE, "--steps", "6", "--save-params", str(whole)])
    ckpt = tmp_path / "ckpt"
    train.main("serial", [*MOE, "--steps", "3", "--checkpoint", str(ckpt)])
    train.main("serial", [*MOE, "--steps", "6", "--resume", str(ckpt), "--save-params",
                          str(part)])
    a, b = train.load_params(whole), train.load_params(part)
    assert sorted(a) == sorted(b) and any(".mlp.experts.3." in n for n in a)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_run_says_its_experts_and_the_last_step_s_routing(capsys):
    train.main("serial", [*MOE, "--steps", "2"])
    out = capsys.readouterr().out
    assert "(4 experts a block, top-2, aux loss coefficient 0.01)" in out, out
    lines = out[out.index("routing of the last step:"):].splitlines()[1:3]
    for name, line in zip(("blocks.0", "blocks.1"), lines):
        counts = [int(v) for v in line[line.index("[") + 1:line.index("]")].split(",")]
        assert line.startswith(f"{name}: tokens per expert ") and sum(counts) == 2 * 8 * 8
        assert line.endswith(f"max / mean {max(counts) / (sum(counts) / 4):.2f}"), line


def test_a_dense_run_refuses_a_checkpoint_of_experts(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    train.main("serial", [*MOE, "--steps", "2", "--checkpoint", str(ckpt)])
    dense = MOE[:2] + MOE[6:]  # without --experts 4 --top-k 2
    assert "--experts" not in dense and "--top-k" not in dense
    capsys.readouterr()
    with pytest.raises(SystemExit) as end:
        train.main("serial", [*dense, "--steps", "3", "--resume", str(ckpt)])
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.count("\n") == 1, err
    assert "the checkpoint does not fit this run: aux_loss_coef 0.01 (this run: None), " \
        "experts 4 (this run: None), top_k 2 (this run: None)" in err, err
