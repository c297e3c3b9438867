"""Pipeline schedules without MPI: exact lists for small cases, and for many (stages, micro-
batches) the happens-before order, matched messages, stash sizes and bubble of a simulation;
zero-bubble ZB-H1 with its W instructions too."""

import itertools

import pytest

from mpipar.parts.schedules import (
    SCHEDULES,
    SPLIT,
    WARMUPS,
    Backward,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    bubble_formula,
    format_schedule,
    in_flight,
    interleaved,
    one_f_one_b,
    peak_in_flight,
    peak_stash,
    schedule,
    simulate,
    simulated_bubble,
    zb_h1_idle,
)
from mpipar.parts.v_schedules import dualpipev, published_bubble

CASES = [(p, m) for p in range(1, 7) for m in range(1, 10)]
ONE_CHUNK = [*SCHEDULES, *SPLIT]  # every schedule but interleaved


def text(name, p, m):
    return [" ".join(map(str, ins)) for ins in schedule(name, p, m)]


def test_exact_lists_two_stages_two_micro_batches():
    assert text("naive", 2, 2) == ["F0 SA0 RG0 B0 F1 SA1 RG1 B1 OPT",
                                   "RA0 F0 B0 SG0 RA1 F1 B1 SG1 OPT"]
    assert text("gpipe", 2, 2) == ["F0 SA0 F1 SA1 RG1 B1 RG0 B0 OPT",
                                   "RA0 F0 RA1 F1 B1 SG1 B0 SG0 OPT"]
    assert text("1f1b", 2, 2) == ["F0 SA0 F1 SA1 RG0 B0 RG1 B1 OPT",
                                  "RA0 F0 B0 SG0 RA1 F1 B1 SG1 OPT"]


def test_exact_1f1b_three_stages_four_micro_batches():
    """Stage r: min(p-r-1, m) warm-up forwards, then one forward one backward, then the rest."""
    assert text("1f1b", 3, 4) == [
        "F0 SA0 F1 SA1 F2 SA2 RG0 B0 F3 SA3 RG1 B1 RG2 B2 RG3 B3 OPT",
        "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RA2 F2 SA2 RG1 B1 SG1 RA3 F3 SA3 RG2 B2 SG2 "
        "RG3 B3 SG3 OPT",
        "RA0 F0 B0 SG0 RA1 F1 B1 SG1 RA2 F2 B2 SG2 RA3 F3 B3 SG3 OPT",
    ]


def test_1f1b_runs_for_every_p_and_m_and_keeps_its_stash():
    """The student track's first check of a 1F1B list: simulated for every (p, m) of CASES,
    so that a wrong order is named as the simulator finds it (the stage, the instruction);
    then each stage's forwards before its first backward, which is its peak stash."""
    for p, m in CASES:
        lists = schedule("1f1b", p, m)
        try:
            simulate(lists)
        except ScheduleError as err:
            raise AssertionError(f"p = {p}, m = {m}: {err}") from None
        for r, ins in enumerate(lists):
            first_b = next((i for i, x in enumerate(ins) if isinstance(x, Backward)), len(ins))
            ahead = sum(isinstance(x, Forward) for x in ins[:first_b])
            assert ahead == min(p - r, m), (
                f"p = {p}, m = {m}, stage {r}: {ahead} forwards before the first "
                f"backward; 1F1B runs min(p - r, m) = {min(p - r, m)} (its peak stash)")


