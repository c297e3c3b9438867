"""Checkpoints that survive a crash and move between layouts.

    mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --zero 1 --optim adam \\
        --steps 100 --checkpoint ckpt --checkpoint-every 20
    mpirun -n 2 python -m mpipar.pipeline --model mlp --optim adam --steps 200 --resume ckpt

A checkpoint holds everything needed to continue exactly: every parameter, the optimizer's
state (SGD's momentum, Adam's two moments and its step count), the number of steps done (the
batches are a function of (seed, step) alone, so the seed, the batch size and the step decide
all the batches to come), and the layout it was written from, for the record.

The format does not depend on the layout. Every array is stored as pieces of the serial
model's tensors: canonical name, kind (``param``, ``momentum``, ``adam_m``, ``adam_v``), the
full logical shape, and which part of it the piece is (all of it; a tensor-parallel shard's
index ranges along one axis; a ZeRO shard's run of the flattened tensor). Each rank writes only
what it owns (its shards, its stage; a replicated tensor by one replica only) into its own file;
world rank 0 writes ``manifest.json``, which lists every piece and every file's SHA-256. To load,
each rank assembles the tensors it needs from the pieces and takes its own part of them, so a
run may resume on any layout: ZeRO-1 on 4 ranks, then a pipeline on 2, then tensor parallel.

Writes are atomic: a checkpoint is written into ``DIR/.tmp-step-N``, every file is flushed to
disk, and only when every rank has finished does rank 0 rename it ``DIR/step-N``; the previous
checkpoint stays valid until then. Then the oldest beyond the last ``--keep N`` are pruned, each
renamed ``DIR/.old-step-N`` at once (no longer a checkpoint) before its files are deleted, so a
kill mid-deletion leaves no half checkpoint that looks whole. A job killed between a checkpoint's
rename and the pruning leaves N + 1 whole checkpoints; the next one written prunes to N, and every
``step-N`` folder is complete whenever the job dies. Loading refuses, on every
rank with exit code 2, a missing or corrupt file, a piece that does not cover its tensor, and a
model, dtype, optimizer, seed or batch size other than the run's.

A run that writes into a folder locks it (an flock, which the kernel lets go when the process
ends, by a kill too): a second run writing into the same folder is refused. A write
that fails (a full disk) ends the run on every rank with one line; the checkpoints before it
stay whole. Loading checks the manifest's every key and piece, every file's SHA-256, and every
array's shape and dtype against what the manifest names, before it trusts a checkpoint.

All ranks must see the same directory (one machine, or a shared file system).
"""

import fcntl
import hashlib
import json
import os
import shutil
import zipfile
from collections import namedtuple

import numpy as np

from mpipar.engine import backend as B
from mpipar.engine.parameters import put, take
from mpipar.mpi import comm
from mpipar.runner.manifest import manifest_problem

FORMAT = 1
# name: canonical name; kind: "param" or an optimizer state; shape: the full logical shape;
# select: ["all"] | ["axis", axis, [[a, b], ...]] | ["flat", a, b]; array: this rank's live
# array (loading writes into it); write: whether this rank saves it.
Slot = namedtuple("Slot", "name kind shape select array write")


# ----------------------------------------------------------------------------- what a rank owns
def _state(opt, p):
    """The optimizer's arrays for p, made now if no step has made them yet."""
    if p not in opt.state:
        opt.state[p] = opt.fresh_state(p)
    return opt.state[p]


def slots(p, arrays, write):
    """The slots of one array's pieces of the serial model (:meth:`Parameter.pieces`):
    ``arrays`` are (kind, array) pairs shaped like ``p.data``."""
    out = []
    for piece in p.pieces():
        for kind, arr in arrays:
            part = arr if piece.run is None else arr.reshape(-1)[piece.run[0]:piece.run[1]]
            out.append(Slot(piece.name, kind, piece.shape, piece.select, part, write))
    return out


def slots_of(trainer):
    """Every slot of this rank, by one rule over placements: an array is written by the first
    rank of the groups that replicate it, and an optimizer's state where its parameter is. An
    optimizer's own arrays (a ZeRO shard's values, the tensor-parallel master's tensors) are
    loaded but not written: the model's parameters already hold those values."""
    model = [p for p in trainer.parameters() if p.data is not None]
    out = [s for p in model for s in slots(p, [("param", p.data)],
                                           p.placement.first_of_replicas())]
    own = {id(p) for p in model}
    for opt in trainer.optimizers():
        for p in opt.params:
            if id(p) not in own:
                out += slots(p, [("param", p.data)], write=False)
            out += slots(p, list(zip(opt.state_kinds, _state(opt, p))),
                         p.placement.first_of_replicas())
    return out


