"""The emulated cluster (mpipar.tools.cluster): every scheme trains across emulated hosts exactly as
the serial trainer does; a hybrid's tensor-parallel groups stay inside a host while data or pipeline
parallelism crosses the link; the link is real (latency above shared memory's, a 100 Mbit/s limit
that a 1 MiB message feels); bad input is refused with exit code 2; and no namespace or link
outlives a run: not after a normal end, a refusal, SIGTERM or SIGINT, and not after a SIGKILL (the
next start removes what was left).

Tests that need namespaces skip, with the reason, where they cannot be made (not root, no
``ip``); a missing mpirun is an error, as everywhere in the suite.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import MPI_SCRIPTS, ROOT, assert_matches_serial, find_mpirun

from mpipar.tools import cluster
from mpipar.tools.bench import link

REASON = cluster.unavailable()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"cannot emulate hosts: {REASON}")

MLP = ["--model", "mlp", "--data", "synthetic", "--samples", "256", "--sizes", "64,16,16,10",
       "--batch-size", "16", "--steps", "3", "--dtype", "float64", "--quiet"]  # no sklearn import
TINY_GPT = ["--model", "gpt", "--d-model", "8", "--n-heads", "2", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "8", "--steps", "3", "--dtype", "float64",
            "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def cluster_command(command, hosts=2, bandwidth="none"):
    return [sys.executable, "-m", "mpipar.tools.cluster", "--hosts", str(hosts), "--bandwidth",
            bandwidth, *map(str, command)]


def on_cluster(command, hosts=2, bandwidth="none", timeout=90, check=True):
    """Run ``python -m mpipar.tools.cluster ... COMMAND``; the CompletedProcess."""
    find_mpirun()  # a missing mpirun is an error, not a skip
    cmd = cluster_command(command, hosts, bandwidth)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock? `{' '.join(cmd)}` did not finish in {timeout} s")
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr\n{proc.stderr}")
    return proc


@pytest.fixture
def leaves_nothing():
    """After the test: no namespace, no link, no run folder of the cluster's."""
    yield
    assert cluster.namespaces() == [] and cluster.links() == [], \
        (cluster.namespaces(), cluster.links())
    assert not cluster.RUN_DIR.exists()


def mpirun_n(n, *program):
    return ["mpirun", "-n", str(n), sys.executable, *program]


# ----------------------------------------------------------------------------- every scheme
SCHEMES = {
    "dp master": (4, ["-m", "mpipar.data_parallel", "--sync", "master"], MLP),
    "dp ring": (4, ["-m", "mpipar.data_parallel", "--sync", "ring", "--micro-batches", "2"], MLP),
    "dp allreduce, buckets, overlap": (4, ["-m", "mpipar.data_parallel", "--sync", "allreduce",
                                           "--bucket-mb", "0.002", "--overlap"], MLP),
    "tensor parallel": (2, ["-m", "mpipar.tensor_parallel"], TINY_GPT),
    "pipeline 1f1b": (4, ["-m", "mpipar.pipeline", "--micro-batches", "4", "--timeline",
                          "none"], MLP),
    "hybrid tp in a host, dp across": (4, ["-m", "mpipar.hybrid", "--dp", "2", "--tp", "2"],
                                       TINY_GPT),
    "hybrid tp in a host, pp across": (4, ["-m", "mpipar.hybrid", "--pp", "2", "--tp", "2",
                                           "--micro-batches", "2"], TINY_GPT),
}


@needs_hosts
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_across_hosts_equals_serial(scheme, tmp_path, capsys, leaves_nothing):
    n, program, flags = SCHEMES[scheme]
    saved = tmp_path / "params.npz"
    bandwidth = "1gbit" if "hybrid" in scheme else "none"  # the token bucket changes nothing
    out = on_cluster(mpirun_n(n, *program, *flags, "--save-params", saved),
                     bandwidth=bandwidth).stdout
    assert out.startswith("emulated cluster: node0 10.77.0.1, node1 10.77.0.2"), out
    assert_matches_serial(out, flags, saved, tmp_path, capsys)


@needs_hosts
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 1), (1, 2, 2)])
def test_hybrid_keeps_tensor_parallel_groups_inside_a_host(dp, tp, pp, leaves_nothing):
    out = on_cluster(mpirun_n(4, MPI_SCRIPTS / "cluster_layout.py", dp, tp, pp)).stdout
    assert "ranks on ['node0', 'node0', 'node1', 'node1']" in out, out


