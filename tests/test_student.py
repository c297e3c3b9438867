"""The student track: a copy whose exercises are stubs fails every one of them, the reference
passes every one, a one-element mistake is caught and named by the parameter it spoils, and an
exercise passes by its own code while another that it calls is still a stub."""

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from test_bench_cli import read_only_folder

from mpipar.tools import student


def grade(copy, *names):
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.student", "grade", str(copy),
                           *names],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines()
                 if line[:1].strip() and line.split(None, 1)[0] in
                 {ex.name for ex in student.EXERCISES})
    return proc, lines


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    target = tmp_path_factory.mktemp("student") / "mpipar-exercises"
    student.make(target)
    return target


def test_every_exercise_is_a_stub_with_its_task_and_docstring(copy):
    for ex in student.EXERCISES:
        original = ast.parse((ROOT / ex.path).read_text())
        tree = ast.parse((copy / ex.path).read_text())
        for name in ex.functions:
            node, before = student.definition(tree, name), student.definition(original, name)
            assert ast.get_docstring(node) == ast.get_docstring(before), name
            body = [n for n in node.body if not isinstance(n, ast.Expr)]
            assert len(body) == 1 and isinstance(body[0], ast.Raise), (ex.name, name)
            named = ast.unparse(body[0]).split(":")[0]  # exercise NAME (part of LARGER)
            assert re.search(rf"(?<![\w-]){re.escape(ex.name)}(?![\w-])", named), named
    untouched = (ROOT / "mpipar" / "engine" / "nn.py").read_text()
    assert (copy / "mpipar" / "engine" / "nn.py").read_text() == untouched


