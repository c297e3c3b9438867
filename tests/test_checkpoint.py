"""Checkpoints: a run resumed on another layout equals the uninterrupted serial run, a kill
during a write leaves the previous checkpoint whole, and bad checkpoints are refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, assert_params_close, assert_refused, find_mpirun, run_mpi

from mpipar import train
from mpipar.runner import checkpoint

MLP = ["--model", "mlp", "--sizes", "64,16,12,10", "--batch-size", "12"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
       "--seq-len", "8", "--batch-size", "8"]
# each leg: (ranks, scheme and its flags, steps it trains to); legs hand over by checkpoint
CHAINS = {
    "gpt, adam": (GPT + ["--optim", "adam"], [
        (4, ["data_parallel", "--sync", "allreduce", "--zero", "1"], 2),
        (2, ["pipeline", "--timeline", "none"], 4),
        (2, ["tensor_parallel"], 6),
        (4, ["hybrid", "--dp", "2", "--tp", "2"], 8),
        (1, ["serial"], 10)]),
    "mlp, sgd momentum": (MLP + ["--optim", "sgd"], [
        (1, ["serial"], 2),
        (3, ["data_parallel"], 4),
        (2, ["tensor_parallel", "--update", "master"], 6),
        (2, ["pipeline", "--schedule", "interleaved", "--micro-batches", "4",
             "--timeline", "none"], 8),
        (4, ["hybrid", "--pp", "2", "--dp", "2"], 9),
        (3, ["data_parallel", "--sync", "ring", "--bucket-mb", "0.001"], 10)]),
}
COMMON = ["--dtype", "float64", "--quiet"]


def serial_params(flags, steps, tmp_path, capsys):
    path = tmp_path / f"serial-{steps}.npz"
    train.main("serial", [*flags, *COMMON, "--steps", str(steps), "--save-params", str(path)])
    capsys.readouterr()
    return train.load_params(path)


def run_chain(flags, legs, tmp_path, capsys):
    """Each leg (ranks, scheme and its flags, steps) continues from the last one's checkpoint;
    the end must equal an uninterrupted serial run. Returns the checkpoint folder. A scheme
    named by a path ending in .py is a script (a trainer of the tests' own)."""
    ckpt, saved = tmp_path / "ckpt", tmp_path / "final.npz"
    for i, (ranks, scheme, steps) in enumerate(legs):
        target = [scheme[0]] if scheme[0].endswith(".py") else ["-m", f"mpipar.{scheme[0]}"]
        args = [*target, *scheme[1:], *flags, *COMMON, "--steps", str(steps), "--checkpoint",
                ckpt, "--save-params", saved]
        out = run_mpi(ranks, args + (["--resume", ckpt] if i else []), timeout=120).stdout
        if i:
            assert f"resumed from {ckpt} after step {legs[i - 1][2]}" in out, out
    assert_params_close(train.load_params(saved), serial_params(flags, legs[-1][2], tmp_path,
                                                                capsys))
    return ckpt


@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_run_resumed_on_other_layouts_equals_the_serial_run(chain, tmp_path, capsys):
    ckpt = run_chain(*CHAINS[chain], tmp_path, capsys)
    assert len(os.listdir(ckpt)) == 2  # --keep 2: the last two, no temporary folder left


def complete(ckpt):
    """The steps of the checkpoints in ``ckpt`` that have a manifest."""
    if not ckpt.exists():
        return []
    return sorted(int(n.split("-")[1]) for n in os.listdir(ckpt)
                  if n.startswith("step-") and (ckpt / n / "manifest.json").exists())


def kill_during_a_write(proc, ckpt, after, within=120):
    """Kill every rank of ``proc`` once a checkpoint past step ``after`` is complete and the
    next one's folder is being written (moments set by the run's progress, not a clock)."""
    deadline = time.monotonic() + within
    while not ((done := complete(ckpt)) and done[-1] > after
               and any(n.startswith(".tmp-step-") for n in os.listdir(ckpt))):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill"
        assert time.monotonic() < deadline, f"no checkpoint past step {after} in {within} s"
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)  # every rank at once, mid-write
    proc.wait()