# ----------------------------------------------------------------------------- writing
def write_atomically(path, write):
    """Write a file through ``write(f)`` atomically: into ``PATH.tmp-PID``, flushed to disk,
    then renamed over ``path``, so a kill or a full disk during the write leaves the previous
    file whole (and a failed write no temporary file; :func:`remove_orphans` removes the one a
    kill leaves)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # the write failed: the previous file is untouched
            os.remove(tmp)
    return path


def remove_orphans(path):
    """Remove the temporary files of :func:`write_atomically` for ``path`` that a killed run
    left (their process is gone)."""
    folder, stem = os.path.split(path)
    for name in os.listdir(folder or "."):
        pid = name[len(stem) + 5:] if name.startswith(f"{stem}.tmp-") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            os.remove(os.path.join(folder, name))


def save_params(path, named_arrays):
    """Write {canonical name: array} to an .npz file (plain arrays, no pickle), atomically
    (:func:`write_atomically`). Returns the path written (".npz" added if absent)."""
    path = npz_path(path)
    return write_atomically(path, lambda f: np.savez(  # 16-bit values as float32, exactly
        f, **{name: widened(B.to_numpy(a)) for name, a in named_arrays}))


def widened(a):
    """A bf16 or fp16 array as float32 (every such value is one): .npz keeps NumPy's own
    types only, and would read a bf16 array back as raw 2-byte records."""
    return a.astype(np.float32) if a.dtype.itemsize == 2 and a.dtype.kind in "fV" else a


def npz_path(path):
    return path if path.endswith(".npz") else path + ".npz"  # as np.savez names it


def load_params(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def model_config(a):
    """What must match for a checkpoint to continue this run exactly."""
    shape = {"sizes": a.sizes, "data": a.data, "samples": a.samples} if a.model == "mlp" else \
        {k: getattr(a, k) for k in ("d_model", "n_heads", "n_layers", "seq_len")}
    if a.model == "gpt" and a.experts:  # a dense GPT's manifest stays as it was
        shape.update(experts=a.experts, top_k=a.top_k, aux_loss_coef=a.aux_loss_coef)
    if getattr(a, "precision", "fp32") != "fp32":  # so does a full-precision run's
        shape.update(precision=a.precision)
    return dict(model=a.model, **shape, dtype=a.dtype, optim=a.optim, seed=a.seed,
                batch_size=a.batch_size)


def _fsynced(path, write):
    """Write a file through ``write(f)``, flush it to disk, return its SHA-256."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(path)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory, trainer, a, steps_done, loss):
    """Write a checkpoint of the run after ``steps_done`` steps into ``directory`` (every rank
    calls this). Returns the checkpoint's path. A write that fails on any rank (a full disk)
    ends the run on every rank with one line, the checkpoints before it whole."""
    world = comm.world()  # its calls are watched: a stopped rank ends the job, here too
    rank = world.rank
    final = os.path.join(directory, f"step-{steps_done:08d}")
    tmp = os.path.join(directory, f".tmp-step-{steps_done:08d}")
    problem = _begin(directory, tmp) if rank == 0 else None
    problem = world.bcast_obj(problem, what="whether the checkpoint's folder was made")
    mine = [s for s in slots_of(trainer) if s.write]
    name, digest = f"rank-{rank:05d}.npz", None
    if problem is None:
        arrays = {f"a{i}": widened(B.to_numpy(s.array)) for i, s in enumerate(mine)}
        try:
            digest = _fsynced(os.path.join(tmp, name), lambda f: np.savez(f, **arrays))
        except OSError as err:
            problem = f"{name}: {err.strerror or err}"
    pieces = [dict(name=s.name, kind=s.kind, shape=s.shape, select=s.select, file=name,
                   key=f"a{i}") for i, s in enumerate(mine)]
    t = [o.t for o in trainer.optimizers() if hasattr(o, "t")]
    scaler = getattr(trainer, "scaler", None)  # fp16's loss scale: the same on every rank
    gathered = world.gather_obj((name, digest, pieces, t, problem), root=0,
                                what="each rank's pieces")
    if rank == 0:
        problem = next((p for *_, p in gathered if p), None)
        if problem is None:
            manifest = dict(format=FORMAT, step=steps_done, loss=loss, config=model_config(a),
                            layout=dict(scheme=a.scheme, dp=a.dp, tp=a.tp, pp=a.pp,
                                        ranks=world.size),
                            adam_t=max((x for *_, ts, _ in gathered for x in ts), default=None),
                            **({"loss_scale": scaler.state()} if scaler else {}),
                            files={f: d for f, d, *_ in gathered},
                            pieces=[piece for _, _, ps, *_ in gathered for piece in ps])
            problem = _commit(directory, tmp, final, manifest, a.keep)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            whole = checkpoints(directory)
            problem = (f"checkpoint {final}: cannot write it ({problem}); "
                       + (f"the last whole one is {whole[-1]}" if whole else "there is none"))
    problem = world.bcast_obj(problem, what="whether the checkpoint is whole")
    if problem:
        comm.refuse(problem, code=1)
    return final