@needs_hosts
def test_a_layout_that_splits_a_tensor_parallel_group_is_caught(leaves_nothing):
    """The check above can fail: tp 4 on 2 hosts puts one group on both."""
    proc = on_cluster(mpirun_n(4, MPI_SCRIPTS / "cluster_layout.py", 1, 4, 1), check=False)
    assert proc.returncode != 0 and "tp group on hosts" in proc.stderr


# ----------------------------------------------------------------------------- the link
@needs_hosts
def test_the_link_is_real(leaves_nothing):
    """At 100 Mbit/s a 1 MiB message between hosts takes at least about 8 * 2**20 / 100e6 s
    (84 ms), while within a host it takes a few ms at most; the least time of the round trips
    is compared. (Small-message latency is not compared: with 4 ranks on 2 cores a same-host
    8-byte round trip waits for a sleeping rank to wake, and read 9.7 us against 8.0 us across
    hosts in one clean-clone run.)"""
    out = on_cluster(mpirun_n(4, "-m", "mpipar.tools.bench.link", "--pingpong", "--repeats", "3"),
                     bandwidth="100mbit").stdout
    pairs = link.read_pairs(out)
    same, across = pairs["same host"], pairs["across hosts"]
    assert across["1 MiB least"] >= 0.9 * 8 * 2**20 / 100e6, out
    assert across["4 MiB least"] >= 0.9 * 8 * 2**22 / 100e6, out  # beta's message
    assert same["1 MiB least"] < 0.02, out
    assert "link: 100 Mbit/s" in out


def test_rates_read_as_tc_writes_them():
    assert cluster.parse_rate("1gbit") == 10**9
    assert cluster.parse_rate("100mbit") == 10**8
    assert cluster.parse_rate("2.5Gbit") == 25 * 10**8
    assert cluster.parse_rate("none") is None
    assert cluster.format_rate(10**9) == "1 Gbit/s" and cluster.format_rate(2.5e8) == "250 Mbit/s"
    assert cluster.burst_bytes(10**9) == 125000 and cluster.burst_bytes(10**8) == 16384


def test_link_prediction_is_the_ring_formula():
    """bench link's prediction, fed numbers: compute + 2(p-1) alpha + 2(p-1)/p n beta after the
    backward; with overlap, buckets queue on the link from when each is posted and only what
    is left after the backward ends counts."""
    alpha, beta = 1e-4, 1e-8  # 100 us, 100 MB/s
    one = link.predict_step(0.2, [(0.0, 8_000_000)], alpha, beta)
    assert one == pytest.approx(0.2 + 2 * alpha + 8_000_000 * beta)  # 0.2802 s
    assert link.predict_step(0.2, [(0.0, 8_000_000)], alpha, beta, p=4) == pytest.approx(
        0.2 + 6 * alpha + 1.5 * 8_000_000 * beta)
    # buckets of 4 MB posted at 50 and 140 ms, backward ends at 150 ms: the first is done at
    # 50 + 40.2 ms, the second waits for its posting (140 ms) and is done at 180.2 ms
    overlap = link.predict_step(0.2, [(0.05, 4_000_000), (0.14, 4_000_000)], alpha, beta, 0.15)
    assert overlap == pytest.approx(0.2 + 0.1802 - 0.15)
    # a slow link: the second bucket queues behind the first (50 + 2 x 400.2 ms)
    slow = link.predict_step(0.2, [(0.05, 4_000_000), (0.14, 4_000_000)], alpha, 1e-7, 0.15)
    assert slow == pytest.approx(0.2 + 0.05 + 2 * 0.4002 - 0.15)
    # a fast link: all is done before the backward ends, nothing is exposed
    assert link.predict_step(0.2, [(0.05, 4_000_000)], alpha, 1e-9, 0.15) == 0.2