def test_the_stubs_fail_and_the_reference_passes(copy):
    proc, lines = grade(copy)
    assert proc.returncode == len(student.EXERCISES), proc.stdout + proc.stderr
    assert len(lines) == len(student.EXERCISES), proc.stdout
    assert all(v == "FAILED: not written yet (NotImplementedError)" for v in lines.values()), \
        proc.stdout
    proc, lines = grade(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(lines) == len(student.EXERCISES), proc.stdout
    assert all(v == "passed" for v in lines.values()), proc.stdout
    assert f"{len(student.EXERCISES)} of {len(student.EXERCISES)} exercises passed" in proc.stdout


def solution(name):
    """A worked solution's text, its lines joined by single spaces."""
    return " ".join((ROOT / "lessons" / "solutions" / name).read_text().split())


def graded_with(tmp_path, exercise, right, wrong):
    """The grade of ``exercise`` in a fresh copy whose file holds the reference with the one
    line(s) ``right`` replaced by ``wrong``."""
    copy = tmp_path / "copy"
    student.make(copy)
    path = student.find(exercise).path
    source = (ROOT / path).read_text()
    assert source.count(right) == 1
    (copy / path).write_text(source.replace(right, wrong))
    proc, lines = grade(copy, exercise)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return lines[exercise]


def test_a_one_element_mistake_is_named(tmp_path):
    """The reference ring allreduce with one element of each received chunk left unsummed: it
    would train, though not as the serial model does; the ring's own check names the rank,
    chunk and element, and whose values it holds."""
    line = graded_with(tmp_path, "ring-allreduce", "        mine += got\n",
                       "        mine[:-1] += got[:-1]  # the last element never summed\n")
    assert line.startswith("FAILED: test_the_ring_alone_chunk_by_chunk[4]: "), line
    assert "ring check: rank 0, chunk 0, element 4 holds the values of rank 3, not the sum of " \
        "all 4; first wrong send: rank 0, reduce-scatter step 2: sent chunk 3, but its element " \
        "16 holds the values of rank 0; the ring's holds the values of ranks 0, 3" in line, line


def test_everyone_sends_then_receives_is_a_deadlock_named_with_its_rank_and_call(tmp_path):
    """A ring whose ranks all Send before they Recv passes wherever MPI buffers small
    messages; the grader runs every exercise with synchronous sends (MPIPAR_SSEND=1), so it
    hangs, and the watchdog names a rank and the call it waits in within seconds."""
    right = (
        "        dp_comm.Sendrecv(send, right, got, left,\n"
        "                         what=f\"{what}: ring reduce-scatter step {k + 1}, chunk "
        "{(r - k) % p} \"\n"
        "                              f\"out, {(r - k - 1) % p} in\")\n")
    wrong = ("        dp_comm.Send(send, right)  # everyone sends, then receives\n"
             "        dp_comm.Recv(got, left)\n")
    line = graded_with(tmp_path, "ring-allreduce", right, wrong)
    assert line.startswith("FAILED: test_the_ring_alone_chunk_by_chunk[4]: "), line
    assert "deadlock: [rank " in line, line
    assert "watchdog: waited" in line and "in Send" in line, line


def test_a_row_parallel_bias_added_on_every_rank_is_named_by_the_layer_test(tmp_path):
    """The bias added before g's sum (t times over): the layer's own check against its dense
    twin runs first and names the layer, not the embedding a whole model's run would blame."""
    line = graded_with(tmp_path, "row-parallel",
                       "        y = self.g.forward(x @ self.W.data)  # (..., d_out), summed "
                       "over the ranks\n        if self.has_bias:\n            y += self.b.data\n",
                       "        y = x @ self.W.data\n        if self.has_bias:\n"
                       "            y = y + self.b.data  # on every rank, then summed\n"
                       "        y = self.g.forward(y)\n")
    assert line.startswith("FAILED: test_each_layer_matches_its_dense_twin[2]: "), line
    assert "RowParallelLinear" in line, line


def test_a_dispatch_that_reads_the_arrivals_in_the_wrong_order_is_caught(tmp_path):
    """The reference dispatch with each expert's rows looked up expert by expert over all the
    sources, instead of source by source: with 2 experts a rank its experts run on each
    other's tokens (with 1 a rank the two orders coincide, so the exercise runs 2)."""
    right = ("        starts = np.cumsum(got.ravel()) - got.ravel()  # source-major, then expert\n"
             "        starts = starts.reshape(got.shape)\n")
    wrong = "        starts = (np.cumsum(got.T.ravel()) - got.T.ravel()).reshape(got.T.shape).T\n"
    line = graded_with(tmp_path, "dispatch", right, wrong)
    assert line.startswith("FAILED: first mismatching parameter "), line


def test_a_merge_that_overflows_is_caught_by_its_test(tmp_path):
    """The log-sum-exp of a merge taken without the maximum first: the runs' logits are small,
    so it trains as the serial model does, but at logits of 1e4 exp overflows: the exercise's
    test names it."""
    right = "    new = top + B.xp.log(B.xp.exp(lse - top) + B.xp.exp(block_lse - top))\n"
    wrong = "    new = B.xp.log(B.xp.exp(lse) + B.xp.exp(block_lse))\n"
    line = graded_with(tmp_path, "online-softmax", right, wrong)
    assert line.startswith("FAILED: test_the_merge_of_blocks_is_the_softmax_over_their_union"), \
        line


def test_each_exercise_is_graded_on_its_own(tmp_path):
    """The row-parallel Linear calls g: written while g is still a stub, it passes (graded with
    the reference's g), and g's own line still says that g is not written."""
    copy, path = tmp_path / "copy", "mpipar/parts/tp_layers.py"
    student.make(copy)
    source = student.restore_source((copy / path).read_text(), (ROOT / path).read_text(),
                                    student.find("row-parallel").functions)
    assert "exercise g-forward (part of tp-mlp):" in source and "exercise row-parallel" not in \
        source
    (copy / path).write_text(source)
    proc, lines = grade(copy, "row-parallel", "g-forward", "tp-mlp")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert lines == {"row-parallel": "passed",  # the MLP block, of which it is part, is not
                     "g-forward": "FAILED: not written yet (NotImplementedError)",
                     "tp-mlp": "FAILED: not written yet (NotImplementedError)"}, proc.stdout


def test_a_function_of_several_exercises_is_restored_once():
    """RowParallelLinear.forward is part of row-parallel and of tp-mlp: grading f-backward
    restores it once from the reference (twice, the second span would cut the file)."""
    path = "mpipar/parts/tp_layers.py"
    reference = (ROOT / path).read_text()
    stubbed = student.stub_source(reference, ["RowParallelLinear.forward", "CopyToTP.forward"],
                                  "exercise: write it")
    assert student.restore_source(stubbed, reference, ["CopyToTP.forward",
                                                       "RowParallelLinear.forward"]) == reference


def test_the_seed_without_step_5_is_caught(tmp_path):
    """The master updates, but never broadcasts the new parameters: the workers compute the
    second step's gradients on the first step's model, and rank 0's parameters leave the
    serial ones."""
    line = graded_with(tmp_path, "seed-dp",
                       "            bcast_params(dp_comm, self.params, self.flat, root=0)\n"
                       "        return self.global_loss(loss)\n",
                       "            pass  # Step 5 forgotten\n"
                       "        return self.global_loss(loss)\n")
    assert line.startswith("FAILED: first mismatching parameter "), line


@pytest.mark.parametrize("wrong, said", [
    ("            unflatten(self.flat_sum / dp_comm.size, [p.grad for p in self.params])\n"
     "            self.opt.step()\n",
     "; they moved 1/3 as far as the serial ones (0.352 of the way): a sum taken as a mean "
     "somewhere?"),
    ("            unflatten(self.flat_sum, [p.grad for p in self.params])\n",
     "; the parameters never changed: no update reached them"),
])
def test_the_seed_s_usual_slips_are_named_by_how_far_the_parameters_moved(tmp_path, wrong, said):
    """The sum divided by P (a mean: plain SGD then moves 1/P as far), and a master that
    never steps its optimizer (nothing moves): the mismatch says which."""
    line = graded_with(tmp_path, "seed-dp",
                       "            unflatten(self.flat_sum, [p.grad for p in self.params])\n"
                       "            self.opt.step()\n", wrong)
    assert line.startswith("FAILED: first mismatching parameter ") and line.endswith(said), line
    quoted = re.search(r"(they moved .* way\)|the parameters never changed)", said)[0]
    assert f'"{quoted}' in solution("03-data-parallel.md"), quoted  # as the solution quotes it


def test_zero1_with_copies_where_views_belong_never_changes_the_model(tmp_path):
    """Each parameter a copy of its slice of the flat buffer, not a view: the shard is updated
    and allgathered into the flat buffer, which the model never reads."""
    line = graded_with(tmp_path, "zero1-shards",
                       "            p.data = self.flat[start:start + p.size].reshape(p.shape)  "
                       "# views: no copy\n",
                       "            p.data = self.flat[start:start + p.size].reshape(p.shape)"
                       ".copy()\n")
    assert line.startswith("FAILED: first mismatching parameter ") and line.endswith(
        "; the parameters never changed: no update reached them"), line


def test_a_1f1b_backward_before_its_forward_is_named_by_the_simulation(tmp_path):
    """Each steady-state pair written B then F: the simulation of the smallest case names the
    stage and the instruction, before any exact list is compared."""
    line = graded_with(tmp_path, "1f1b",
                       "    for i in range(n_micro - warmup):  # steady state: micro-batch "
                       "warmup+i in, micro-batch i out\n"
                       "        out += _forward(n_stages, stage, warmup + i) + "
                       "_backward(n_stages, stage, i)\n",
                       "    for i in range(n_micro - warmup):\n"
                       "        out += _backward(n_stages, stage, i) + "
                       "_forward(n_stages, stage, warmup + i)\n")
    assert line == ("FAILED: test_1f1b_runs_for_every_p_and_m_and_keeps_its_stash: p = 1, m = 1: "
                    "stage 0: B0 before its forward or its output's gradient (or twice)"), line
    assert line.split(": ", 2)[2] in solution("05-pipeline-parallel.md")  # as quoted there


def test_an_mlp_block_whose_g_sums_its_gradient_too_is_named_by_the_layer_test(tmp_path):
    """g's backward written as an Allreduce (f's): every gradient before it is t times the
    serial one; the layer test against the dense twin names it before any training."""
    line = graded_with(tmp_path, "tp-mlp", "    def backward(self, dy):\n        return dy\n",
                       "    def backward(self, dy):\n        return allreduce(self.tp_comm, dy)\n")
    assert line.startswith("FAILED: test_each_layer_matches_its_dense_twin[2]: "), line


def test_bad_input(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit, match="not empty"):
        student.make(tmp_path)
    with pytest.raises(SystemExit, match="not a copy made by"):
        student.grade(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="no exercise 'ring'"):
        student.grade(ROOT, ["ring"])


def test_an_exercise_that_exits_fails_and_grading_goes_on(tmp_path):
    """sys.exit(0) in an exercise ended its training run with exit code 0 and no parameters
    saved, and the grader died in a FileNotFoundError traceback: now that exercise fails with
    a line that says it exited, the next one is still graded, and the exit code counts both."""
    copy, path = tmp_path / "copy", "mpipar/data_parallel.py"
    student.make(copy)
    source = (copy / path).read_text()
    stub = source.index("raise NotImplementedError(", source.index("def ring_allreduce("))
    (copy / path).write_text(source[:stub] + "import sys\n    sys.exit(0)\n    " + source[stub:])
    proc, lines = grade(copy, "ring-allreduce", "f-backward")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr
    assert lines == {"ring-allreduce": "FAILED: test_the_ring_alone_chunk_by_chunk[4]: "
                                       "exited early (exit code 0 before the "
                                       "check's verdict): exercise code must return, not call "
                                       "sys.exit()",
                     "f-backward": "FAILED: not written yet (NotImplementedError)"}, proc.stdout


@pytest.mark.parametrize("output", [
    "INTERNALERROR> Traceback (most recent call last):\nINTERNALERROR> SystemExit: 0\n",
    "FAILED tests/test_schedules.py::test_exact - SystemExit: 0\n1 failed in 0.1s\n",
])
def test_a_test_run_ended_by_sys_exit_says_so(output):
    """pytest reports a sys.exit() in the code it tests as an INTERNALERROR (at import) or as
    a failed test; either is named as the exit, in one line."""
    proc = subprocess.CompletedProcess([], 1, output, "")
    assert student.why(proc) == ("exited early (SystemExit: 0): exercise code must return, not "
                                 "call sys.exit()")


def make_refused(target):
    """``python -m mpipar.tools.student make TARGET``, which must refuse: its one-line error."""
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.student", "make", str(target)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and proc.stdout == "", proc
    assert "Traceback" not in proc.stderr and "\n" not in proc.stderr.strip(), proc.stderr
    return proc.stderr.strip()


def test_make_refuses_a_place_it_cannot_write_before_writing_anything(tmp_path):
    """A regular file once died in NotADirectoryError, a read-only folder in a PermissionError
    half-way through the copy."""
    (tmp_path / "a-file").write_text("kept")
    assert make_refused(tmp_path / "a-file") == \
        f"error: cannot make the copy: {tmp_path / 'a-file'} is a file, not a folder"
    assert make_refused(tmp_path / "a-file" / "copy") == \
        f"error: cannot make the copy: {tmp_path / 'a-file'} is a file, not a folder"
    assert (tmp_path / "a-file").read_text() == "kept"
    read_only = read_only_folder(tmp_path)
    if read_only is None:
        pytest.skip("no folder here that this process cannot write in")
    assert make_refused(read_only / "copy").startswith(
        f"error: cannot make the copy: cannot write in {read_only} (")
    assert not (read_only / "copy").exists()


@pytest.mark.parametrize("existed", [False, True])
def test_make_that_fails_half_way_leaves_nothing(existed, tmp_path, monkeypatch):
    """A copy cut short (here a full disk after the first file) is removed again; an empty
    folder that was given stays, empty."""
    target = tmp_path / "copy"
    if existed:
        target.mkdir()

    def copy_then_fail(source, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "setup.cfg").write_text("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(student, "copy_project", copy_then_fail)
    with pytest.raises(SystemExit) as exit_info:
        student.make(target)
    message = str(exit_info.value.code)
    assert message.startswith(f"error: could not write the copy in {target}, so nothing is left")
    assert "No space left on device" in message and "\n" not in message
    assert (sorted(target.iterdir()) == []) if existed else not target.exists()


def test_a_receive_buffer_of_the_wrong_size_is_named_with_both_sizes(tmp_path):
    """Each reduce-scatter step receives into a buffer one element short: MPI's own error would
    say only "Message truncated"; the grade line shows the rank's exception, with the call, the
    source and the bytes the buffer expects, not a bare "[rank N] Traceback"."""
    line = graded_with(tmp_path, "ring-allreduce", "        got = incoming[:mine.size]\n",
                       "        got = incoming[:mine.size - 1]  # one element short\n")
    assert line.startswith("FAILED: test_the_ring_alone_chunk_by_chunk[4]: ValueError: Sendrecv "
                           "from "), line
    assert "got a message longer than the" in line and "bytes its buffer expects" in line, line
    assert "Traceback" not in line, line
