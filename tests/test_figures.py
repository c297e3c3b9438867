"""The course's pictures: each is drawn without error, the committed PNGs are current (the data
they draw hashes as in lessons/figures/data.json), and each draws what the code does: the
schedule grids cell for cell from schedules.simulate, the ring from ring_allreduce, the grid from
Grid's Splits, the basic collectives from stand-ins that give what MPI gives, the broadcast tree
from lesson 0's own bcast_tree. Also trace.gantt's notes, labels and legend."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from mpipar.mpi.grid import Grid
from mpipar.parts.schedules import bubble_formula, schedule, simulate, simulated_bubble
from mpipar.tools import figures
from mpipar.tools.figures import basics, collectives, context, experts, layouts
from mpipar.tools.figures import precision as precision_figure
from mpipar.tools.figures.draw import ThreadRanks, pyplot

COMMITTED = ROOT / "lessons" / "figures"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Every picture drawn by the command, into a scratch folder."""
    out = tmp_path_factory.mktemp("figures")
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.figures", "--out", str(out)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_every_picture_is_drawn(fresh):
    for name in figures.figures():
        png = fresh / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name}.png is not a PNG"


def test_committed_pictures_are_current(fresh):
    committed = json.loads((COMMITTED / "data.json").read_text())
    assert json.loads((fresh / "data.json").read_text()) == committed, \
        "a picture no longer shows what the code does: run `make figures`, commit lessons/figures"
    for name in committed:
        assert (COMMITTED / f"{name}.png").exists(), f"lessons/figures/{name}.png is missing"


def test_a_change_in_the_data_changes_its_hash():
    data = collectives.ring_run()
    before = figures.digest(data)
    data["sent"][0][0] += 1
    assert figures.digest(data) != before


@pytest.mark.parametrize("name,v", layouts.SCHEDULE_CASES)
def test_schedule_grid_is_the_simulated_instruction_list(name, v):
    p, m = 4, 4
    lists = schedule(name, p, m, v)
    timeline = simulate(lists, forward_cost=1 / v, backward_cost=2 / v)
    cells = layouts.schedule_cells(name, p, m, v)
    for s in range(p):
        computed = [i for i in lists[s] if i.code in ("F", "B", "W")]
        assert [(c[0], c[1], c[2]) for c in cells[s]] == \
            [(i.code, i.micro, i.chunk) for i in computed], f"{name} stage {s}: order"
        times = [(t0, t1) for i, t0, t1 in timeline[s] if i.code in ("F", "B", "W")]
        assert np.allclose([c[3:] for c in cells[s]], times, rtol=0, atol=1e-6), \
            f"{name} stage {s}: times"


def test_schedule_picture_bubbles():
    data = layouts.schedules_run()
    for name, v in layouts.SCHEDULE_CASES:
        timeline = simulate(schedule(name, 4, 4, v), forward_cost=1 / v, backward_cost=2 / v)
        assert data[name]["drawn_bubble"] == pytest.approx(simulated_bubble(timeline), abs=1e-6)
        assert data[name]["bubble"] == pytest.approx(bubble_formula(4, 4, name, v), abs=1e-6)


def test_ring_picture_follows_ring_allreduce():
    data = collectives.ring_run(p=4)
    p, holds, sent = data["p"], data["holds"], data["sent"]
    everyone = list(range(p))
    assert holds[0] == [[[r]] * p for r in range(p)]
    for r in range(p):  # after the reduce-scatter rank r holds the whole sum of chunk r + 1
        assert holds[p - 1][r][(r + 1) % p] == everyone
        assert sum(c == everyone for c in holds[p - 1][r]) == 1
    assert holds[-1] == [[everyone] * p for _ in range(p)]
    for k in range(p - 1):
        assert sent[k] == [(r - k) % p for r in range(p)]  # reduce-scatter: chunk r - k
        assert sent[p - 1 + k] == [(r + 1 - k) % p for r in range(p)]  # allgather: r + 1 - k
    assert data["elements_sent"] == [2 * (p - 1)] * p  # 2(P-1)/P of p elements


def test_cross_entropy_picture_matches_the_serial_loss():
    data = collectives.cross_entropy_run()
    assert [a["op"] for a in data["allreduces"]] == ["MAX", "SUM", "SUM"]
    assert data["loss"] == data["serial_loss"]
    owner = next(r for r, (a, b) in enumerate(data["ranges"]) if a <= data["target"] < b)
    target = data["allreduces"][1]["parts"]
    assert [r for r, x in enumerate(target) if x != 0] == [owner]
    assert data["allreduces"][0]["result"] == max(data["logits"])