def _begin(directory, tmp):
    """Rank 0: clear what a killed run left, make the folder a checkpoint is written into."""
    try:
        for name in os.listdir(directory):
            if name.startswith((".tmp-step-", ".old-step-")):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        os.makedirs(tmp)
    except OSError as err:
        return f"{tmp}: {err.strerror or err}"
    return None


def _commit(directory, tmp, final, manifest, keep):
    """Rank 0, once every rank's file is on disk: the manifest, then the rename that makes the
    checkpoint exist, then the pruning to the last ``keep``. None, or what failed."""
    text = json.dumps(manifest, indent=1).encode()
    try:
        _fsynced(os.path.join(tmp, "manifest.json"), lambda f: f.write(text))
        _sync_dir(tmp)
    except OSError as err:
        return f"manifest.json: {err.strerror or err}"
    if os.path.exists(final):  # this step written before (a run resumed from an older one)
        retire(directory, os.path.basename(final))
    os.rename(tmp, final)  # the checkpoint exists from here on, whole
    _sync_dir(directory)
    for old in sorted(checkpoints(directory))[:-max(keep, 1)]:
        retire(directory, old)
    return None


_LOCKS = {}  # folder: the open file descriptor of it, locked while the run lasts


def lock(directory):
    """Lock the folder itself (an flock on it, which the kernel lets go when the process ends,
    by a kill too) so that a second run cannot write into it; False when another run holds it."""
    key = os.path.realpath(directory)
    if key in _LOCKS:
        return True
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _LOCKS[key] = fd
    return True


def unlock():
    """Let go of every folder :func:`lock` holds (the run is over)."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])


def retire(directory, name):
    """Delete checkpoint ``name``: renamed ``.old-<name>`` first (one atomic step, after which it
    is no checkpoint), then its files."""
    gone = os.path.join(directory, f".old-{name}")
    os.rename(os.path.join(directory, name), gone)
    _sync_dir(directory)
    shutil.rmtree(gone, ignore_errors=True)


def checkpoints(directory):
    """The complete checkpoints in a directory (those with a manifest), oldest first."""
    names = [n for n in os.listdir(directory) if n.startswith("step-")]
    return sorted(n for n in names if os.path.exists(os.path.join(directory, n,
                                                                   "manifest.json")))


# ----------------------------------------------------------------------------- reading
def find(path):
    """The checkpoint that ``--resume PATH`` names: PATH itself if it holds a manifest, else
    the newest complete checkpoint in it; None if there is none."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    found = checkpoints(path) if os.path.isdir(path) else []
    return os.path.join(path, found[-1]) if found else None