def test_link_predictions_of_the_other_schemes():
    """bench link's other predictions, fed numbers: master = compute + 2 lg p (alpha + n beta)
    (a Reduce and a Bcast through one root), the hand-written ring = the ring formula; tensor
    parallelism = compute + each traced Allreduce at the ring formula; the pipeline = the
    1F1B replay with alpha + n beta per message, plus the messages past the micro-batches'."""
    from mpipar.tools.report_link import outlasts_bits

    alpha, beta, n = 1e-4, 1e-8, 8_000_000
    assert link.predict_sync(0.2, n, "master", alpha, beta) == pytest.approx(
        0.2 + 2 * (alpha + n * beta))
    assert link.predict_sync(0.2, n, "master", alpha, beta, p=4) == pytest.approx(
        0.2 + 4 * (alpha + n * beta))
    assert link.predict_sync(0.2, n, "ring", alpha, beta) == pytest.approx(
        0.2 + 2 * alpha + n * beta)
    calls = [("Allreduce", 2**20)] * 10 + [("Allreduce", 4096)] * 3
    assert link.predict_tp(0.1, calls, alpha, beta) == pytest.approx(
        0.1 + 10 * (2 * alpha + 2**20 * beta) + 3 * (2 * alpha + 4096 * beta))
    with pytest.raises(ValueError, match="Allgather"):
        link.predict_tp(0.1, calls + [("Allgather", 8)], alpha, beta)
    # one micro-batch: F on stage 0, its 2 messages, F and B on stage 1, 2 messages back, B on
    # stage 0; then the loss's 8 B message
    one = [("Send", 80), ("Send", 1000)]
    pp = link.predict_pp(0.005, [0.01, 0.01], [0.02, 0.02], 1, [one, one + [("Send", 8)]],
                         1e-3, 1e-6)
    assert pp == pytest.approx(0.005 + 2 * 0.03 + 2 * (2e-3 + 1080e-6) + 1e-3 + 8e-6)
    # four micro-batches, free messages: (m + p - 1)(F + B); on a link, 4 crossings of
    # 1.08 ms lie on 1F1B's critical path at p = 2
    four = [one * 4, one * 4 + [("Send", 8)]]
    assert link.predict_pp(0.0, [0.01] * 2, [0.02] * 2, 4, four, 0.0, 0.0) == pytest.approx(0.15)
    assert link.predict_pp(0.0, [0.01] * 2, [0.02] * 2, 4, four, 0.0, 1e-6) == pytest.approx(
        0.15 + 4 * 1080e-6 + 8e-6)
    # the rate below which communication a + b/R outlasts the compute C: R = b / (C - a)
    rows = [{"kind": "scheme", "mode": "x", "bandwidth": rate, "compute_seconds": "0.1",
             "predicted_seconds": str(0.1 + 0.01 + 8e6 / bits)}
            for rate, bits in (("none", float("inf")), ("1gbit", 1e9), ("100mbit", 1e8))]
    assert outlasts_bits(rows, "x") == pytest.approx(8e6 / 0.09)


