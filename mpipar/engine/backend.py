"""The array module, chosen in one place.

Every other module does ``from mpipar.engine import backend as B`` and writes ``B.xp.zeros(...)``,
so switching NumPy for CuPy is one call to :func:`use`. float32 is the default dtype;
float64 is for exact comparisons between a parallel run and the serial one.
"""

import numpy as np

xp = np  # the array module in use: numpy, or cupy after use("cupy")
dtype = np.float32  # the default floating dtype of parameters and activations
# mixed precision (--precision bf16 or fp16): dtype is then the 16-bit STORAGE type of
# parameters, gradients and the activations a layer keeps or passes on, and compute the
# float32 every layer computes in (mpipar/engine/precision.py); otherwise both are dtype
compute = np.float32
low = False  # whether dtype is a 16-bit storage type
CUDA_AWARE = False  # MPI reads and writes device arrays itself (set by use("cupy"))
DEVICE = None  # (this rank's GPU, GPUs seen, local rank) once use("cupy") has chosen one
STAGED = {"copies": 0, "to host": 0, "to device": 0}  # bytes staged for MPI, this rank


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
        select_device()
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


def on_this_machine():
    """(this rank's number among the ranks on its own machine, how many those are): MPI's
    shared-memory split."""
    from mpi4py import MPI

    from mpipar.mpi.failure import watched

    with watched("Split_type", "all ranks", "which ranks share this machine"):
        local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    rank, size = local.Get_rank(), local.Get_size()
    local.Free()
    return rank, size


def device_for(local, count):
    """The GPU a rank uses: its local rank modulo the GPUs it sees, so that four ranks on a
    machine with one GPU share it and eight ranks on four GPUs take two each."""
    return local % count


def cuda_aware():
    """Whether MPI moves device buffers itself: ``MPIPAR_CUDA_AWARE=0|1`` if set, else the MPI
    library's answer (``MPIX_Query_cuda_support``, an extension of MPICH and Open MPI; False
    where the library lacks it). A pip MPICH answers 0: it is built without CUDA."""
    import ctypes
    import os

    from mpi4py import MPI

    if os.environ.get("MPIPAR_CUDA_AWARE") in ("0", "1"):
        return os.environ["MPIPAR_CUDA_AWARE"] == "1"
    query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    return bool(query()) if query is not None else False


def select_device():
    """Under CuPy: make this rank's GPU current (:func:`device_for`) and ask MPI whether it
    is CUDA-aware (every rank calls this, from :func:`use`: the local rank is a collective)."""
    global CUDA_AWARE, DEVICE
    local, count = on_this_machine()[0], xp.cuda.runtime.getDeviceCount()
    DEVICE = (device_for(local, count), count, local)
    xp.cuda.Device(DEVICE[0]).use()
    CUDA_AWARE = cuda_aware()


def describe():
    """One line on where arrays live and how MPI reaches them (the runner prints it)."""
    if xp is np:
        return "backend numpy: arrays in host memory, handed to MPI as they are"
    device, count, local = DEVICE if DEVICE else (0, 1, 0)
    how = ("device buffers handed to MPI directly (CUDA-aware MPI)" if CUDA_AWARE else
           "MPI buffers staged through pinned host memory (MPI is not CUDA-aware): one "
           "counted copy each way per call")
    return f"backend cupy: local rank {local} on GPU {device} of {count}; {how}"


def staged_line():
    """This rank's staging counts, for the end of a run."""
    return (f"staged for MPI on this rank: {STAGED['copies']} copies, "
            f"{STAGED['to host'] / 1e6:.3f} MB device->host, "
            f"{STAGED['to device'] / 1e6:.3f} MB host->device")


def set_dtype(name):
    """Set the default floating dtype from its name ("float32" or "float64"); full
    precision: storage and compute alike."""
    global dtype, compute, low
    if name not in ("float32", "float64"):
        raise ValueError(f"unknown dtype {name!r}: choose float32 or float64")
    dtype = compute = np.dtype(name).type
    low = False
    return dtype


def set_precision(name):
    """Mixed precision: store in ``name`` ("bf16" or "fp16"), compute in float32; "fp32" is
    :func:`set_dtype` ("float32")."""
    global dtype, compute, low
    if name == "fp32":
        return set_dtype("float32")
    from mpipar.engine.precision import dtype_of

    dtype, compute, low = dtype_of(name).type, np.float32, True
    np.seterr(over="ignore", invalid="ignore")  # an overflow is expected: the loss scale's
    return dtype


def load(a):
    """A stored array as the layers compute with it: float32 from a 16-bit one (exactly: every
    bf16 or fp16 value is a float32); anything else as it is."""
    return a.astype(compute) if low and getattr(a, "dtype", None) == dtype else a


def store(a):
    """An array as it is kept or passed on: rounded to the 16-bit storage type from float32;
    anything else (integers, masks, full precision) as it is."""
    return a.astype(dtype) if low and getattr(a, "dtype", None) == compute else a


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


# -- staging for MPI (mpipar.mpi.comm): a pip MPICH is not CUDA-aware, so device arrays go through
# host memory, each crossing one explicit copy counted in STAGED
def pinned(shape, dtype_):
    """An empty host array in page-locked memory (CuPy's pinned pool: the GPU copies to and
    from it directly); plain host memory where the module has no pinned allocator."""
    alloc = getattr(getattr(xp, "cuda", None), "alloc_pinned_memory", None)
    size = int(np.prod(shape, dtype=np.int64))
    if alloc is None or size == 0:
        return np.empty(shape, dtype_)
    memory = alloc(size * np.dtype(dtype_).itemsize)  # back to the pool when the array goes
    return np.frombuffer(memory, dtype_, size).reshape(shape)


def words(a):
    """A bf16 array as MPI can move it: its raw 2-byte words (uint16), the same memory. MPI
    has no bf16 type (MPICH's float16 is fp16); anything else as it is."""
    return a.view(np.uint16) if a.dtype.kind == "V" and a.dtype.itemsize == 2 else a


def host(a):
    """The array MPI reads: itself for NumPy, for a host array (such as a message header,
    also under CuPy) and for a device array when MPI is CUDA-aware; else a pinned host copy
    of the device array (stream synchronised first), counted in STAGED. bf16 goes as its
    2-byte words (:func:`words`)."""
    if xp is np or isinstance(a, np.ndarray):
        return words(a)
    synchronize()
    if CUDA_AWARE:
        return a
    out = pinned(a.shape, a.dtype)
    a.get(out=out)
    STAGED["copies"] += 1
    STAGED["to host"] += a.nbytes
    return out


def host_out(a):
    """A host buffer for MPI to write into, and the device array to copy it back to (None for
    a host array: NumPy's, or a header received into host memory under CuPy, and for a device
    array that a CUDA-aware MPI writes itself)."""
    if xp is np or isinstance(a, np.ndarray):
        return words(a), None
    if CUDA_AWARE:
        synchronize()  # the stream's earlier work on it is done before MPI writes
        return a, None
    return pinned(a.shape, a.dtype), a


def copy_back(host, dev):
    """Copy what MPI wrote into ``host`` to the device array ``dev`` (nothing for NumPy),
    counted in STAGED."""
    if dev is not None:
        dev.set(host)
        synchronize()  # the copy has left ``host`` before its pinned memory may be reused
        STAGED["copies"] += 1
        STAGED["to device"] += dev.nbytes