def test_single_stage_has_no_messages():
    for name in ONE_CHUNK:
        ins = schedule(name, 1, 3)[0]
        assert not [i for i in ins if isinstance(i, (SendAct, RecvAct, SendGrad, RecvGrad))]
        assert sum(isinstance(i, Forward) for i in ins) == 3 and ins[-1] == OptimizerStep()


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_happens_before_and_matched_messages(name):
    for p, m in CASES:
        timeline = simulate(schedule(name, p, m))  # raises on any unmatched message
        for s, events in enumerate(timeline):
            fwd = {i.micro: (t0, t1) for i, t0, t1 in events if isinstance(i, Forward)}
            bwd = {i.micro: (t0, t1) for i, t0, t1 in events if isinstance(i, Backward)}
            assert sorted(fwd) == sorted(bwd) == list(range(m)), (name, p, m, s)
            assert isinstance(events[-1][0], OptimizerStep)
            assert events[-1][1] >= max(t1 for _, t1 in bwd.values())
            for k in range(m):
                assert fwd[k][1] <= bwd[k][0]  # a micro-batch's backward after its forward
                if s + 1 < p:
                    nxt = timeline[s + 1]
                    f_next = next(t0 for i, t0, _ in nxt if i == Forward(k))
                    b_next = next(t1 for i, _, t1 in nxt if i == Backward(k))
                    assert fwd[k][1] <= f_next, (name, p, m, s, k)  # forward: s before s+1
                    assert b_next <= bwd[k][0], (name, p, m, s, k)  # backward: s+1 before s


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_every_send_has_its_receive(name):
    for p, m in CASES:
        lists = schedule(name, p, m)
        for s in range(p):
            for send, recv, to in ((SendAct, RecvAct, s + 1), (SendGrad, RecvGrad, s - 1)):
                sent = [i.micro for i in lists[s] if isinstance(i, send)]
                got = [i.micro for i in lists[to] if isinstance(i, recv)] if 0 <= to < p else []
                assert sent == got, (name, p, m, s, send.__name__)


def test_stashed_micro_batches():
    for p, m in CASES:
        for r in range(p):
            assert peak_in_flight(SCHEDULES["naive"](p, r, m)) == 1
            assert peak_in_flight(SCHEDULES["gpipe"](p, r, m)) == m
            assert peak_in_flight(SCHEDULES["1f1b"](p, r, m)) == min(p - r, m), (p, m, r)
            assert in_flight(SCHEDULES["1f1b"](p, r, m))[-1] == 0


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_simulated_bubble_is_the_formula(name):
    """Equal stages, backward twice the forward, free messages: (p-1)/(m+p-1) for GPipe and
    1F1B, (p-1)/p for one micro-batch at a time; zb-h1 (B and W one unit each) per
    bubble_formula, (p-1)/(3m+p-1) for m >= p."""
    for p, m in CASES:
        got = simulated_bubble(simulate(schedule(name, p, m)))
        assert got == pytest.approx(bubble_formula(p, m, name), abs=1e-12), (name, p, m)


