"""What the runner reads of a trainer, whatever its scheme: one small interface.

Clipping, checkpoints, the memory ledger and recomputation each apply one rule to what a
trainer declares here and never ask which trainer it is:

- :meth:`Trainer.parameters`: the model's parameters this rank holds, each with its
  :class:`~mpipar.engine.parameters.Placement` (the groups that split the model, those that
  replicate it) and its pieces of the serial model's tensors;
- :meth:`Trainer.optimizers`: the optimizers this rank steps (their parameters may be other
  arrays than the model's: a ZeRO shard, the tensor-parallel master's full tensors);
- :meth:`Trainer.split_groups`: groups that split the model even where this rank's parameters
  name none (a pipeline stage without parameters still joins the norm's sum);
- :meth:`Trainer.units` and ``loss_fn``: the modules the trainer calls in turn, whose caches
  hold a step's activations, and the loss (None on a rank that computes none);
- :meth:`Trainer.wrap_units`: replace each unit ``u`` by ``wrap(u)`` (recomputation);
- :meth:`Trainer.buffers`: the flat communication buffers it keeps between steps.

The defaults fit a trainer that runs one ``self.model`` (an nn.Sequential) layer by layer with
``self.opt``; a scheme overrides what it holds otherwise. A new scheme plugs in by declaring
its placements and, where it differs, these few methods.
"""


class Trainer:
    loss_fn = None
    opt = None

    def parameters(self):
        return self.model.parameters()

    def optimizers(self):
        return [] if self.opt is None else [self.opt]

    def split_groups(self):
        return []

    def units(self):
        return [layer for _, layer in self.model.layers]

    def wrap_units(self, wrap):
        self.model.layers = [(name, wrap(layer)) for name, layer in self.model.layers]

    def buffers(self):
        return []
