#!/bin/sh
# Lesson 8: train on one layout, resume on three others, and compare with the serial run.
# Run from the repository root: sh lessons/code/08_resume_anywhere.sh
set -e
cd "$(mktemp -d)"  # a scratch folder: ckpt/ and the .npz files go there
MODEL="--model mlp --optim adam --dtype float64 --quiet"
mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --zero 1 $MODEL --steps 10 \
    --checkpoint ckpt | tail -1
mpirun -n 2 python -m mpipar.pipeline $MODEL --steps 20 --resume ckpt --checkpoint ckpt \
    --timeline none | grep resumed
mpirun -n 2 python -m mpipar.tensor_parallel $MODEL --steps 30 --resume ckpt --checkpoint ckpt \
    | grep resumed
python -m mpipar.serial $MODEL --steps 40 --resume ckpt --save-params resumed.npz | grep resumed
python -m mpipar.serial $MODEL --steps 40 --save-params serial.npz | tail -1
ls ckpt ckpt/step-00000030
python - <<'PY'
import numpy as np
a, b = np.load("resumed.npz"), np.load("serial.npz")
err = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b.files)
print(f"{len(b.files)} tensors, largest relative difference from the serial run: {err:.1e}")
assert err <= 1e-10, "not the serial run's parameters"  # the tests' tolerance
PY
rm -rf "$PWD"
