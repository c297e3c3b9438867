"""A stand-in for CuPy on the CPU: NumPy arithmetic, CuPy's refusals.

CuPy's arrays live on the GPU and refuse to become host arrays behind the code's back:
``np.asarray(device_array)`` raises TypeError, and so does arithmetic mixing a device array
with a NumPy array; only an explicit ``.get()`` (or ``cupy.asnumpy``) copies to the host, while
host-to-device copies (``cupy.asarray``, assigning a host array into a slice) are allowed, and
so are ``float()`` and ``int()`` of a one-element array. This module gives ``backend.xp`` the
same rules with NumPy underneath, so that a test on a machine without a GPU finds every place
that would raise on one, and the arithmetic (hence every bit of the result) stays NumPy's.
Only the functions mpipar calls on ``xp`` are offered; the module's ``__name__`` is not
"numpy", so code that asks takes its device path (as with CuPy).
"""

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

_REFUSAL = "implicit conversion of a strict (device) array to a NumPy array; call .get()"


def _unwrap(x):
    """The NumPy array inside ``x``, recursively through lists, tuples and dicts; a plain
    NumPy array (a host array meeting a device one) is refused; scalars pass through."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"a NumPy array (shape {x.shape}) mixed with strict (device) arrays")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):  # keyword arguments
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _host_ok(x):
    """Like :func:`_unwrap`, but a host array is accepted (a host-to-device copy, as CuPy's
    indexing and slice assignment allow)."""
    return x if isinstance(x, np.ndarray) else _unwrap(x)


def _wrap(x):
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 (named as cupy.ndarray)
    """A NumPy array that NumPy cannot see into: ``__array__`` raises, ufuncs and array
    functions accept only strict arrays and scalars and return strict arrays."""

    __slots__ = ("_a",)

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_REFUSAL)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"])
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs), **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    def get(self, stream=None, order="C", out=None):
        """A host (NumPy) copy, the one explicit way out; into ``out`` (a host array of the
        same shape and dtype, as CuPy checks) when given."""
        if out is None:
            return self._a.copy()
        if not isinstance(out, np.ndarray) or out.shape != self._a.shape or \
                out.dtype != self._a.dtype:
            raise TypeError("get(out=...) needs a NumPy array of the same shape and dtype")
        out[...] = self._a
        return out

    def set(self, arr, stream=None):
        """Copy a host array of the same shape and dtype in (``cupy.ndarray.set``)."""
        if not isinstance(arr, np.ndarray) or arr.shape != self._a.shape or \
                arr.dtype != self._a.dtype:
            raise TypeError("set() needs a NumPy array of the same shape and dtype")
        self._a[...] = arr

    def __getitem__(self, key):
        return _wrap(self._a[_host_ok(key)])

    def __setitem__(self, key, value):
        self._a[_host_ok(key)] = _host_ok(value)

    def __getattr__(self, name):  # shape, dtype, T, reshape, sum, mean, astype, ...
        if name.startswith("__"):  # __array_interface__, __array_struct__: NumPy's ways in
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)
        return lambda *args, **kwargs: _wrap(attr(*_unwrap(args), **_unwrap(kwargs)))

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __bool__(self):
        return bool(self._a)

    def __repr__(self):
        return f"strict({self._a!r})"


def _device(func):
    """``func`` on strict arrays only, its array results strict."""
    return lambda *args, **kwargs: _wrap(func(*_unwrap(args), **_unwrap(kwargs)))


def array(obj, dtype=None, copy=True, order="K"):
    """A device copy of a host or device array (host-to-device is allowed, as in CuPy)."""
    return ndarray(np.array(_host_ok(obj), dtype=dtype, copy=copy, order=order))


def asarray(obj, dtype=None, order=None):
    return ndarray(np.asarray(_host_ok(obj), dtype=dtype, order=order))


def asnumpy(a):
    """The host copy (``cupy.asnumpy``)."""
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


zeros, empty, arange = _device(np.zeros), _device(np.empty), _device(np.arange)
zeros_like, empty_like, ones_like = _device(np.zeros_like), _device(np.empty_like), \
    _device(np.ones_like)
ascontiguousarray, array_split = _device(np.ascontiguousarray), _device(np.array_split)
concatenate, moveaxis, where = _device(np.concatenate), _device(np.moveaxis), _device(np.where)
exp, log, sqrt, tanh, matmul, maximum = (_device(f) for f in (np.exp, np.log, np.sqrt,
                                                             np.tanh, np.matmul, np.maximum))


class _Add:
    """``add`` and ``add.at`` (unbuffered scatter-add), on strict arrays."""

    __call__ = staticmethod(_device(np.add))

    @staticmethod
    def at(a, indices, b):
        np.add.at(_unwrap(a), _host_ok(indices), _unwrap(b))


add = _Add()


class cuda:  # noqa: N801 (backend.synchronize calls xp.cuda.get_current_stream().synchronize())
    """Nothing is queued: synchronising returns at once."""

    class _Stream:
        def synchronize(self):
            pass

    @staticmethod
    def get_current_stream():
        return cuda._Stream()
