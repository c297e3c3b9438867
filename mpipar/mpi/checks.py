"""What every receiving call of :class:`mpipar.mpi.comm.Comm` checks: MPI fills a buffer
with what arrives and says little when the sizes disagree (a longer message is an error that
names no sizes; a shorter one, or a gather's rows that do not match the counts, silently leaves
stale values). Each check fails with one line naming what came and what was expected."""

import numpy as np
from mpi4py import MPI

from mpipar.engine import backend as B


def check_array(a, shape=None, dtype=None, what="array"):
    """Refuse what MPI would silently get wrong: a non-contiguous view, a wrong shape/dtype."""
    if not isinstance(a, (np.ndarray, B.xp.ndarray)):
        raise TypeError(f"{what}: expected an array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: refusing a non-contiguous array of shape {a.shape} (a "
                         "transposed view or a strided slice?); MPI would read its memory in the "
                         "wrong order. Pass np.ascontiguousarray(a).")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise ValueError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")


def check_count(status, buf, source, op="Recv"):
    count = status.Get_count(MPI.BYTE)
    if count != buf.nbytes:
        raise ValueError(f"{op} from {source}: got {count} bytes, buffer of shape "
                         f"{buf.shape} {buf.dtype} expects {buf.nbytes}")


def check_rows(op, whose, a, rows, like=None):
    """A gather or scatter with counts moves exactly ``rows`` rows of ``a`` (of ``like``'s row
    shape and dtype): MPI itself would fill a longer buffer only in part, silently."""
    if a.shape[0] != rows:
        raise ValueError(f"{op}: {whose} has {a.shape[0]} rows, the counts say {rows}")
    if like is not None and (a.shape[1:], a.dtype) != (like.shape[1:], like.dtype):
        raise ValueError(f"{op}: {whose} has rows of shape {a.shape[1:]} {a.dtype}, the other "
                         f"side's are {like.shape[1:]} {like.dtype}")


def truncated(err, op, source, nbytes):
    """MPI's error for a message longer than its buffer, as one line naming both sizes (MPI
    tells only that it was longer); any other MPI error as it came."""
    if err.Get_error_class() != MPI.ERR_TRUNCATE:
        return err
    return ValueError(f"{op} from {source}: got a message longer than the {nbytes} bytes its "
                      "buffer expects")