def test_simulation_catches_broken_schedules():
    # stage 0 waits for the gradient before sending the activation it depends on: deadlock
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[Forward(0), RecvGrad(0), SendAct(0), Backward(0)],
                  [RecvAct(0), Forward(0), Backward(0), SendGrad(0)]])
    # the receiver takes micro-batches in another order than they were sent
    with pytest.raises(ScheduleError, match="micro-batch 1 .* micro-batch 0"):
        simulate([[Forward(0), SendAct(0), Forward(1), SendAct(1)],
                  [RecvAct(1), RecvAct(0)]])
    with pytest.raises(ScheduleError, match="never received"):
        simulate([[Forward(0), SendAct(0)], []])
    with pytest.raises(ScheduleError, match="before"):
        simulate([[SendAct(0), Forward(0)], [RecvAct(0), Forward(0)]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="must be positive"):
        schedule("1f1b", 2, 0)


def test_printed_schedule():
    out = format_schedule("gpipe", 2, 2)
    assert "stage 0 (stashes at most 2): F0 SA0 F1 SA1 RG1 B1 RG0 B0 OPT" in out
    assert "stage 1 |  . F0 F1 B1 B1 B0 B0" in out
    assert "bubble 0.333 (formula 0.333)" in out


# ----------------------------------------------------------------------------- interleaved 1F1B
INTERLEAVED = [(p, m, v) for p in range(1, 6) for v in (2, 3) for m in range(p, 4 * p + 1, p)]


def interleaved_lists(p, m, v, warmup="production"):
    return [interleaved(p, r, m, v, warmup) for r in range(p)]


def test_instruction_prints_its_chunk_only_when_not_zero():
    assert str(Forward(3)) == str(Forward(3, 0)) == "F3" and Forward(3) == Forward(3, 0)
    assert str(Forward(3, 1)) == "F3.1" and str(SendGrad(0, 2)) == "SG0.2"
    assert str(OptimizerStep()) == "OPT" and Forward(3, 1) != Forward(3)


def test_exact_interleaved_two_stages_two_chunks():
    """Groups of p micro-batches through chunk 0 then chunk 1; warm-up (p-r-1) + (v-1)*p
    (lean) or 2(p-r-1) + (v-1)*p (production), both all 4 chunk-forwards of stage 0 here."""
    assert interleaved_lists(2, 2, 2) == interleaved_lists(2, 2, 2, "lean")
    assert [" ".join(map(str, ins)) for ins in interleaved_lists(2, 2, 2)] == [
        "F0 SA0 F1 SA1 RA0.1 F0.1 SA0.1 RA1.1 F1.1 SA1.1 RG0.1 B0.1 SG0.1 RG1.1 B1.1 SG1.1 "
        "RG0 B0 RG1 B1 OPT",
        "RA0 F0 SA0 RA1 F1 SA1 RA0.1 F0.1 B0.1 SG0.1 RA1.1 F1.1 B1.1 SG1.1 RG0 B0 SG0 "
        "RG1 B1 SG1 OPT",
    ]


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in CASES:
        if m % p == 0:
            assert [interleaved(p, r, m, 1, "lean") for r in range(p)] == \
                [one_f_one_b(p, r, m) for r in range(p)], (p, m)


def test_interleaved_happens_before_and_matched_messages():
    """Piece c*p + s (chunk c of stage s) runs a micro-batch's forward after piece c*p + s - 1
    and its backward after piece c*p + s + 1; no deadlock, nothing left unreceived."""
    for (p, m, v), warmup in itertools.product(INTERLEAVED, WARMUPS):
        timeline = simulate(interleaved_lists(p, m, v, warmup))  # raises on deadlock, mismatch
        fwd, bwd = {}, {}
        for s, events in enumerate(timeline):
            assert isinstance(events[-1][0], OptimizerStep)
            for ins, t0, t1 in events:
                if isinstance(ins, (Forward, Backward)):
                    table = fwd if isinstance(ins, Forward) else bwd
                    assert (ins.chunk * p + s, ins.micro) not in table
                    table[ins.chunk * p + s, ins.micro] = (t0, t1)
        pieces = [(x, k) for x in range(p * v) for k in range(m)]
        assert sorted(fwd) == sorted(bwd) == pieces, (p, m, v)
        for x, k in pieces:
            assert fwd[x, k][1] <= bwd[x, k][0], (p, m, v, x, k)
            if x + 1 < p * v:
                assert fwd[x, k][1] <= fwd[x + 1, k][0], (p, m, v, x, k)
                assert bwd[x + 1, k][1] <= bwd[x, k][0], (p, m, v, x, k)


def test_interleaved_every_send_has_its_receive():
    """Sends of each kind and chunk are received in the same order by the piece they go to."""
    for (p, m, v), warmup in itertools.product(INTERLEAVED, WARMUPS):
        lists = interleaved_lists(p, m, v, warmup)
        for x in range(p * v):
            c, s = divmod(x, p)
            for send, recv, y in ((SendAct, RecvAct, x + 1), (SendGrad, RecvGrad, x - 1)):
                sent = [i.micro for i in lists[s] if isinstance(i, send) and i.chunk == c]
                got = []
                if 0 <= y < p * v:
                    got = [i.micro for i in lists[y % p]
                           if isinstance(i, recv) and i.chunk == y // p]
                assert sent == got, (p, m, v, x, send.__name__)


def test_interleaved_simulated_bubble_is_the_formula():
    """A chunk's forward costs 1/v, its backward 2/v: bubble (p-1)/(v*m+p-1), v times less
    than 1F1B's; v times as many messages; stashes per the docstring, the lean warm-up p-r-1
    chunk activations fewer than the production one."""
    for (p, m, v), warmup in itertools.product(INTERLEAVED, WARMUPS):
        lists = interleaved_lists(p, m, v, warmup)
        got = simulated_bubble(simulate(lists, forward_cost=1 / v, backward_cost=2 / v))
        assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
        plain = schedule("1f1b", p, m)
        count = sum(isinstance(i, (SendAct, SendGrad)) for ins in lists for i in ins)
        assert count == v * sum(isinstance(i, (SendAct, SendGrad)) for ins in plain for i in ins) \
            + 2 * m * (v - 1) * (p > 1), (p, m, v)  # one rank: its chunks hand over locally
        for r in range(p):
            ahead = (p - r - 1) * (2 if warmup == "production" else 1)
            assert peak_in_flight(lists[r]) == min(ahead + (v - 1) * p + 1, v * m), (p, m, v, r)
            assert in_flight(lists[r])[-1] == 0


def test_the_production_warm_up_tolerates_latency():
    """p = 4, m = 16, v = 2, a message 0.1 of a chunk-forward: the lean warm-up's bubble is
    0.130, the production one's 0.098; with no latency both are (p-1)/(vm+p-1) = 0.086, and
    the gap grows with the latency (every steady-state step of the lean list waits for the
    message its neighbour has just sent)."""
    def bubble(warmup, latency):
        return simulated_bubble(simulate(interleaved_lists(4, 16, 2, warmup), 0.5, 1.0,
                                         message_cost=0.5 * latency))
    assert bubble("lean", 0.1) == pytest.approx(0.1304, abs=5e-4)
    assert bubble("production", 0.1) == pytest.approx(0.0977, abs=5e-4)
    assert bubble("lean", 0) == pytest.approx(bubble("production", 0)) == pytest.approx(3 / 35)
    gaps = [bubble("lean", x) - bubble("production", x) for x in (0.05, 0.1, 0.2, 0.5, 1.0)]
    assert all(0 < a < b for a, b in zip(gaps, gaps[1:])), gaps


def test_interleaved_costs_per_stage_and_per_micro_batch():
    """Costs as lists (per stage, or per stage and chunk) or as functions (stage, micro,
    chunk) give the same timeline as numbers; a chunk's own cost is that chunk's."""
    lists = interleaved_lists(3, 6, 2)
    ref = simulate(lists, 0.5, 1.0, message_cost=0.1)
    assert simulate(lists, [0.5] * 3, [1.0] * 3, message_cost=0.1) == ref
    assert simulate(lists, [[0.5, 0.5]] * 3, [[1.0, 1.0]] * 3, message_cost=0.1) == ref
    chunked = simulate(lists, [[0.5, 0.75]] * 3, 1.0)
    took = {(ins.chunk, round(t1 - t0, 9)) for events in chunked for ins, t0, t1 in events
            if isinstance(ins, Forward)}
    assert took == {(0, 0.5), (1, 0.75)}
    assert simulate(lists, lambda s, k, c: 0.5, lambda s, k, c: 1.0, message_cost=0.1) == ref
    slow = simulate(lists, lambda s, k, c: 0.5 + (k == 0), 1.0)
    assert slow[0][0][2] == 1.5 and slow != ref


def test_interleaved_bad_arguments_and_broken_chunks():
    with pytest.raises(ValueError, match="multiple of the stages"):
        interleaved(4, 0, 6, 2)
    with pytest.raises(ValueError, match="chunks must be positive"):
        interleaved(2, 0, 2, 0)
    with pytest.raises(ValueError, match="unknown warm-up 'eager'"):
        interleaved(2, 0, 2, 2, "eager")
    # chunk 1 of stage 0 takes its input from stage 1's chunk 0, not from stage 0's chunk 0
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[Forward(0), SendAct(0), RecvAct(0, 1), Forward(0, 1)], [RecvAct(0, 1)]])
    # the last stage's last chunk has nowhere to send to
    with pytest.raises(ScheduleError, match="no next stage"):
        simulate([[Forward(0), SendAct(0)], [RecvAct(0), Forward(0), SendAct(0)]])
    # a message for chunk 1 is not taken by a receive on chunk 0
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[Forward(0), SendAct(0)], [RecvAct(0, 1)]])