def inspect(path, a):
    """(manifest, None), or (None, why this run cannot resume from ``path``). One rank reads
    every file once to check its SHA-256; the others wait for its verdict."""
    where = find(path)
    if where is None:
        return None, f"--resume {path}: no checkpoint there (no manifest.json, no step-*/ with one)"
    try:
        with open(os.path.join(where, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:  # a JSON error is a ValueError, a bad UTF-8 too
        return None, f"--resume {where}: the manifest is unreadable ({err})"
    problem = manifest_problem(manifest)
    if problem:
        return None, f"--resume {where}: the manifest is not a checkpoint's ({problem})"
    config, step = manifest["config"], manifest["step"]
    want = model_config(a)
    differ = [f"{k} {config.get(k)} (this run: {want.get(k)})" for k in sorted({*want, *config})
              if config.get(k) != want.get(k)]
    if manifest.get("format") != FORMAT or differ:
        return None, (f"--resume {where}: the checkpoint does not fit this run: "
                      + ", ".join(differ or [f"format {manifest.get('format')}"]))
    if step > a.steps:
        return None, f"--resume {where}: the checkpoint is at step {step}, beyond --steps {a.steps}"
    for name, digest in manifest["files"].items():
        path = os.path.join(where, name)
        if not os.path.exists(path):
            return None, f"--resume {where}: {name} is missing (a rank's shard)"
        if _sha256(path) != digest:
            return None, f"--resume {where}: {name} is truncated or corrupt (SHA-256 differs)"
    manifest["where"] = where
    return manifest, None


def _read(where, piece, files):
    """The array a piece names, its file opened once (a file whose digest matched can still be
    no .npz: the digest was written with it)."""
    name = piece["file"]
    try:
        if name not in files:
            files[name] = np.load(os.path.join(where, name), allow_pickle=False)
        return files[name][piece["key"]]
    except KeyError:
        raise ValueError(f"--resume {where}: {name} holds no array {piece['key']!r}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"--resume {where}: {name} is unreadable ({err})") from None


def _piece_shape(select, shape):
    """The shape of the part ``select`` names of a tensor of ``shape`` (as :func:`take`)."""
    if select[0] == "all":
        return tuple(shape)
    if select[0] == "flat":
        return (select[2] - select[1],)
    axis, rows = select[1], sum(b - a for a, b in select[2])
    return tuple(rows if i == axis else n for i, n in enumerate(shape))


def assemble(where, pieces, shape, files, key):
    """The full tensor ``key`` = (name, kind) from its pieces, every entry covered."""
    if not pieces:
        raise ValueError(f"--resume {where}: the checkpoint has no {key[1]} of {key[0]}")
    full, seen = None, np.zeros(shape, dtype=bool)
    for piece in pieces:
        if tuple(piece["shape"]) != tuple(shape):
            raise ValueError(f"--resume {where}: the manifest gives {key[0]} the shape "
                             f"{tuple(piece['shape'])}, this run {tuple(shape)}")
        value = _read(where, piece, files)
        want = _piece_shape(piece["select"], shape)
        if value.shape != want or full is not None and value.dtype != full.dtype:
            raise ValueError(f"--resume {where}: {piece['file']} holds {key[1]} of {key[0]} as "
                             f"{value.shape} {value.dtype}, where the manifest names {want}"
                             + (f" {full.dtype}" if full is not None else ""))
        full = np.empty(shape, dtype=value.dtype) if full is None else full
        put(full, piece["select"], value)
        put(seen, piece["select"], np.ones(value.shape, dtype=bool))  # what it covers
    if not seen.all():
        raise ValueError(f"--resume {where}: the pieces of {key[0]} ({key[1]}) leave "
                         f"{int((~seen).sum())} of its {seen.size} entries out: a shard is missing")
    return full


def load(path, trainer, a):
    """Fill this rank's parameters and optimizer state from the checkpoint ``path`` names
    (every rank calls this); returns (steps done, the last loss). Refuses on every rank."""
    world = comm.world()  # watched calls, as in save
    manifest, problem = inspect(path, a) if world.rank == 0 else (None, None)
    manifest, problem = world.bcast_obj((manifest, problem), root=0, what="the manifest")
    if problem:
        comm.refuse(problem)
    by_key, files, fulls = {}, {}, {}
    for piece in manifest["pieces"]:
        by_key.setdefault((piece["name"], piece["kind"]), []).append(piece)
    try:
        for s in slots_of(trainer):
            key = (s.name, s.kind)
            if key not in fulls:
                fulls[key] = assemble(manifest["where"], by_key.get(key), s.shape, files, key)
            if fulls[key].dtype != widened(np.empty(0, s.array.dtype)).dtype:  # 16-bit: float32
                raise ValueError(f"--resume {manifest['where']}: {key[1]} of {key[0]} is "
                                 f"{fulls[key].dtype}, this run's {s.array.dtype}")
            s.array[...] = B.asarray(take(fulls[key], s.select)).reshape(s.array.shape)
    except ValueError as err:
        problem = str(err)
    problems = [p for p in world.allgather_obj(problem, what="each rank's verdict") if p]
    if problems:
        comm.refuse(problems[0])
    for o in trainer.optimizers():
        if hasattr(o, "t") and manifest["adam_t"] is not None:
            o.t = manifest["adam_t"]
    if getattr(trainer, "scaler", None) is not None and "loss_scale" in manifest:
        trainer.scaler.load(manifest["loss_scale"])
    return manifest["step"], manifest["loss"]
