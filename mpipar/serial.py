"""The serial reference trainer: one process, the whole model, the whole batch.

    python -m mpipar.serial --model mlp            # digits, reaches >= 95% test accuracy
    python -m mpipar.serial --model gpt            # character-level GPT on Python's docs
    python -m mpipar.serial --model gpt --experts 4 --top-k 2   # a mixture of experts a block

Every parallel scheme must reproduce this trainer's parameters. :class:`Task` binds a model,
its data and its loss so each scheme builds exactly the same thing; :func:`train_step` is one
step, written out so each scheme can be read against it; :class:`Serial` is the same as a
trainer for the runner (:mod:`mpipar.train`, which owns the flags shared by every scheme).
This module does not import MPI: the reference needs one process and nothing else.
"""

import numpy as np

from mpipar.engine import backend as B
from mpipar.engine import data, moe, nn, optim, precision
from mpipar.runner.trainer import Trainer


class Task:
    """A model, its data and its loss, built identically on every rank."""

    def __init__(self, args, data_set=None):
        self.args = args
        self.kind = args.model
        if data_set is not None:  # the same data, already loaded (it depends on model and seed)
            self.data = data_set
        elif self.kind == "mlp" and args.data == "synthetic":
            self.data = data.Synthetic(args.sizes[0], args.sizes[-1], args.samples, args.seed)
        elif self.kind == "mlp":
            self.data = data.Digits(args.seed)
        else:
            self.data = data.Text(args.seed)
        self.loss_fn = nn.SoftmaxCrossEntropy()

    def build_model(self):
        """The uninitialised model (call ``.init(seed)``, or initialise a slice of it)."""
        a = self.args
        if self.kind == "mlp":
            return nn.MLP(a.sizes)
        if getattr(a, "experts", 0):
            return moe.gpt(self.data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len,
                           a.experts, a.top_k, a.aux_loss_coef)
        return nn.GPT(self.data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len)

    def model_with(self, params):
        """The serial model carrying the given {canonical name: array} (to evaluate a
        scheme's gathered parameters with the serial forward)."""
        model = self.build_model()
        for name, p in model.named_parameters():
            p.name = name
            p.set(B.to_numpy(params[name]))
        return model

    def batch(self, step, split="train"):
        """The global batch of a step, on the host: (x, y)."""
        if self.kind == "mlp":
            return self.data.batch(step, self.args.batch_size)
        return self.data.batch(step, self.args.batch_size, self.args.seq_len, split)

    def input_shape(self, batch_size):
        if self.kind == "mlp":
            return (batch_size, self.args.sizes[0])
        return (batch_size, self.args.seq_len)

    def to_device(self, x, y):
        """Inputs as the working dtype (token ids stay integers), targets as integers."""
        x = B.asarray(x, dtype=B.dtype if self.kind == "mlp" else np.int64)
        return x, B.asarray(y, dtype=np.int64)

    def evaluate(self, forward):
        """Held-out quality of a model given as its forward function (host arrays in)."""
        if self.kind == "mlp":
            x, y = self.to_device(self.data.x_test, self.data.y_test)
            return {"test_accuracy": nn.accuracy(forward(x), y)}
        losses = []
        for i in range(4):
            x, y = self.to_device(*self.batch(10_000 + i, "val"))
            losses.append(nn.SoftmaxCrossEntropy().forward(forward(x), y))
        return {"val_loss": float(np.mean(losses)), "unigram_loss": self.data.unigram_loss()}


def make_optimizer(args, params):
    return optim.make(args.optim, params, args.lr)


def train_step(model, loss_fn, opt, x, y, scaler=None):
    """One serial step on the whole batch: forward, loss, backward, update. With a loss
    ``scaler`` (fp16): the backward of the loss times its scale, the update of the gradients
    over it, taken only if every gradient is finite (:mod:`mpipar.engine.precision`)."""
    opt.zero_grad()
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y, normalizer=y.size)  # mean over every target
    scale = precision.scale_of(scaler)  # fp16: the backward of loss * scale
    loss += moe.balance(model, loss_scale=scale)  # the MoE layers' load balancing (0 without)
    model.backward(loss_fn.backward(scale))
    precision.take_step(opt, scaler)  # with a scaler: skipped if a gradient overflowed
    return loss


class Serial(Trainer):
    """The reference as a trainer (the runner's interface): the whole model on one process."""

    def __init__(self, task, grid, args):
        self.task = task
        self.model = task.build_model().init(args.seed)
        self.opt = make_optimizer(args, self.model.parameters())
        self.loss_fn = task.loss_fn
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None

    def step(self, step):
        x, y = self.task.to_device(*self.task.batch(step))
        return train_step(self.model, self.loss_fn, self.opt, x, y, self.scaler)

    def full_params(self):
        return {name: B.to_numpy(p.data) for name, p in self.model.named_parameters()}


if __name__ == "__main__":  # python -m mpipar.serial
    from mpipar.runner import hand_over

    hand_over(__name__, "serial")
