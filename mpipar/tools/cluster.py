"""An emulated cluster on one machine: hosts as Linux network namespaces on a bridge, each with
its own address and hostname, the link limited by a token bucket, and the project's own
mpiexec (MPICH's hydra) starting every rank inside its host.

    sudo python -m mpipar.tools.cluster --hosts 2 --bandwidth 1gbit \\
        mpirun -n 4 python -m mpipar.data_parallel --sync allreduce

Everywhere else in mpipar a message moves through shared memory. Here a message between
hosts crosses a TCP connection, a virtual cable and a queue that lets through at most RATE
bits per second, as on a real network; ranks on one host still share memory.

1. Hosts: ``ip netns add mpipar-node<i>``, one veth pair per host (``eth0`` inside, its peer
   ``mpipar-node<i>`` on the bridge ``mpipar-br`` outside), address 10.77.0.<i+1>/24. The
   bridge holds 10.77.0.254: the launching node, where COMMAND and mpiexec run.
2. The link: a token-bucket filter, ``tc qdisc add dev D root tbf rate R burst B latency
   50ms``, on both ends of every veth, so a host sends and receives at most R, like a network
   card on a switch. The burst B is 1 ms of traffic (at least 16 KiB): smaller buckets lose
   tokens whenever a busy machine runs the queue's timer late (at 1 Gbit/s a 0.5 ms bucket
   gave half the rate under load), larger ones let more of a message through at once.
3. Launching: COMMAND runs with this module's ``mpirun``/``mpiexec`` first on its PATH
   (:func:`mpiexec_line`): hydra with a host file, ``-ppn N/hosts`` (blocks of ranks per host,
   so neighbouring ranks, a tensor-parallel group, share a host, mpipar/mpi/grid.py),
   ``-localhost`` the bridge's address (where hydra's proxies call back), and ``-launcher ssh
   -launcher-exec LAUNCH``: hydra calls LAUNCH as it would call ssh, and LAUNCH starts the
   proxy inside the host with ``ip netns exec`` and ``unshare --uts`` (its own hostname).
   ``UCX_TLS=tcp,self`` is set for every rank: without it UCX reaches a rank on another
   "host" through shared memory (the namespaces share /dev/shm) and the link is a fiction.
4. Cleaning up: the namespaces, links and run folder go on exit, on error and on
   SIGTERM/SIGINT/SIGHUP (sent on to COMMAND first). What a killed run (SIGKILL) left behind,
   its hosts and its processes (the ones inside a host, and those with MPIPAR_CLUSTER in
   their environment), goes at the next start, which holds a lock: one cluster at a time.

The emulated hosts share this machine's cores: with more ranks than cores every rank waits
sleeping (``MPIPAR_WAIT=sleep`` unless set), as mpipar.mpi.comm does when ranks outnumber cores.
Left out: delay and loss on the link (they need the netem qdisc); names that resolve
(``/etc/netns/<ns>/hosts``); cores and memory of a host's own (cgroups, ``taskset``).
"""

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

PREFIX = "mpipar-"  # every namespace and link this module makes; anything so named is its own
BRIDGE = PREFIX + "br"
SUBNET = "10.77.0"  # host i is SUBNET.(i+1), a private range: change it if a network here uses it
LAUNCH_ADDRESS = f"{SUBNET}.254"
RUN_DIR = Path("/run/mpipar-cluster")  # the launcher, the mpirun wrapper and the host file
LOCK = Path("/run/mpipar-cluster.lock")
MAX_HOSTS = 64
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # as tc reads them
QUEUE_LATENCY = "50ms"  # tbf drops what would wait longer than this in the queue
STOP_GRACE = 5.0  # seconds COMMAND has to end after SIGTERM, before SIGKILL

# hydra's ssh launcher runs ``LAUNCH -x HOST 'COMMAND LINE'`` and ssh would hand the line to
# HOST's shell; here the line runs in HOST's network namespace, in a UTS namespace of its own
# that carries the host's name.
LAUNCH = """#!/bin/sh
[ "$1" = -x ] && shift
host=$1; shift
exec ip netns exec "{prefix}$host" unshare --uts \\
    sh -c 'hostname "$0" && eval "exec $1"' "$host" "$*"
"""
MPIRUN = """#!/bin/sh
exec {python} -m mpipar.tools.cluster --as-mpirun "$@"
"""


