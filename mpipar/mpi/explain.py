"""What ``--explain`` prints: one line per MPI call and one per seed step, on every rank.

:mod:`mpipar.mpi.comm` calls these only while its ``EXPLAIN`` flag is on (the runner sets it for
the first step), so a call that is not narrated formats no string at all. Each line is one
write, prefixed by the world rank (and, for a call, the rank in its group):

    [rank 1, dp 1] Reduce         all -> root 0                       8.6 KiB    0.052 ms  (...)
    [rank 1] DP Step 4: Reduce(SUM) of 2,186 gradient values ...
"""

import sys

from mpi4py import MPI


def fmt_bytes(n):
    """A byte count in binary units, as every size mpipar prints: 8 B, 8.6 KiB (8,806 bytes:
    KiB = 1,024 bytes), 1.0 MiB (1,048,576). Rates stay decimal: Gbit/s, GB/s."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def about(what):
    return f"  ({what})" if what else ""


def say(line):
    """One write per line, so that lines of ranks printing at once never merge mid-line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def call_line(comm, text):
    """``text`` prefixed by the world rank and the rank in ``comm``'s group."""
    say(f"[rank {MPI.COMM_WORLD.Get_rank()}, {comm.name} {comm.rank}] {text}")


def completed(comm, op, detail, nbytes, seconds, what):
    """A call that has completed: what, with whom, how many bytes, how long it took."""
    call_line(comm, f"{op:<14} {detail:<34} {fmt_bytes(nbytes):>10}  {seconds * 1e3:7.3f} ms"
                    f"{about(what)}")


def posted(comm, op, detail, nbytes, what):
    """A non-blocking call when it is posted (it completes later, and says so then)."""
    call_line(comm, f"{op + ' posted':<14} {detail:<34} {fmt_bytes(nbytes):>10}{about(what)}")


def step(text):
    """A line about the seed step being run, prefixed by the world rank."""
    say(f"[rank {MPI.COMM_WORLD.Get_rank()}] {text}")
