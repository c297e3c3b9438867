"""What the runner (mpipar/train.py) needs around every scheme: flags and refusals,
checkpoints, gradient clipping, recomputation, the memory ledger, the interface it reads of
a trainer (trainer.py), and the hand-over from a scheme file run as a program."""

import sys


def hand_over(name, scheme):
    """Run ``python -m mpipar.<scheme>``: the scheme file, running as ``__main__`` (``name``),
    registers itself as ``mpipar.<scheme>`` first, so the runner's import of the scheme finds
    this copy and the file runs once; then the runner takes over."""
    sys.modules[f"mpipar.{scheme}"] = sys.modules[name]
    from mpipar import train

    train.main(scheme)