# ----------------------------------------------------------------------------- bad input
BAD = {
    "a bandwidth that is no rate": (["--bandwidth", "fast"], 4, "'fast' is not a rate"),
    "megabytes, not bits": (["--bandwidth", "100mbps"], 4, "'100mbps' is not a rate"),
    "a zero rate": (["--bandwidth", "0gbit"], 4, "is not a rate"),
    "one host": (["--hosts", "1"], 4, "a cluster has 2 to 64 hosts"),
    "ranks not divisible over hosts": (["--hosts", "2"], 3, "3 ranks cannot be spread evenly"),
    "fewer ranks than hosts": (["--hosts", "4"], 2, "2 ranks cannot be spread evenly"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused(case):
    """Refused before anything is built, so this needs no root: one line, exit code 2."""
    flags, n, message = BAD[case]
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.cluster", *flags, "mpirun", "-n",
                           str(n), "hostname"], capture_output=True, text=True, timeout=30,
                          env=ENV, cwd=ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# MPIPAR_CLUSTER as a hand or a bug might set it: (value, what the refusal says is wrong)
BAD_SPECS = [
    ("node0,node1", "is not JSON (Expecting value)"),
    ('{"hosts": ["node0"]', "is not JSON"),
    ('["node0", "node1"]', "is JSON but not an object"),
    ("1000000000", "is JSON but not an object"),
    ('{"bandwidth": null}', 'has no "hosts" list of host names'),
    ('{"hosts": [], "bandwidth": null}', 'has "hosts": [], not a list of one or more host'),
    ('{"hosts": "node0 node1", "bandwidth": null}', 'has "hosts": "node0 node1", not a list'),
    ('{"hosts": ["node0", 1], "bandwidth": null}', 'has "hosts": ["node0", 1], not a list'),
    ('{"hosts": ["node0", "node1"]}', 'has no "bandwidth"'),
    ('{"hosts": ["node0", "node1"], "bandwidth": "1gbit"}',
     'has "bandwidth": "1gbit", not bits per second (> 0) or null'),
    ('{"hosts": ["node0", "node1"], "bandwidth": -5}', 'has "bandwidth": -5, not bits per'),
    ('{"hosts": ["node0", "node1"], "bandwidth": true}', 'has "bandwidth": true, not bits per'),
]
READERS = {  # every command that reads MPIPAR_CLUSTER, run outside a cluster (no root needed)
    "the cluster's mpirun": ["-m", "mpipar.tools.cluster", "--as-mpirun", "-n", "2", "hostname"],
    "bench link --pingpong": ["-m", "mpipar.tools.bench", "link", "--pingpong", "--repeats", "1"],
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("value, says", BAD_SPECS)
def test_a_malformed_cluster_variable_is_refused_in_one_line(reader, value, says):
    """A value that is not the JSON object Cluster.env writes once died in a JSONDecodeError,
    KeyError or TypeError traceback (on every rank of the ping-pong): now one line names the
    variable, its value and what is wrong, with exit code 2."""
    proc = subprocess.run([sys.executable, *READERS[reader]], capture_output=True, text=True,
                          timeout=60, env=dict(ENV, MPIPAR_CLUSTER=value), cwd=ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "\n" not in proc.stderr.strip(), proc.stderr
    assert proc.stderr.startswith(f"error: MPIPAR_CLUSTER={value!r} {says}"), proc.stderr
    assert proc.stdout == ""


def test_a_malformed_cluster_variable_is_refused_before_a_cluster_is_built(monkeypatch, capsys):
    """Cluster() reads the variable (set: an outer cluster) before it takes the lock."""
    monkeypatch.setenv("MPIPAR_CLUSTER", "{")
    monkeypatch.setattr(cluster, "take_lock", lambda: pytest.fail("took the cluster's lock"))
    with pytest.raises(SystemExit) as exit_info:
        cluster.Cluster(2).__enter__()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: MPIPAR_CLUSTER='{' is not JSON")
    monkeypatch.setenv("MPIPAR_CLUSTER", '{"hosts": ["node0", "node1"], "bandwidth": null}')
    assert cluster.spec_from_env() == {"hosts": ["node0", "node1"], "bandwidth": None}
    monkeypatch.setenv("MPIPAR_CLUSTER", "")
    assert cluster.spec_from_env() is None


@needs_hosts
def test_an_mpirun_inside_a_script_is_checked_too(leaves_nothing):
    """The mpirun on the command's PATH refuses an uneven -n itself; its code comes back."""
    proc = on_cluster(["sh", "-c", "mpirun -n 3 hostname"], check=False)
    assert proc.returncode == 2 and "3 ranks cannot be spread evenly" in proc.stderr


# ----------------------------------------------------------------------------- cleaning up
def rank_pids():
    """pids of the processes inside the emulated hosts (hydra's proxies and the ranks)."""
    return {int(pid) for ns in cluster.namespaces()
            for pid in cluster.sh("ip", "netns", "pids", ns, check=False).split()}


def start_long_run(tmp_path):
    """A cluster whose 2 ranks train for a long time; returns it once both ranks are up. Its
    output goes to a file: a pipe would stay open in whatever a SIGKILL leaves running."""
    find_mpirun()
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cluster_command(mpirun_n(2, "-m", "mpipar.data_parallel",
                                                         "--steps", "1000000", "--quiet")),
                                stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    deadline = time.time() + 30
    while len(rank_pids()) < 4:  # 2 proxies, 2 ranks
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the ranks did not start:\n{(tmp_path / 'out.txt').read_text()}")
        time.sleep(0.2)
    time.sleep(2)  # the ranks are inside MPI_Init or training now
    return proc, rank_pids()


def alive(pids):
    """The pids still running (a zombie has ended; only its parent has not read its code yet)."""
    def running(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    return {pid for pid in pids if running(pid)}


@needs_hosts
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_run_and_removes_the_hosts(sig, tmp_path, leaves_nothing):
    proc, pids = start_long_run(tmp_path)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the cluster did not end within 20 s of {sig.name}")
    assert proc.returncode == 128 + sig
    assert not alive(pids)


@needs_hosts
def test_the_next_start_removes_what_a_killed_run_left(tmp_path, leaves_nothing):
    proc, pids = start_long_run(tmp_path)
    proc.kill()  # SIGKILL: no clean-up of its own
    proc.wait()
    pids |= cluster.leftovers()  # with its mpiexec, an orphan on the launching node now
    assert cluster.namespaces() and cluster.links() and alive(pids)  # all left behind
    out = on_cluster(mpirun_n(2, "-c", "from mpi4py import MPI; "
                                       "print(MPI.Get_processor_name())")).stdout
    assert "node0" in out.split("\n", 1)[1] and "node1" in out, out
    deadline = time.time() + 10
    while alive(pids) and time.time() < deadline:  # killed by pid, reaped by their parents
        time.sleep(0.1)
    assert not alive(pids)
