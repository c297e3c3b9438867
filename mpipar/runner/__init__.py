"""What the runner (mpipar/train.py) needs around every scheme: flags and refusals,
checkpoints, gradient clipping, recomputation and the memory ledger."""