def refuse(message, code=2):
    """Bad input (code 2) or a machine that cannot do it (code 1): one line, then exit."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def parse_rate(text, flag="--bandwidth"):
    """A link rate as tc writes it, '1gbit', '100mbit', '2.5gbit', in bits per second; 'none'
    (no limit) gives None. Anything else is refused, naming ``flag``."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(bit|kbit|mbit|gbit|tbit)", text.strip().lower())
    if not m or float(m[1]) * UNITS[m[2]] < 8000:
        refuse(f"{flag} {text!r} is not a rate: write it as tc does, e.g. 1gbit, 100mbit, "
               "2.5gbit (bits per second, at least 8kbit; tc's mbps would be megabytes), or "
               "none for no limit")
    return int(float(m[1]) * UNITS[m[2]])


def spec_from_env(refuse=refuse):
    """The emulated cluster this process runs in, as :meth:`Cluster.env` wrote it into
    MPIPAR_CLUSTER: ``{"hosts": [names], "bandwidth": bits per second or null}``; None where
    it is unset or empty. Any other value (not JSON, not such an object) ends the process
    through ``refuse`` with one line that names the variable and what is wrong."""
    text = os.environ.get("MPIPAR_CLUSTER") or "null"
    try:
        spec = json.loads(text)
    except ValueError as err:
        spec, wrong = {}, f"is not JSON ({getattr(err, 'msg', err)})"
    else:
        if spec is None:
            return None
        wrong = spec_problem(spec)
    if wrong:
        refuse(f"MPIPAR_CLUSTER={text!r} {wrong}: `python -m mpipar.tools.cluster` sets it, e.g. "
               '{"hosts": ["node0", "node1"], "bandwidth": 1000000000}')
    return spec


def spec_problem(spec):
    """What is wrong with a cluster's description (MPIPAR_CLUSTER's JSON, read), or None."""
    if not isinstance(spec, dict):
        return "is JSON but not an object"
    hosts, bits = spec.get("hosts"), spec.get("bandwidth", "missing")
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts)):
        return 'has no "hosts" list of host names' if "hosts" not in spec else \
            f'has "hosts": {json.dumps(hosts)}, not a list of one or more host names'
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float))
                             or not 0 < bits < float("inf")):
        return 'has no "bandwidth"' if "bandwidth" not in spec else \
            f'has "bandwidth": {json.dumps(bits)}, not bits per second (> 0) or null (no limit)'
    return None


def format_rate(bits):
    """1e9 -> '1 Gbit/s', 2.5e8 -> '250 Mbit/s'; None -> 'no limit'."""
    if bits is None:
        return "no limit"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits} bit/s"


def burst_bytes(bits):
    """The token bucket's depth: 1 ms at the rate, and at least 16 KiB (ten full frames)."""
    return max(int(bits / 8 * 1e-3), 16384)