def test_interleaved_by_name():
    assert schedule("interleaved", 2, 4, 2) == interleaved_lists(2, 4, 2)
    assert bubble_formula(4, 8, "interleaved", 2) == pytest.approx(3 / 19)
    assert bubble_formula(4, 8, "1f1b", 2) == pytest.approx(3 / 11)  # chunks only interleave
    with pytest.raises(ValueError, match="one model chunk per stage"):
        schedule("1f1b", 2, 4, 2)
    out = format_schedule("interleaved", 2, 2, 2)
    assert "stage 0 | F0.0 F1.0 F0.1 F1.1    .    . B0.1 B0.1" in out, out
    assert "bubble 0.200 (formula 0.200)" in out


# ----------------------------------------------------------------------------- zero bubble (ZB-H1)
def test_exact_zb_h1_three_stages_four_micro_batches():
    """1F1B's warm-up and F/B alternation; stage r adds the W of its oldest micro-batch from
    its (r+1)-th B on, one W after each B in the cool-down, and the W's still owed at the end."""
    assert text("zb-h1", 3, 4) == [
        "F0 SA0 F1 SA1 F2 SA2 RG0 B0 W0 F3 SA3 RG1 B1 W1 RG2 B2 W2 RG3 B3 W3 OPT",
        "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RA2 F2 SA2 RG1 B1 SG1 W0 RA3 F3 SA3 RG2 B2 SG2 W1 "
        "RG3 B3 SG3 W2 W3 OPT",
        "RA0 F0 B0 SG0 RA1 F1 B1 SG1 RA2 F2 B2 SG2 W0 RA3 F3 B3 SG3 W1 W2 W3 OPT",
    ]
    assert str(BackwardWeight(2)) == "W2" and BackwardWeight(2).kind == "backward"


