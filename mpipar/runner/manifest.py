"""What a checkpoint's ``manifest.json`` must hold before loading trusts it.

:func:`mpipar.runner.checkpoint.save` writes the manifest; :func:`mpipar.runner.checkpoint.inspect`
reads it back and asks :func:`manifest_problem` whether it is one that code wrote: a manifest
edited by hand, cut short or written by another program is refused in one line rather than
failing somewhere deep in the loading. Its keys:

- ``format``, ``step`` (whole numbers), ``loss`` (a number or null), ``adam_t`` (a count or
  null), ``config`` (an object: what must match the run, its model and sizes, dtype,
  optimizer, seed and batch size; :func:`mpipar.runner.checkpoint.inspect` compares it), and
  ``layout`` (the scheme and grid it was written from, for the record: not checked);
- ``files``: each rank's file name (no folder in it) and its SHA-256 (64 hex digits);
- ``pieces``: one object per stored part of a serial tensor: its ``name``, ``kind``, full
  ``shape``, the ``file`` and array ``key`` it is in, and ``select``, which part of the tensor
  it is: ``["all"]``, ``["flat", start, stop]`` (a run of the flattened tensor, ZeRO's shard)
  or ``["axis", axis, [[start, stop], ...]]`` (index ranges along one axis, a tensor-parallel
  shard).
"""

import os

import numpy as np


def _is_int(x, low=0):
    return type(x) is int and x >= low


def _select_problem(select, shape):
    """Why ``select`` names no part of a tensor of ``shape`` (None when it does)."""
    size = int(np.prod(shape))
    if select == ["all"]:
        return None
    if len(select) == 3 and select[0] == "flat" and _is_int(select[1]) and _is_int(select[2]):
        return None if select[1] < select[2] <= size else f"run {select[1:]} outside {size}"
    if len(select) == 3 and select[0] == "axis" and _is_int(select[1]) and select[1] < len(shape) \
            and isinstance(select[2], list) and select[2] and all(
                isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1])
                and r[0] < r[1] <= shape[select[1]] for r in select[2]):
        return None
    return f"select {select} does not fit shape {shape}"


def manifest_problem(m):
    """Why ``m`` (a parsed manifest.json) is not one this code wrote, or None: every key of
    the right type, every piece naming a part of its tensor and a file the manifest lists."""
    if not isinstance(m, dict):
        return f"a {type(m).__name__}, not an object"
    want = dict(format=int, step=int, config=dict, files=dict, pieces=list)
    missing = [k for k, kind in want.items() if type(m.get(k)) is not kind]
    if missing:
        return f"{', '.join(missing)} missing or of the wrong type"
    if not _is_int(m["step"]) or not isinstance(m.get("loss"), (int, float, type(None))) or \
            not (m.get("adam_t") is None or _is_int(m["adam_t"])):
        return "step, loss or adam_t is not a count or number"
    for name, digest in m["files"].items():
        if os.path.basename(name) != name or name in ("", ".", "..") or \
                not (isinstance(digest, str) and len(digest) == 64):
            return f"file entry {name!r}: {digest!r} is no file name and SHA-256"
    keys = dict(name=str, kind=str, shape=list, select=list, file=str, key=str)
    for i, piece in enumerate(m["pieces"]):
        if not isinstance(piece, dict) or any(type(piece.get(k)) is not t for k, t in keys.items()):
            return f"piece {i} lacks one of {', '.join(keys)} or has it of the wrong type"
        if not all(_is_int(n) for n in piece["shape"]) or piece["file"] not in m["files"]:
            return f"piece {i} has a shape {piece['shape']} or a file {piece['file']!r} not listed"
        problem = _select_problem(piece["select"], piece["shape"])
        if problem:
            return f"piece {i}: {problem}"
    return None