def test_megatron_picture_covers_both_matrices():
    data = collectives.megatron_layout(t=2, h=8)
    for key in ("A_columns", "B_rows"):
        assert [x for a, b in data[key] for x in range(a, b)] == list(range(32)), key
    assert data["f"][0].startswith("forward: identity")
    assert data["g"][0].startswith("forward: Allreduce")


def test_grid_picture_groups_are_grids():
    layout = layouts.grid_layout(dp=2, tp=2, pp=2)
    for e in layout:
        assert e["rank"] == Grid.rank_of(e["dp"], e["pp"], e["tp"], (2, 2, 2))
    for kind, fixed in (("tp", ("dp", "pp")), ("pp", ("dp", "tp")), ("dp", ("pp", "tp"))):
        for e in layout:  # same colour <=> same coordinates outside the group's own axis
            mates = {f["rank"] for f in layout if f["groups"][kind] == e["groups"][kind]}
            assert mates == {f["rank"] for f in layout
                             if all(f[c] == e[c] for c in fixed)}, (kind, e)


def test_dispatch_picture_is_the_routing_transposed():
    """Row s of the counts is rank s's routing table summed by owner; rank d receives column d
    (checked row by row against the tokens inside dispatch_run); the output is the serial one."""
    d = experts.dispatch_run()
    g, per = d["g"], d["experts"] // d["g"]
    for s, chosen in enumerate(d["chosen"]):
        assert all(len(c) == d["k"] for c in chosen)
        owners = [e // per for c in chosen for e in c]
        assert d["sent"][s] == [owners.count(r) for r in range(g)]
    assert [len(a) for a in d["arrivals"]] == [sum(row[r] for row in d["sent"]) for r in range(g)]
    assert all(e // per == r for r, a in enumerate(d["arrivals"]) for _, _, e in a)
    assert d["serial_error"] < 1e-12


def test_ring_picture_is_the_causal_pairs_the_layer_computes():
    """The plain ring gives rank r r full blocks and its diagonal (work 4r + 2 zigzag chunk
    pairs: a balance of G/(2G-1)); the zigzag gives every rank 2G of them. Each layout's output
    on the stand-in ranks is the serial attention core's."""
    ring, zigzag = context.ring_run("ring"), context.ring_run("zigzag")
    g = ring["g"]
    assert ring["work"] == [4 * r + 2 for r in range(g)]
    assert zigzag["work"] == [2 * g] * g
    assert ring["balance"] == pytest.approx(g / (2 * g - 1), abs=1e-6)
    assert zigzag["balance"] == 1
    for d in (ring, zigzag):
        assert d["serial_error"] < 1e-12
        for r, row in enumerate(d["steps"]):
            assert [cell["source"] for cell in row] == [(r - j) % g for j in range(g)]
    assert [len(cell["pairs"]) for cell in ring["steps"][2]] == [1, 1, 1, 0]


def test_precision_picture_is_the_formats_ranges_on_a_real_step():
    """The shares drawn are the gradient entries below half fp16's smallest subnormal (zero),
    below its smallest normal (subnormal) and above its max, unscaled and times 2^16; the loss
    scale leaves only the key biases' 128 rounding-noise entries (true gradient 0) lost, and
    bf16 loses nothing. Lesson 13 quotes them."""
    d = precision_figure.gradients_run()
    assert d["limits"]["fp16"]["smallest_subnormal"] == -24
    assert d["limits"]["fp16"]["smallest_normal"] == -14
    assert d["shares"]["fp16 scaled"]["subnormal"] < d["shares"]["fp16 unscaled"]["subnormal"]
    assert round(d["shares"]["fp16 scaled"]["zero"] * d["entries"]) == 128
    assert all(v == 0 for k, s in d["shares"].items() if k.startswith("bf16")
               for v in s.values())
    assert sum(d["counts"]) == d["entries"]
    text = (COMMITTED.parent / "13-mixed-precision.md").read_text()
    for key, kind in (("fp16 unscaled", "subnormal"), ("fp16 unscaled", "zero"),
                      ("fp16 scaled", "zero")):
        assert f"{d['shares'][key][kind]:.2%}" in text, (key, kind)
    assert f"{d['shares']['fp16 scaled']['subnormal']:.4%}" in text


def test_an_error_on_one_stand_in_rank_ends_them_all():
    def fn(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 fails")
        comm.Allreduce(np.zeros(1))  # the others wait in the barrier, which breaks

    with pytest.raises(ValueError, match="rank 1 fails"):
        ThreadRanks(3).run(fn)


# ----------------------------------------------------------------------------- the basics
@pytest.mark.parametrize("p", [3, 4])
def test_stand_in_collectives_give_what_mpi_gives(p):
    """Every element distinct (a shuffled range), blocks of 2 rows of 3, roots other than 0:
    an element read from the wrong rank, block or place changes an answer."""
    k = 2
    x = np.random.default_rng(p).permutation(p * p * k * 3).reshape(p, p * k, 3).astype(float)
    blocks = x.reshape(p, p, k, 3)  # [rank, block, row, column]

    def body(comm):
        r, mine, out = comm.rank, x[comm.rank], {}
        out["Scatter"] = np.full((k, 3), -1.0)
        comm.Scatter(mine if r == 1 else None, out["Scatter"], root=1)
        out["Gather"] = np.full((p * k, 3), -1.0) if r == 2 else None
        comm.Gather(blocks[r, 0], out["Gather"], root=2)
        out["Allgather"] = np.full((p * k, 3), -1.0)
        comm.Allgather(blocks[r, 0], out["Allgather"])
        out["Reduce_scatter"] = np.full((k, 3), -1.0)
        comm.Reduce_scatter(mine, out["Reduce_scatter"])
        out["Alltoall"] = np.full_like(mine, -1.0)
        comm.Alltoall(mine, out["Alltoall"])
        return out

    got = ThreadRanks(p).run(body)
    everyones_first = blocks[:, 0].reshape(p * k, 3)  # rank order
    for r in range(p):
        assert np.array_equal(got[r]["Scatter"], blocks[1, r])  # block r of root 1's buffer
        assert np.array_equal(got[r]["Allgather"], everyones_first)
        assert np.array_equal(got[r]["Reduce_scatter"], x.sum(axis=0)[r * k:(r + 1) * k])
        assert np.array_equal(got[r]["Alltoall"], blocks[:, r].reshape(p * k, 3))  # transpose
    assert np.array_equal(got[2]["Gather"], everyones_first)
    assert [r for r in range(p) if got[r]["Gather"] is not None] == [2]


def test_collectives_picture_draws_what_mpi_gives():
    d = basics.collectives_run(p=4)
    x = np.array(d["Alltoall"]["before"])
    assert x.tolist() == [[10 * r + i for i in range(4)] for r in range(4)]
    assert d["Alltoall"]["after"] == x.T.tolist()
    assert d["Reduce_scatter"]["before"] == x.tolist()
    assert d["Reduce_scatter"]["after"] == [[int(v)] for v in x.sum(axis=0)]
    assert d["Scatter"]["after"] == [[v] for v in d["Scatter"]["before"][0]]
    assert d["Scatter"]["before"][1:] == [[]] * 3
    firsts = [b[0] for b in d["Allgather"]["before"]]
    assert d["Allgather"]["after"] == [firsts] * 4
    assert d["Gather"]["after"] == [firsts, [], [], []]


def tree_by_rule(p, root=0):
    """lessons/code/00_bcast_reduce.py's rule, from its docstring: in round k of R =
    ceil(log2 p), every rank that has the data (counted from the root) sends it 2**(R-k) on."""
    rounds, sends = (p - 1).bit_length(), []
    for k in range(1, rounds + 1):
        step = 1 << (rounds - k)
        sends += [[k, (m + root) % p, (m + step + root) % p]
                  for m in range(0, p, 2 * step) if m + step < p]
    return sorted(sends)  # as tree_run lists them: by round, then source


@pytest.mark.parametrize("p,root", [(8, 0), (8, 3), (5, 0), (6, 2)])
def test_tree_picture_is_lesson_0_s_bcast_tree(p, root):
    """Every rank but the root receives once, from a rank that had the data a round before, a
    rank sends at most once a round, in ceil(log2 p) rounds; each rank sends to the ranks the
    script's rule names, in its order. Where p is a power of two the rounds are the rule's too
    (elsewhere a rank whose partner is missing sends its next message a round early, as the
    code does). On 8 ranks from 0 that is the picture; on 5, the root sends 3 messages and
    rank 2 one, as test_lesson_code sees the script print under mpirun."""
    d = basics.tree_run(p, root)
    have = {root: 0}
    for k, s, dest in d["sends"]:
        assert have.get(s, k) < k, f"rank {s} sends in round {k} before it has the data"
        assert dest not in have, f"rank {dest} receives twice"
        have[dest] = k
    assert sorted(have) == list(range(p))
    assert len({(k, s) for k, s, _ in d["sends"]}) == len(d["sends"])
    assert max(have.values()) == (p - 1).bit_length()
    assert d["got"] == [1] * p
    rule = tree_by_rule(p, root)
    def dests(sends):  # per rank, whom it sends to, in its order
        return [[dest for _, s, dest in sends if s == r] for r in range(p)]

    assert dests(d["sends"]) == dests(rule)
    if p & (p - 1) == 0:
        assert d["sends"] == rule
    if (p, root) == (8, 0):
        assert d["sends"] == basics.collectives_run()["tree"]["sends"] == [
            [1, 0, 4], [2, 0, 2], [2, 4, 6], [3, 0, 1], [3, 2, 3], [3, 4, 5], [3, 6, 7]]
    if (p, root) == (5, 0):
        assert [sum(s == r for _, s, _ in d["sends"]) for r in range(p)] == [3, 0, 1, 0, 0]


def test_reduce_tree_is_the_broadcast_backwards():
    """The picture's note: reduce_tree sends the broadcast's messages reversed, last round
    first, and the root ends with every rank's share (rank r's is bit r)."""
    p, rounds = 8, 3
    bcast, reduce = basics.tree_run(p), basics.tree_run(p, reduce=True)
    assert sorted([rounds + 1 - k, d, s] for k, s, d in reduce["sends"]) == bcast["sends"]
    assert reduce["got"][0] == 2 ** p - 1


# ----------------------------------------------------------------------------- trace.gantt
def bars(widths_ms, rows=2):
    """Events per row: forward bars of the given widths (ms), one micro-batch each."""
    per_rank = []
    for _ in range(rows):
        t, events = 0.0, []
        for k, w in enumerate(widths_ms):
            events.append((t, t + w / 1e3, "forward", "F", {"micro": k}))
            t += w / 1e3 + 1e-4
        per_rank.append(events)
    return per_rank


def drawn(widths_ms, monkeypatch, cores=64, ranks=None):
    from mpipar.engine import backend
    from mpipar.mpi.trace import gantt

    plt = pyplot()
    monkeypatch.setattr(backend, "cores", lambda: cores)
    fig, ax = plt.subplots(figsize=(11, 2))
    gantt(bars(widths_ms), None, ax=ax, ranks=ranks)
    texts = [t.get_text() for t in ax.texts]
    legend = ax.get_legend().get_window_extent()
    plt.close(fig)
    return texts, legend, ax.get_window_extent()


def test_gantt_labels_the_bars_that_hold_them(monkeypatch):
    texts, _, _ = drawn([10] * 8, monkeypatch)
    assert sorted(texts) == sorted([str(k) for k in range(8)] * 2)  # no note: all fit
    texts, _, _ = drawn([10, 0.01, 10], monkeypatch)
    assert sorted(t for t in texts if len(t) == 1) == ["0", "0", "2", "2"]
    assert "micro-batch numbers left out on 2 bars too narrow to hold them" in texts


def test_gantt_notes_oversubscription_and_keeps_the_legend_off_the_bars(monkeypatch):
    texts, legend, axes = drawn([10] * 4, monkeypatch, cores=2, ranks=4)
    assert any(t.startswith("4 ranks on 2 cores") for t in texts), texts
    assert legend.x0 >= axes.x1  # right of the chart
    texts, _, _ = drawn([10] * 4, monkeypatch, cores=4, ranks=4)
    assert not any("cores" in t for t in texts)


def test_lessons_quote_the_pictures_numbers():
    def text(prefix):
        return " ".join(next((ROOT / "lessons").glob(f"{prefix}*.md")).read_text().split())

    bubbles = layouts.schedules_run()
    for name in ("naive", "gpipe", "interleaved", "zb-h1"):
        assert f"{bubbles[name]['drawn_bubble']:.3f})" in text("05"), name
    ring = collectives.ring_run(p=4)
    share = ring["elements_sent"][0] / ring["p"]
    assert f"{share:g} buffers in all" in text("01")
    assert f"sends {share:g} n on 4 ranks" in text("03")
    ce = collectives.cross_entropy_run()
    per_rank = {b - a for a, b in ce["ranges"]}
    assert f"one row of {len(ce['logits'])} logits, {per_rank.pop()} columns per rank" in text("04")