def test_zb_h1_is_1f1b_with_each_backward_split():
    """Drop the W's and the list is 1F1B's: the same forwards, B's and messages, in order."""
    for p, m in CASES:
        for r in range(p):
            lists = SPLIT["zb-h1"](p, r, m)
            assert [i for i in lists if not isinstance(i, BackwardWeight)] == \
                one_f_one_b(p, r, m), (p, m, r)


def test_zb_h1_weight_gradients_after_their_b_before_the_step():
    """Every micro-batch gets one W, after its own B, in micro-batch order (so the gradients
    add up in 1F1B's order: the same bits), and the optimizer step comes after the last W."""
    for p, m in CASES:
        for events in simulate(schedule("zb-h1", p, m)):
            b_end = {i.micro: t1 for i, _, t1 in events if isinstance(i, Backward)}
            w = [(i.micro, t0) for i, t0, _ in events if isinstance(i, BackwardWeight)]
            assert [k for k, _ in w] == list(range(m)), (p, m)
            assert all(b_end[k] <= t0 for k, t0 in w), (p, m)
            assert isinstance(events[-1][0], OptimizerStep)
            assert events[-1][1] >= max(t0 for _, t0 in w)


def test_zb_h1_stash_is_1f1b_first_stage_on_every_stage():
    """Counting a micro-batch from its forward to its W, every stage holds at most min(p, m),
    what 1F1B's first stage holds: the peak over the stages does not grow."""
    for p, m in CASES:
        for r in range(p):
            ins = SPLIT["zb-h1"](p, r, m)
            assert peak_in_flight(ins) == min(p, m) == peak_in_flight(one_f_one_b(p, 0, m))
            assert in_flight(ins)[-1] == 0


def test_peak_stash_in_bytes():
    """A forward adds its stash, a B that has a W trades it for what W needs, a W frees it; a
    whole backward frees it all. With one unit each way it counts the micro-batches in flight."""
    for p, m in CASES:
        for r in range(p):
            for ins in (one_f_one_b(p, r, m), SPLIT["zb-h1"](p, r, m)):
                assert peak_stash(ins, 1, 1) == peak_in_flight(ins)
            assert peak_stash(one_f_one_b(p, r, m), 5, 99) == 5 * min(p - r, m)
    # stage 1 of 2, m = 2: F0 B0 F1 B1 W0 W1; held 5, 3, 8, 6 (after B1), 3, 0
    assert peak_stash(SPLIT["zb-h1"](2, 1, 2), 5, 3) == 8


@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1)])
def test_zb_h1_idle_time_is_the_papers(tf, tb, tw):
    """Qi et al. 2024, Sec. 3.1: each stage idles (p-1)(TF+TB-TW) in a step (m >= p, W no
    longer than F or B), against 1F1B's (p-1)(TF+TB+TW): a third of it when the three are equal."""
    for p, m in CASES:
        if m < p:
            continue
        for name, idle in (("zb-h1", (p - 1) * (tf + tb - tw)), ("1f1b", (p - 1) * (tf + tb + tw))):
            timeline = simulate(schedule(name, p, m), tf, tb + tw, weight_share=tw / (tb + tw))
            end = max(t1 for events in timeline for _, _, t1 in events)
            for events in timeline:
                busy = sum(t1 - t0 for i, t0, t1 in events if i.kind in ("forward", "backward"))
                assert end - busy == pytest.approx(idle), (name, p, m, tf, tb, tw)