def unavailable():
    """Why this machine cannot emulate hosts (one sentence), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or with sudo)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (iproute2 and util-linux provide them)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    return None


def find_mpiexec():
    """The project's mpiexec (hydra, from the mpich wheel); its absence is an error."""
    for candidate in (Path(sys.executable).parent / "mpiexec", shutil.which("mpiexec")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    refuse("mpiexec not found: run `make install` (the mpich wheel provides it)", code=1)


def sh(*cmd, check=True):
    """Run one ip/tc command; its output, or a RuntimeError naming it when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


# ----------------------------------------------------------------------------- the hosts
def namespaces():
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines()
            if line.startswith(PREFIX)]


def links():
    """This module's links in the launching node's namespace: the bridge and the veths' outer
    ends ("5: mpipar-node0@if4: <...>": the name before the '@')."""
    names = [line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link", "show")
             .splitlines()]
    return [name for name in names if name.startswith(PREFIX)]


def leftovers():
    """pids of the processes of a run: those inside a host, and those anywhere whose environment
    names a cluster (COMMAND, its mpiexec, and all they started inherit MPIPAR_CLUSTER)."""
    pids = {int(pid) for ns in namespaces()
            for pid in sh("ip", "netns", "pids", ns, check=False).split()}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"\0MPIPAR_CLUSTER=" in b"\0" + (proc / "environ").read_bytes():
                pids.add(int(proc.name))
        except OSError:  # it ended meanwhile
            pass
    return pids - {os.getpid()}


def remove_all():
    """Remove every namespace, link and file of this module: this run's or a killed run's.
    The processes of a run still alive (a killed run's ranks and mpiexec) are killed first, by
    pid: an mpiexec whose proxies vanish with their link would wait for them forever."""
    for pid in leftovers():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
    for link in links():
        sh("ip", "link", "del", link, check=False)  # a veth takes its peer with it
    for ns in namespaces():
        sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(RUN_DIR, ignore_errors=True)


def tbf(bits):
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst_bytes(bits)),
            "latency", QUEUE_LATENCY]


def build(hosts, bits):
    """The bridge with the launching node's address, then per host a namespace, a veth pair
    onto the bridge, its address, and the token bucket on both ends."""
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{LAUNCH_ADDRESS}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for i, host in enumerate(hosts):
        ns = outer = PREFIX + host  # one namespace and one link name, in separate name spaces
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", outer, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if bits:
            sh("tc", "qdisc", "add", "dev", outer, "root", *tbf(bits))  # into the host
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf(bits))  # out of it


def write_files(hosts):
    """RUN_DIR: the launcher hydra calls instead of ssh, the host file, and ``mpirun`` and
    ``mpiexec`` that launch onto the hosts."""
    RUN_DIR.mkdir(parents=True)
    (RUN_DIR / "hosts").write_text("".join(f"{host}\n" for host in hosts))
    for name, text in (("launch", LAUNCH.format(prefix=PREFIX)),
                       ("mpirun", MPIRUN.format(python=sys.executable))):
        (RUN_DIR / name).write_text(text)
        (RUN_DIR / name).chmod(0o755)
    (RUN_DIR / "mpiexec").symlink_to("mpirun")


def take_lock():
    """One emulated cluster at a time: the names are fixed, and whatever they name when the
    lock is ours is a killed run's leftover. The kernel drops the lock of a dead process."""
    f = open(LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        sys.stderr.write(f"waiting for the emulated cluster of pid {f.read().strip()} to end\n")
        fcntl.flock(f, fcntl.LOCK_EX)
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class Cluster:
    """``with Cluster(2, parse_rate('1gbit')) as cluster:`` the hosts exist inside the block, and
    ``mpirun`` launches onto them in the environment ``cluster.env()``."""

    def __init__(self, n_hosts=2, bits=None):
        self.hosts = [f"node{i}" for i in range(n_hosts)]
        self.bits = bits

    def __enter__(self):
        if spec_from_env() is not None:  # the lock is the outer cluster's: wait forever
            refuse("already inside an emulated cluster: its mpirun launches onto its hosts")
        self.lock = take_lock()
        try:
            remove_all()
            build(self.hosts, self.bits)
            write_files(self.hosts)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        # a second Ctrl-C must not cut the removal short: signals wait until it is done
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM,
                                                            signal.SIGHUP})
        try:
            remove_all()
        finally:
            self.lock.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def env(self, base=None):
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{RUN_DIR}{os.pathsep}{env.get('PATH', '')}"
        env["MPIPAR_CLUSTER"] = json.dumps({"hosts": self.hosts, "bandwidth": self.bits})
        return env

    def describe(self):
        hosts = ", ".join(f"{host} {SUBNET}.{i + 1}" for i, host in enumerate(self.hosts))
        link = (f"{format_rate(self.bits)} per host (tbf, burst {burst_bytes(self.bits)} B)"
                if self.bits else "no limit")
        return f"emulated cluster: {hosts}; link: {link}; launching node {LAUNCH_ADDRESS}"


# ----------------------------------------------------------------------------- launching
def mpiexec_line(n_hosts, argv):
    """hydra's command line for ``mpirun ARGV`` (``-n N PROGRAM ...``) on the emulated hosts:
    N/hosts ranks on each, in blocks, every rank inside its host's namespace."""
    if len(argv) < 3 or argv[0] not in ("-n", "-np") or not argv[1].isdigit():
        refuse("on the emulated cluster write `mpirun -n N PROGRAM [ARGS...]` (-n first)")
    n = int(argv[1])
    if n < n_hosts or n % n_hosts:
        refuse(f"{n} ranks cannot be spread evenly over {n_hosts} hosts: use a multiple of "
               f"{n_hosts} for -n, or --hosts that divides {n}")
    env = ["-genv", "UCX_TLS", "tcp,self"]  # TCP between hosts (MPICH's shared memory within)
    if n > len(os.sched_getaffinity(0)) and not os.environ.get("MPIPAR_WAIT"):
        env += ["-genv", "MPIPAR_WAIT", "sleep"]  # the hosts share this machine's cores
    return [find_mpiexec(), "-launcher", "ssh", "-launcher-exec", str(RUN_DIR / "launch"),
            "-f", str(RUN_DIR / "hosts"), "-ppn", str(n // n_hosts),
            "-localhost", LAUNCH_ADDRESS, *env, "-n", str(n), *argv[2:]]


def stop(child, first=signal.SIGTERM):
    """End COMMAND and everything it started (its own process group): ``first`` (the signal
    this process got: mpiexec passes it on to every rank), then SIGKILL."""
    for sig in (first, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(STOP_GRACE)
            return
        except subprocess.TimeoutExpired:
            continue


class Interrupted(SystemExit):
    """SIGTERM, SIGINT or SIGHUP: exit code 128 + its number, after the clean-up."""

    def __init__(self, signum):
        super().__init__(128 + signum)
        self.signum = signum

    @classmethod
    def handler(cls, signum, frame):
        raise cls(signum)


def run(command, env):
    """Run COMMAND on the launching node in a process group of its own; return its exit code
    (128 + the number of the signal that ended it). A signal to this process is passed on to
    COMMAND, which is stopped before the hosts are removed."""
    child = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        code = child.wait()
    except Interrupted as stopped:
        stop(child, stopped.signum)
        raise
    finally:
        if child.poll() is None:
            stop(child)
    return 128 - code if code < 0 else code


def parser():
    ap = argparse.ArgumentParser(
        prog="python -m mpipar.tools.cluster",
        description="Emulate a cluster on this machine (network namespaces on a bridge, the "
                    "link limited by tc's token bucket) and run COMMAND on its launching node, "
                    "where `mpirun -n N ...` starts N/hosts ranks on every host. Needs root.",
        epilog="example: python -m mpipar.tools.cluster --hosts 2 --bandwidth 1gbit "
               "mpirun -n 4 python -m mpipar.data_parallel --sync allreduce")
    ap.error = lambda message: refuse(f"{message} (see --help)")
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts (2 to 64; default 2)")
    ap.add_argument("--bandwidth", default="none", metavar="RATE",
                    help="each host's link, as tc writes rates: 1gbit, 100mbit, ... (default "
                         "none: no limit, as fast as TCP between namespaces goes)")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="what to run, e.g. mpirun -n 4 python -m mpipar.pipeline")
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--as-mpirun"]:  # the mpirun on COMMAND's PATH: become hydra
        spec = spec_from_env()
        if spec is None:
            refuse("--as-mpirun runs only inside `python -m mpipar.tools.cluster`")
        line = mpiexec_line(len(spec["hosts"]), argv[1:])
        os.execv(line[0], line)
    a = parser().parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    bits = parse_rate(a.bandwidth)
    if not 2 <= a.hosts <= MAX_HOSTS:
        refuse(f"--hosts {a.hosts}: a cluster has 2 to {MAX_HOSTS} hosts")
    if not command:
        refuse("no command: give one to run, e.g. mpirun -n 4 python -m mpipar.data_parallel")
    if Path(command[0]).name in ("mpirun", "mpiexec"):  # by any path: the cluster's own
        mpiexec_line(a.hosts, command[1:])  # refuse a bad -n before building anything
        command = [str(RUN_DIR / "mpirun"), *command[1:]]
    reason = unavailable()
    if reason:
        refuse(f"cannot emulate hosts: {reason}", code=1)
    find_mpiexec()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, Interrupted.handler)
    with Cluster(a.hosts, bits) as cluster:
        print(cluster.describe(), flush=True)
        code = run(command, cluster.env())
    sys.exit(code)


if __name__ == "__main__":
    main()
