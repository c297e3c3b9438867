"""mpirun -n 2 python tests/mpi/averaging_mistake.py: lesson 7's averaging mistake, run.

The lines the lesson shows (divide each summed gradient by the number of replicas) go into a
copy of SyncedUpdate.step just after its dp sum, inside the same ``if``, as the lesson says.
Then 2 replicas (dp 2 x tp 1 x pp 1, 2 micro-batches) train the tiny GPT of hybrid_checks.py
in float64 for 2 steps, with Adam (the GPT's default, which nearly cancels the factor) and with
SGD (for which it is a learning rate D times too small), and rank 0 prints each step's loss
beside the serial trainer's: tests/test_course_facts.py checks that the first is the serial
one and the second is not.
"""

import inspect
import re
import textwrap
from pathlib import Path

from reference import make_task, serial_run

from mpipar import hybrid as H
from mpipar.mpi import comm as C
from mpipar.runner.cli import parse_args

LESSON = Path(__file__).resolve().parents[2] / "lessons" / "07-hybrid.md"
GPT = ["--model", "gpt", "--d-model", "8", "--n-heads", "2", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "8", "--dtype", "float64"]
STEPS = 2


def step_with_the_mistake():
    """SyncedUpdate.step with the lesson's lines after ``self.sync.finish()``."""
    found = re.search(r"inside the same `if`, add\n\n((?: {4}.*\n)+)", LESSON.read_text())
    assert found, "lesson 7 no longer shows the averaging mistake's lines"
    source = textwrap.dedent(inspect.getsource(H.SyncedUpdate.step))
    anchor = re.search(r"\n( *)self\.sync\.finish\(\)\n", source)
    assert anchor and source.count("self.sync.finish()") == 1, source
    lines = textwrap.indent(textwrap.dedent(found.group(1)), anchor.group(1))
    source = source[:anchor.end()] + lines + source[anchor.end():]
    namespace = {}
    exec(compile(source, "lesson 7's averaging mistake", "exec"), vars(H), namespace)
    return namespace["step"]


C.install_excepthook()
world = C.world()
H.SyncedUpdate.step = step_with_the_mistake()
grid = H.make_grid(2, 1, 1)
for optim in ("adam", "sgd"):
    flags = GPT + ["--optim", optim]
    task = make_task(flags)
    want, _, _ = serial_run(task, STEPS)
    args = parse_args("hybrid", flags + ["--dp", "2", "--micro-batches", "2"], world.size)
    trainer = H.Hybrid(task, grid, args)
    for step in range(STEPS):
        loss = trainer.step(step)
        if world.rank == 0:
            print(f"{optim} step {step} loss {loss!r} serial {want[step]!r}")