@pytest.mark.parametrize("tf,tb,tw", [(0.5, 1, 0.75), (1, 0.5, 0.75), (0.5, 1, 1), (1, 1, 2),
                                      (2, 1, 1.5), (1, 2, 1.5)])
def test_zb_h1_idles_max_f_b_when_w_is_longer_than_f_or_b(tf, tb, tw):
    """The paper's (p-1)(TF+TB-TW) needs W no longer than F and B: with W longer than either
    the replay idles (p-1) max(TF, TB) (p = 4, m = 8, F 0.5, B 1, W 0.75: 3, not 2.25)."""
    for p, m in CASES:
        if m < p:
            continue
        timeline = simulate(schedule("zb-h1", p, m), tf, tb + tw, weight_share=tw / (tb + tw))
        end = max(t1 for events in timeline for _, _, t1 in events)
        for events in timeline:
            busy = sum(t1 - t0 for i, t0, t1 in events if i.kind in ("forward", "backward"))
            assert end - busy == pytest.approx(zb_h1_idle(p, tf, tb, tw))
            assert end - busy == pytest.approx((p - 1) * max(tf, tb))
    assert zb_h1_idle(4, 0.5, 1, 0.75) == 3.0 and 3 * (0.5 + 1 - 0.75) == 2.25


@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1)])
def test_bench_pp_zb_formula_is_the_replay_with_those_times(tf, tb, tw):
    """bench pp's ZB-H1 bubble from measured F, B, W equals the schedule replayed with them
    (equal stages, m >= p), and with equal times it is bubble_formula's (p-1)/(3m+p-1)."""
    from mpipar.tools.bench.pp import replayed_bubble, zb_formula

    for p, m in CASES:
        if m < p:
            continue
        replay = replayed_bubble("zb-h1", p, m, [(tf, tb, tw)] * p)
        assert zb_formula(p, m, tf, tb, tw) == pytest.approx(replay), (p, m)
        assert zb_formula(p, m, 1, 1, 1) == pytest.approx(bubble_formula(p, m, "zb-h1"))


def test_zb_h1_bubble_formula():
    assert bubble_formula(4, 8, "zb-h1") == pytest.approx(3 / 27)  # (p-1)/(3m+p-1)
    assert bubble_formula(4, 4, "zb-h1") == pytest.approx(3 / 15)
    assert bubble_formula(4, 2, "zb-h1") == pytest.approx(5 / 11)  # m < p: p-m more idle
    for p, m in CASES:  # never worse than 1F1B; a third of its idle time once m >= p
        assert bubble_formula(p, m, "zb-h1") <= bubble_formula(p, m, "1f1b")


def test_simulation_catches_broken_split_backwards():
    with pytest.raises(ScheduleError, match="before its B"):
        simulate([[Forward(0), BackwardWeight(0), Backward(0)]])
    with pytest.raises(ScheduleError, match="twice"):
        simulate([[Forward(0), Backward(0), BackwardWeight(0), BackwardWeight(0)]])
    with pytest.raises(ScheduleError, match=r"micro-batches \[0\] not yet backpropagated"):
        simulate([[Forward(0), Backward(0), OptimizerStep(), BackwardWeight(0)]])
    # a B with a W costs (1 - weight_share) of the backward, the W the rest
    (_, (_, b0, b1), (_, w0, w1)), = simulate([[Forward(0), Backward(0), BackwardWeight(0)]],
                                                1.0, 2.0, weight_share=0.25)
    assert (b1 - b0, w1 - w0) == (1.5, 0.5)


