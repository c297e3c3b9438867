"""The serial reference trainer: one process, the whole model, the whole batch.

    python -m mpipar.serial --model mlp            # digits, reaches >= 95% test accuracy
    python -m mpipar.serial --model gpt            # character-level GPT on Python's docs

Every parallel scheme must reproduce this trainer's parameters. Its flags are the contract
they share (:func:`add_common_args`): ``--model --steps --batch-size --lr --seed --dtype
--save-params``; :class:`Task` binds a model, its data and its loss so each scheme builds
exactly the same thing; :func:`train_step` is one step, written out so each scheme can be read
against it.
"""

import argparse
import sys

import numpy as np

from mpipar import backend as B
from mpipar import data, nn, optim
from mpipar.comm import refuse

DEFAULTS = {  # per model: what trains well within a minute on 2 cores
    "mlp": dict(steps=300, batch_size=64, lr=0.05, optim="sgd"),
    "gpt": dict(steps=250, batch_size=32, lr=3e-3, optim="adam"),
}


def add_common_args(ap):
    """The flags every trainer shares. Model-specific defaults are filled in by
    :func:`finish_args`, so ``--help`` shows them per model. A parse error is refused like any
    bad input: one message from rank 0, exit code 2 on every rank (not a usage text per rank)."""
    ap.error = lambda message: refuse(f"{message} (see --help)")
    g = ap.add_argument_group("training (shared by every scheme)")
    g.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                   help="mlp: MLP on 8x8 digits; gpt: character-level GPT on text (default mlp)")
    g.add_argument("--steps", type=int, help="optimizer steps (mlp 300, gpt 250)")
    g.add_argument("--batch-size", type=int, help="global batch size (mlp 64, gpt 32)")
    g.add_argument("--lr", type=float, help="learning rate (mlp 0.05, gpt 3e-3)")
    g.add_argument("--optim", choices=["sgd", "adam", "adamw"], help="mlp: sgd, gpt: adam")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="float64 for exact comparisons between schemes")
    g.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    g.add_argument("--save-params", metavar="FILE.npz",
                   help="write the trained parameters under their canonical names")
    g.add_argument("--log-every", type=int, default=0, help="print the loss every N steps")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    m = ap.add_argument_group("model sizes")
    m.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                   default=[64, 128, 64, 10], help="MLP widths (default 64,128,64,10)")
    m.add_argument("--d-model", type=int, default=64, help="GPT width (default 64)")
    m.add_argument("--n-heads", type=int, default=4, help="GPT attention heads (default 4)")
    m.add_argument("--n-layers", type=int, default=2, help="GPT blocks (default 2)")
    m.add_argument("--seq-len", type=int, default=32, help="GPT context length (default 32)")
    return ap


def finish_args(args):
    """Fill per-model defaults, select backend and dtype, and refuse bad values clearly (one
    message, exit code 2, on every rank of an MPI job: see :func:`mpipar.comm.refuse`)."""
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("steps", "batch_size"):
        if getattr(args, key) <= 0:
            refuse(f"--{key.replace('_', '-')} must be positive, "
                             f"got {getattr(args, key)}")
    if args.lr <= 0:
        refuse(f"--lr must be positive, got {args.lr}")
    if args.model == "mlp" and (args.sizes[0] != 64 or args.sizes[-1] != 10):
        refuse(f"--sizes must start with 64 (pixels) and end with 10 (classes), "
                         f"got {args.sizes}")
    if args.model == "gpt" and args.d_model % args.n_heads:
        refuse(f"--d-model {args.d_model} is not divisible by "
                         f"--n-heads {args.n_heads}")
    B.use(args.backend, args.dtype)
    return args


class Task:
    """A model, its data and its loss, built identically on every rank."""

    def __init__(self, args):
        self.args = args
        self.kind = args.model
        if self.kind == "mlp":
            self.data = data.Digits(args.seed)
        else:
            self.data = data.Text(args.seed)
        self.loss_fn = nn.SoftmaxCrossEntropy()

    def build_model(self):
        """The uninitialised model (call ``.init(seed)``, or initialise a slice of it)."""
        a = self.args
        if self.kind == "mlp":
            return nn.MLP(a.sizes)
        return nn.GPT(self.data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len)

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


def train_step(model, loss_fn, opt, x, y):
    """One serial step on the whole batch: forward, loss, backward, update."""
    opt.zero_grad()
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y, normalizer=y.size)  # mean over every target
    model.backward(loss_fn.backward())
    opt.step()
    return loss


def save_params(path, named_arrays):
    """Write {canonical name: array} to an .npz file (plain arrays, no pickle)."""
    np.savez(path, **{name: B.to_numpy(a) for name, a in named_arrays})


def load_params(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def progress(steps, desc, quiet=False):
    """A tqdm progress bar over the steps (disabled with --quiet)."""
    from tqdm import tqdm

    return tqdm(range(steps), desc=desc, disable=quiet, file=sys.stderr, dynamic_ncols=True)


def report(metrics, loss):
    parts = [f"final train loss {loss:.4f}"]
    parts += [f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items()]
    return ", ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mpipar.serial",
                                 description="Train the reference model on one process.")
    args = finish_args(add_common_args(ap).parse_args(argv))
    task = Task(args)
    model = task.build_model().init(args.seed)
    opt = make_optimizer(args, model.parameters())
    n_params = sum(p.size for p in model.parameters())
    print(f"serial: {args.model} with {n_params:,} parameters, {args.steps} steps of batch "
          f"{args.batch_size}, {args.optim} lr {args.lr}, {args.dtype}", flush=True)
    bar = progress(args.steps, "serial", args.quiet)
    for step in bar:
        x, y = task.to_device(*task.batch(step))
        loss = train_step(model, task.loss_fn, opt, x, y)
        bar.set_postfix(loss=f"{loss:.4f}")
        if args.log_every and (step + 1) % args.log_every == 0:
            bar.write(f"step {step + 1:5d}  loss {loss:.4f}")
    print(report(task.evaluate(model.forward), loss), flush=True)
    if args.save_params:
        save_params(args.save_params, ((n, p.data) for n, p in model.named_parameters()))
        print(f"saved parameters to {args.save_params}", flush=True)


if __name__ == "__main__":
    main()
