"""A bf16 SUM for MPI, which has none: a user-defined operation on 2-byte data.

MPI's predefined SUM knows integers, float32 and float64, but no 16-bit float, so a bf16
gradient cannot be summed by ``Allreduce(op=SUM)`` as it is. Two ways out:

- cast to float32 and sum that (:func:`fp32_sum`): twice the bytes on the wire, and the sum
  rounded to bf16 once, at the end;
- sum the 2-byte data with an operation of our own (:func:`bf16_sum`): MPI moves the raw
  16-bit words (as uint16), and at every step of its reduction calls :func:`_add`, which reads
  both operands as bf16, adds them in float32 and rounds the result to bf16. Half the bytes,
  but every partial sum is rounded: with p ranks a sum can pass through up to p - 1 roundings,
  each off by at most half a unit in the last place (2^-8 of the value, bf16's 7 mantissa
  bits), so its error is at most about (p - 1) 2^-8 times the sum of the magnitudes, where the
  float32 sum's is 2^-24 of it before its one final rounding.

A reduce-scatter (ZeRO) has the same two ways: :func:`reduce_scatter` gives this rank its block
of the sum, through float32 or with the same operation.

The operation is commutative (a + b rounds as b + a), so MPI may reduce in any order it likes;
which order it takes depends on p and the message size, so the bf16 sum is not bitwise the
same across rank counts. ``tests/test_bf16_sum.py`` measures both the bytes and the errors.
"""

import numpy as np
from mpi4py import MPI

from mpipar.engine import backend as B

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def _add(inbuf, inoutbuf, datatype):
    """inout = round_bf16(float32(in) + float32(inout)), element by element (MPI calls it)."""
    a = np.frombuffer(inbuf, dtype=ml_dtypes.bfloat16)
    b = np.frombuffer(inoutbuf, dtype=ml_dtypes.bfloat16)
    b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(ml_dtypes.bfloat16)


_OP = []  # the operation, made once per process (MPI.Op.Create after MPI_Init)


def bf16_op():
    if ml_dtypes is None:
        raise ImportError("a bf16 sum needs the ml_dtypes package: pip install ml_dtypes")
    if not _OP:
        _OP.append(MPI.Op.Create(_add, commute=True))
    return _OP[0]


def bf16_sum(comm, buf, what="bf16 sum"):
    """Sum the bf16 array ``buf`` over ``comm`` in place, as 2-byte words with :func:`bf16_op`:
    ``buf.nbytes`` each way, every partial sum rounded to bf16."""
    comm.Allreduce(buf, op=bf16_op(), what=what)  # as raw words; the operation reads bf16


def fp32_sum(comm, buf, what="fp32 sum of bf16"):
    """Sum the bf16 array ``buf`` over ``comm`` in place through float32: cast, Allreduce
    (twice ``buf.nbytes`` each way), one rounding back to bf16 at the end."""
    wide = buf.astype(np.float32)
    comm.Allreduce(wide, what=what)
    buf[...] = wide.astype(buf.dtype)


def reduce_scatter(comm, flat, grad_sum="fp32", what="reduce-scatter of bf16"):
    """This rank's block of the sum of ``flat`` (P equal blocks) over ``comm``, for 16-bit
    ``flat``: "fp32" widens it and Reduce_scatters float32 (twice ``flat.nbytes`` sent),
    returning the float32 block, for the caller to round once; "bf16" Reduce_scatters the
    2-byte words with :func:`bf16_op` (every partial sum rounded), returning a bf16 block. Any
    other ``flat`` (float32, float64) is Reduce_scattered as it is."""
    if flat.dtype.itemsize == 2 and grad_sum == "bf16":
        got = np.empty(flat.shape[0] // comm.size, dtype=flat.dtype)
        comm.Reduce_scatter(flat, got, op=bf16_op(), what=what)
        return got
    if flat.dtype.itemsize == 2:
        flat = flat.astype(np.float32)
    got = B.xp.empty(flat.shape[0] // comm.size, dtype=flat.dtype)
    comm.Reduce_scatter(flat, got, what=what)
    return got