def test_printed_zb_h1_schedule():
    out = format_schedule("zb-h1", 2, 2)
    assert "W the weights' gradient" in out, out
    assert "stage 1 (stashes at most 2): RA0 F0 B0 SG0 RA1 F1 B1 SG1 W0 W1 OPT" in out, out
    assert "stage 0 | F0 F1  . B0 W0 B1 W1" in out, out
    assert "stage 1 |  . F0 B0 F1 B1 W0 W1" in out, out
    assert "bubble 0.143 (formula 0.143)" in out
    with pytest.raises(ValueError, match="one model chunk per stage"):
        schedule("zb-h1", 2, 4, 2)


# ----------------------------------------------------------------------------- V-shaped
V_CASES = [(p, m) for p in range(1, 7) for m in range(2 * p, 4 * p + 2)]


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_shaped_pieces_run_in_order_and_every_message_is_received(name):
    """Piece x = r (chunk 0) or 2p-1-r (chunk 1) of rank r runs a micro-batch's forward after
    piece x-1 and its backward after piece x+1; the handover from piece p-1 to piece p stays on
    rank p-1 (no message), every other boundary is one message each way; nothing is left."""
    for p, m in V_CASES:
        lists = schedule(name, p, m, 2)
        timeline = simulate(lists, placement="v")  # raises on deadlock or mismatch
        fwd, bwd = {}, {}
        for s, events in enumerate(timeline):
            for ins, t0, t1 in events:
                if isinstance(ins, (Forward, Backward)):
                    x = s if ins.chunk == 0 else 2 * p - 1 - s
                    (fwd if isinstance(ins, Forward) else bwd)[x, ins.micro] = (t0, t1)
        assert sorted(fwd) == sorted(bwd) == [(x, k) for x in range(2 * p) for k in range(m)]
        for x, k in fwd:
            assert fwd[x, k][1] <= bwd[x, k][0]
            if x + 1 < 2 * p:
                assert fwd[x, k][1] <= fwd[x + 1, k][0] and bwd[x + 1, k][1] <= bwd[x, k][0]
        sends = sum(isinstance(i, (SendAct, SendGrad)) for ins in lists for i in ins)
        assert sends == 2 * m * (2 * p - 2), (name, p, m)  # 2p-1 boundaries, one on a rank


@pytest.mark.parametrize("name, stash", [("zb-v", 0), ("dualpipev", 1)])
def test_v_shaped_bubble_is_the_ramp_alone_and_the_stash_is_the_papers(name, stash):
    """F, B and W equal: the step is 6m + p - 1 chunk-units, the least possible (the last rank
    cannot start before the first micro-batch has crossed p-1 pieces): bubble (p-1)/(6m+p-1),
    the formula's; every rank stashes 2p chunk activations (ZB-V: 1F1B's p micro-batches) or
    2p+1 (DualPipeV: the report's PP+1 with PP = 2p pieces)."""
    for p, m in V_CASES:
        lists = schedule(name, p, m, 2)
        got = simulated_bubble(simulate(lists, placement="v"))
        assert got == pytest.approx(bubble_formula(p, m, name, 2), abs=1e-12)
        assert got == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
        assert [peak_in_flight(ins) for ins in lists] == [2 * p + stash] * p, (p, m)


def test_zb_v_has_the_papers_zero_bubble_every_stage_busy_from_first_to_last():
    """ZB-V's zero bubble (F, B, W equal, m >= 2p-1): no rank idles between its first and its
    last instruction; rank r starts r chunk-forwards after rank 0."""
    for p in range(1, 7):
        for m in range(2 * p - 1, 3 * p + 1):
            for s, events in enumerate(simulate(schedule("zb-v", p, m, 2), placement="v")):
                work = [(t0, t1) for ins, t0, t1 in events if ins.kind in ("forward", "backward")]
                assert work[0][0] == s and work[-1][1] - s == 6 * m, (p, m, s)
                assert all(a[1] == b[0] for a, b in zip(work, work[1:])), (p, m, s)


def test_dualpipev_pairs_a_forward_with_another_micro_batch_s_backward():
    """The main phase runs F0 beside B1 and F1 beside B0 of other micro-batches (p = 2, m = 4,
    stage 1: micro-batch 2's forward on chunk 1, then micro-batch 0's backward on chunk 0),
    the forward's send posted before the backward's receive; rank r of the phase runs
    m - 2p + r + 1 such double pairs; a count it cannot run is refused."""
    ins = " ".join(map(str, schedule("dualpipev", 2, 4, 2)[1]))
    assert "RG0.1 B0.1 F2.1 SA2.1 B0 SG0 RA3 F3 RG1.1 B1.1 F3.1 SA3.1 B1 SG1" in ins, ins
    with pytest.raises(ValueError, match="dualpipev needs at least 2 x 4 = 8 micro-batches"):
        schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ValueError, match="runs two model chunks per stage"):
        schedule("zb-v", 2, 4, 3)