def test_a_kill_during_the_writes_leaves_the_last_checkpoint_whole(tmp_path, capsys):
    """Kill the job three times, each during a checkpoint's write a few steps after it resumed;
    every step-N folder left is whole, at most --keep + 1 of them (a kill between a rename and
    the pruning), and the newest resumes to exactly the serial run."""
    flags = GPT + ["--optim", "adam"] + COMMON
    ckpt, saved = tmp_path / "ckpt", tmp_path / "final.npz"
    cmd = [find_mpirun(), "-n", "2", sys.executable, "-m", "mpipar.data_parallel",
           "--sync", "allreduce", "--zero", "1", *flags, "--steps", "400",
           "--checkpoint", str(ckpt), "--checkpoint-every", "1", "--keep", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for i in range(3):  # each launch resumes where the last died
        start = complete(ckpt)[-1] if i else 0
        proc = subprocess.Popen(cmd + ["--resume", str(ckpt)] * (i > 0), cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        kill_during_a_write(proc, ckpt, after=start + 4)
        names = [n for n in os.listdir(ckpt) if n.startswith("step-")]
        assert len(names) == len(complete(ckpt)) in (3, 4), names  # none half written or pruned
    last = complete(ckpt)[-1]
    run_mpi(2, ["-m", "mpipar.pipeline", "--timeline", "none", *flags, "--steps", str(last + 2),
                "--checkpoint", ckpt, "--checkpoint-every", "1", "--keep", "3", "--resume", ckpt,
                "--save-params", saved], timeout=120)
    assert complete(ckpt)[-3:] == [last, last + 1, last + 2] and len(os.listdir(ckpt)) == 3
    assert_params_close(train.load_params(saved),
                        serial_params(GPT + ["--optim", "adam"], last + 2, tmp_path, capsys))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One checkpoint of a 2-rank tensor-parallel run after 3 steps (a file per rank)."""
    ckpt = tmp_path_factory.mktemp("written") / "ckpt"
    run_mpi(2, ["-m", "mpipar.tensor_parallel", *GPT, *COMMON, "--steps", "3",
                "--checkpoint", ckpt], timeout=120)
    return ckpt / "step-00000003"


@pytest.mark.parametrize("damage,flags,message", [
    ("truncate", [], "rank-00001.npz is truncated or corrupt"),
    ("delete", [], "rank-00001.npz is missing"),
    (None, ["--d-model", "32"], "d_model 16 (this run: 32)"),
    (None, ["--dtype", "float32"], "dtype float64 (this run: float32)"),
    (None, ["--optim", "sgd"], "optim adam (this run: sgd)"),
    (None, ["--steps", "2"], "the checkpoint is at step 3, beyond --steps 2"),
    ("manifest", [], "the manifest is unreadable"),
])
def test_a_bad_checkpoint_is_refused_on_every_rank(written, tmp_path, damage, flags, message):
    ckpt = tmp_path / "copy"
    shutil.copytree(written, ckpt)
    if damage == "truncate":
        with open(ckpt / "rank-00001.npz", "r+b") as f:
            f.truncate(os.path.getsize(ckpt / "rank-00001.npz") // 2)
    elif damage == "delete":
        os.remove(ckpt / "rank-00001.npz")
    elif damage == "manifest":
        (ckpt / "manifest.json").write_text("{")
    assert_refused(2, "pipeline", [*GPT, *COMMON, "--steps", "5", "--timeline", "none",
                                   "--resume", str(ckpt), *flags], message)


def _piece(m, i=0, **changes):
    m["pieces"][i].update(changes)


def _rewrite(ckpt, name, arrays):
    """Replace a rank's file by ``arrays`` and give the manifest its new digest (a crafted
    file that passes the digest check)."""
    with open(ckpt / name, "wb") as f:
        np.savez(f, **arrays)
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"][name] = checkpoint._sha256(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def _truncate_with_digest(ckpt):
    data = (ckpt / "rank-00001.npz").read_bytes()
    (ckpt / "rank-00001.npz").write_bytes(data[:len(data) // 2])
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["rank-00001.npz"] = checkpoint._sha256(ckpt / "rank-00001.npz")
    (ckpt / "manifest.json").write_text(json.dumps(m))


def _wrong_shape_with_digest(ckpt):
    m = json.loads((ckpt / "manifest.json").read_text())
    keys = [p["key"] for p in m["pieces"] if p["file"] == "rank-00000.npz"]
    _rewrite(ckpt, "rank-00000.npz", {k: np.zeros(3) for k in keys})


CORRUPTIONS = {  # name: (change to the parsed manifest, or to the folder), words of the refusal
    "a list": (lambda ckpt: (ckpt / "manifest.json").write_text("[]"), "a list, not an object"),
    "no step": (lambda m: m.pop("step"), "step missing or of the wrong type"),
    "step text": (lambda m: m.update(step="3"), "step missing or of the wrong type"),
    "step true": (lambda m: m.update(step=True), "step missing or of the wrong type"),
    "step negative": (lambda m: m.update(step=-1), "step, loss or adam_t is not"),
    "loss text": (lambda m: m.update(loss="low"), "step, loss or adam_t is not"),
    "adam_t text": (lambda m: m.update(adam_t="1"), "step, loss or adam_t is not"),
    "format text": (lambda m: m.update(format="1"), "format missing or of the wrong type"),
    "config list": (lambda m: m.update(config=[]), "config missing or of the wrong type"),
    "files list": (lambda m: m.update(files=[]), "files missing or of the wrong type"),
    "file path": (lambda m: m["files"].update({"../x.npz": "0" * 64}), "'../x.npz'"),
    "digest number": (lambda m: m["files"].update({"rank-00000.npz": 5}), "no file name"),
    "pieces object": (lambda m: m.update(pieces={}), "pieces missing or of the wrong type"),
    "piece text": (lambda m: m["pieces"].__setitem__(0, "w"), "piece 0 lacks one of"),
    "no select": (lambda m: m["pieces"][0].pop("select"), "piece 0 lacks one of"),
    "shape text": (lambda m: _piece(m, shape="16"), "piece 0 lacks one of"),
    "shape float": (lambda m: _piece(m, shape=[16.5]), "piece 0 has a shape [16.5]"),
    "file unlisted": (lambda m: _piece(m, file="rank-00009.npz"), "'rank-00009.npz' not listed"),
    "axis beyond": (lambda m: _piece(m, select=["axis", 5, [[0, 1]]]), "does not fit shape"),
    "run beyond": (lambda m: _piece(m, select=["flat", 0, 10 ** 9]), "outside"),
    "range reversed": (lambda m: _piece(m, select=["axis", 0, [[3, 1]]]), "does not fit"),
    "select unknown": (lambda m: _piece(m, select=["bogus"]), "select ['bogus'] does not fit"),
    "select narrower": (lambda m: _piece(m, select=["flat", 0, 1]), "where the manifest names"),
    "key unknown": (lambda m: _piece(m, key="zz"), "holds no array 'zz'"),
    "shape other": (lambda m: _piece(m, shape=m["pieces"][0]["shape"] + [1]),
                    "the manifest gives"),
    "no pieces": (lambda m: m.update(pieces=[]), "the checkpoint has no param of"),
    "truncated, digest matching": (_truncate_with_digest, "rank-00001.npz is unreadable"),
    "wrong shapes, digest matching": (_wrong_shape_with_digest, "where the manifest names"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_crafted_manifest_is_refused_in_one_line(written, tmp_path, capsys, name):
    """Valid JSON of the wrong shape, and files that match their digests but not the
    manifest: each refused with one line and exit code 2, never a traceback or a silent cast."""
    change, words = CORRUPTIONS[name]
    ckpt = tmp_path / "copy"
    shutil.copytree(written, ckpt)
    if change.__code__.co_varnames[:1] == ("ckpt",):  # a change to the folder
        change(ckpt)
    else:
        m = json.loads((ckpt / "manifest.json").read_text())
        change(m)  # in place
        (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit) as stop:
        train.main("serial", [*GPT, *COMMON, "--steps", "5", "--resume", str(ckpt)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: --resume")
    assert words in err, err


@pytest.mark.parametrize("ranks,scheme", [(2, ["pipeline"]), (4, ["hybrid", "--pp", "2"]),
                                          (2, ["data_parallel"]), (1, ["serial"])])
def test_resuming_at_the_last_step_trains_nothing_and_says_so(written, ranks, scheme):
    """--steps equal to the checkpoint's step: no step runs, the report is made of what there
    is (the pipeline's trace of no step: no bubble, no timeline)."""
    out = run_mpi(ranks, ["-m", f"mpipar.{scheme[0]}", *scheme[1:], *GPT, *COMMON, "--steps", "3",
                          "--resume", written], timeout=120).stdout
    assert f"resumed from {written} after step 3" in out and "final train loss" in out, out
    assert ("no step ran (resumed after step 3" in out) == (scheme[0] == "pipeline"), out


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 200 KiB (tmpfs), mounted for the test: room for one small checkpoint."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs",
                                            str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small file system needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("scheme,flags,message", [
    ("data_parallel", ["--checkpoint", "{disk}/c", "--checkpoint-every", "1", "--keep", "1"],
     "checkpoint {disk}/c/step-00000002: cannot write it (rank-00000.npz: No space left on "
     "device); the last whole one is step-00000001"),
    ("data_parallel", ["--sizes", "64,256,256,10", "--save-params", "{disk}/p.npz"],
     "--save-params {disk}/p.npz: cannot write it (No space left on device); nothing was saved"),
    ("pipeline", ["--sizes", "64,256,256,10", "--timeline", "{disk}/t.png", "--save-params",
                  "{tmp}/p.npz"],
     "--timeline {disk}/t.png: cannot write it (No space left on device); nothing was saved"),
])
def test_a_full_disk_ends_the_run_in_one_line(small_disk, tmp_path, scheme, flags, message):
    """Each output written onto a full disk: one line, exit code 1, no partial or temporary
    file left, every output that fits still written (the parameters beside a failed chart),
    and the checkpoint before the failed one whole."""
    if "t.png" in message:  # the chart of a pipeline run takes more room than its checkpoint
        (small_disk / "filler").write_bytes(b"\0" * 190_000)
    where = dict(disk=small_disk, tmp=tmp_path)
    proc = run_mpi(2, ["-m", f"mpipar.{scheme}", "--model", "mlp", "--steps", "4", "--quiet",
                       *(f.format(**where) for f in flags)],
                   timeout=120, check=False)
    assert proc.returncode == 1 and proc.stderr == f"error: {message.format(**where)}\n", \
        proc.stderr
    left = sorted(p.name for p in small_disk.rglob("*") if p.name != "filler")
    assert left == (["c", "manifest.json", "rank-00000.npz", "rank-00001.npz", "step-00000001"]
                    if "/c" in message else []), left
    assert "t.png" not in message or (tmp_path / "p.npz").exists()


def test_two_runs_cannot_share_a_checkpoint_folder(tmp_path):
    """While one run writes into a folder (it holds a lock on it), a second one is refused."""
    ckpt, env = tmp_path / "ckpt", dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    first = subprocess.Popen([find_mpirun(), "-n", "2", sys.executable, "-m",
                              "mpipar.data_parallel", "--steps", "100000", "--quiet",
                              "--checkpoint", str(ckpt), "--checkpoint-every", "1000"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (ckpt.exists() and checkpoint.checkpoints(ckpt)):
            assert first.poll() is None and time.time() < deadline, "the first run never wrote"
            time.sleep(0.1)
        assert_refused(2, "data_parallel", ["--checkpoint", str(ckpt), "--resume", str(ckpt)],
                       f"--checkpoint {ckpt} is in use by another run: wait for it to end")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    newest = int(checkpoint.checkpoints(ckpt)[-1].split("-")[1])
    run_mpi(2, ["-m", "mpipar.data_parallel", "--steps", str(newest + 1), "--quiet",
                "--checkpoint", ckpt, "--resume", ckpt], timeout=120)  # the lock died with it


def test_a_killed_writes_temporary_file_is_removed_at_the_next_start(tmp_path):
    dead = tmp_path / "p.npz.tmp-999999999"  # no such process
    alive = tmp_path / f"p.npz.tmp-{os.getpid()}"  # another run's write, going on
    dead.write_bytes(b"half")
    alive.write_bytes(b"half")
    run_mpi(1, ["-m", "mpipar.serial", "--steps", "1", "--quiet", "--save-params",
                tmp_path / "p.npz"], timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "p.npz"])


def test_output_paths_are_checked_before_training(tmp_path):
    assert_refused(2, "data_parallel", ["--save-params", str(tmp_path / "no" / "p.npz")],
                   "--save-params")
    assert_refused(2, "pipeline", ["--timeline", str(tmp_path)], "--timeline")
    (tmp_path / "file").write_text("")
    assert_refused(2, "tensor_parallel", ["--checkpoint", str(tmp_path / "file")],
                   "--checkpoint")
    assert_refused(2, "hybrid", ["--resume", str(tmp_path / "nothing")], "no such folder")
    (tmp_path / "used" / "step-00000001").mkdir(parents=True)
    (tmp_path / "used" / "step-00000001" / "manifest.json").write_text("{}")
    assert_refused(2, "data_parallel", ["--checkpoint", str(tmp_path / "used")],
                   "holds another run's checkpoints")
