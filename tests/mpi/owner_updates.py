"""mpirun -n P python tests/mpi/owner_updates.py FLAGS: a trainer the runner has never seen,
run through it with the data-parallel flags (``train.main(..., trainer_cls=OwnerUpdates)``).

Every rank runs the whole batch through the whole model, so every rank has the same gradient;
tensor i of the model is updated by rank i % P alone, which keeps that tensor's optimizer state
and broadcasts the new values (the optimizer state sharded by tensor, where ZeRO-1 shards one
flat buffer). It declares its placements and overrides nothing of
:class:`mpipar.runner.trainer.Trainer`: clipping, checkpoints and ``--memory`` must work for
it from the placements alone.
"""

import sys

from mpipar import serial, train
from mpipar.engine import backend as B
from mpipar.engine.parameters import Parameter, Placement, place
from mpipar.runner.trainer import Trainer


class OwnerUpdates(Trainer):
    def __init__(self, task, grid, args):
        self.task, self.comm = task, grid.dp_comm
        self.model = task.build_model().init(args.seed)
        self.loss_fn = task.loss_fn
        self.params = place(self.model.parameters(), replicated=[self.comm])  # every rank: all
        self.owner = [i % self.comm.size for i in range(len(self.params))]
        self.mine = {}  # index of a model tensor this rank owns -> the copy its optimizer steps
        for i, p in enumerate(self.params):
            if self.owner[i] == self.comm.rank:
                copy = Parameter(*p.shape)
                copy.name, copy.placement = p.name, Placement(split=[self.comm])
                copy.set(B.to_numpy(p.data))
                self.mine[i] = copy
        self.opt = serial.make_optimizer(args, list(self.mine.values()))

    def step(self, step):
        x, y = self.task.to_device(*self.task.batch(step))
        self.model.zero_grad()
        loss = self.loss_fn.forward(self.model.forward(x), y, normalizer=y.size)
        self.model.backward(self.loss_fn.backward())
        for i, copy in self.mine.items():
            copy.grad[...] = self.params[i].grad
        self.opt.step()
        for i, p in enumerate(self.params):
            if i in self.mine:
                p.data[...] = self.mine[i].data
            self.comm.Bcast(p.data, root=self.owner[i], what=f"{p.name}, from its owner")
        return loss

    def full_params(self):
        if self.comm.rank != 0:
            return None
        return {name: B.to_numpy(p.data) for name, p in self.model.named_parameters()}


if __name__ == "__main__":
    train.main("data_parallel", sys.argv[1:], trainer_cls=OwnerUpdates)