def test_v_shaped_by_name_and_on_the_command_line():
    out = format_schedule("zb-v", 2, 4, 2)
    assert "2 model chunks per stage in a V (stage r holds pieces r and 3-r)" in out
    assert "bubble 0.040 (formula 0.040)" in out
    assert bubble_formula(4, 8, "dualpipev", 2) == pytest.approx(3 / 51)


def pair_replay(p, m, f, b, w, fb):
    """DualPipeV with each pair as the report runs it (both receives, then the forward and the
    backward together), replayed with a pair taking ``fb``: its forward is charged fb - b,
    what overlapping adds to the backward, and the two run back to back."""
    lists = [dualpipev(p, s, m, pairs="report") for s in range(p)]
    paired = {(s, a.micro, a.chunk) for s, ins in enumerate(lists)
              for a, z in zip(ins, ins[1:]) if isinstance(a, Forward) and isinstance(z, Backward)}
    return simulate(lists, lambda s, k, c: fb - b if (s, k, c) in paired else f, b,
                    weight_share=w / b, placement="v")


def rank_idle(events):
    """The time a rank idles between its first and its last computation."""
    work = [(t0, t1) for ins, t0, t1 in events if ins.kind in ("forward", "backward")]
    return work[-1][1] - work[0][0] - sum(t1 - t0 for t0, t1 in work)


def test_dualpipev_as_the_report_pairs_it_idles_its_published_bubble():
    """Each pair as DualPipe runs it (both receives, then F and B together for F&B): rank 0,
    the most idle, idles (PP/2-1)(F&B+B-3W) whenever the input gradient takes F (B = F + W)
    and W <= F, from full overlap (F&B = B) to none (F + B); nothing overlapped with F, B = 2F
    and W = F, that is 2(p-1)F, where the order of ``pairs="order"`` idles only (p-1)F."""
    for p in range(1, 6):
        for m in (2 * p, 2 * p + 1, 3 * p + 1):
            for f, w in ((1.0, 1.0), (1.0, 0.5), (2.0, 0.75), (1.5, 1.5)):
                b = f + w
                for fb in (b, (b + f + b) / 2, f + b):
                    idle = [rank_idle(ev) for ev in pair_replay(p, m, f, b, w, fb)]
                    want = published_bubble(p, f, b, w, fb)
                    assert idle[0] == pytest.approx(want, abs=1e-9), (p, m, f, b, w, fb, idle)
                    assert max(idle) == pytest.approx(idle[0], abs=1e-9), (p, m, idle)
        timeline = pair_replay(p, 2 * p, 1.0, 2.0, 1.0, 3.0)
        assert rank_idle(timeline[0]) == 2 * (p - 1) == 2 * rank_idle(
            simulate(schedule("dualpipev", p, 2 * p, 2), placement="v")[0])
    # outside the condition it is not exact: the input gradient 2F (B = 3F), W = F, F&B = B
    assert rank_idle(pair_replay(2, 4, 1.0, 3.0, 1.0, 3.0)[0]) == 2.0
    assert published_bubble(2, 1.0, 3.0, 1.0, 3.0) == 3.0


def test_dualpipev_in_the_report_s_order_receives_both_then_computes_both():
    """p = 2, m = 4, stage 1's main phase: both receives, then both computations, then both
    sends (the pairs' other halves are handed over on the rank, without a message); the lists
    still run every piece in order with every message received."""
    ins = " ".join(map(str, dualpipev(2, 1, 4, pairs="report")))
    assert "RA2 RG0.1 F2 B0.1 F2.1 B0 SA2.1 SG0 RA3 RG1.1 F3 B1.1 F3.1 B1 SA3.1 SG1" in ins, ins
    for p, m in V_CASES:
        simulate([dualpipev(p, s, m, pairs="report") for s in range(p)], placement="v")
