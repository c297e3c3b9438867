"""The array module, chosen in one place.

Every other module does ``from mpipar import backend as B`` and writes ``B.xp.zeros(...)``,
so switching NumPy for CuPy is one call to :func:`use`. float32 is the default dtype;
float64 is for exact comparisons between a parallel run and the serial one.
"""

import numpy as np

xp = np  # the array module in use: numpy, or cupy after use("cupy")
dtype = np.float32  # the default floating dtype of parameters and activations


def use(name="numpy", dtype_name=None):
    """Select the array module ("numpy" or "cupy") and, optionally, the dtype."""
    global xp
    if name == "numpy":
        xp = np
    elif name == "cupy":
        try:
            import cupy
        except ImportError as err:  # the gpu extra is optional
            raise SystemExit("--backend cupy needs CuPy: pip install -e '.[gpu]'") from err
        xp = cupy
    else:
        raise ValueError(f"unknown backend {name!r}: choose numpy or cupy")
    if dtype_name is not None:
        set_dtype(dtype_name)
    return xp


def cupy_problem():
    """Why ``--backend cupy`` cannot run here, or None: CuPy not installed, or no GPU that
    CUDA sees (the runner refuses the flag with this reason, on every rank)."""
    try:
        import cupy
    except ImportError:
        return "--backend cupy needs CuPy, which is not installed: pip install -e '.[gpu]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no driver, no runtime: CuPy's own error says which
        return f"--backend cupy needs a GPU, and CUDA says: {err}"
    return None if count else "--backend cupy needs a GPU, and CUDA sees none"


def set_dtype(name):
    """Set the default floating dtype from its name ("float32" or "float64")."""
    global dtype
    if name not in ("float32", "float64"):
        raise ValueError(f"unknown dtype {name!r}: choose float32 or float64")
    dtype = np.dtype(name).type
    return dtype


def to_numpy(a):
    """A host (NumPy) copy of an array of either backend; NumPy arrays pass through."""
    if xp is not np and isinstance(a, xp.ndarray):
        return xp.asnumpy(a)
    return np.asarray(a)


def asarray(a, dtype=None):
    """Move a host array to the backend's device (a no-op for NumPy)."""
    return xp.asarray(a, dtype=dtype)


def synchronize():
    """Wait for queued GPU work, so a buffer is complete before MPI reads it."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def cores():
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def steady_heap():
    """Make glibc keep freed memory for reuse instead of giving it back to the system: every
    block up to 32 MiB comes from the heap (M_MMAP_THRESHOLD) and the heap is never trimmed
    (M_TRIM_THRESHOLD), so a step reuses the pages an earlier step faulted in rather than
    faulting in fresh ones for each layer's output and each received message (a pipeline
    stage that receives its input ran about 1.4x slower than the first stage without it).
    The arithmetic is untouched; the process keeps its peak memory. True if set."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc: nothing to set
        mallopt = None
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**30))


# -- staging for MPI (mpipar.comm): a pip MPICH is not CUDA-aware, so device arrays go through
# host memory
def host(a):
    """The array MPI reads: itself for NumPy (a host array, such as a message header, also
    under CuPy); a host copy of a CuPy array (stream synchronised first)."""
    if xp is np or isinstance(a, np.ndarray):
        return a
    synchronize()
    return to_numpy(a)


def host_out(a):
    """A host buffer for MPI to write into, and the device array to copy it back to (None for
    a host array: NumPy's, or a header received into host memory under CuPy)."""
    if xp is np or isinstance(a, np.ndarray):
        return a, None
    return np.empty(a.shape, a.dtype), a


def copy_back(host, dev):
    """Copy what MPI wrote into ``host`` to the device array ``dev`` (nothing for NumPy)."""
    if dev is not None:
        dev[...] = asarray(host)
