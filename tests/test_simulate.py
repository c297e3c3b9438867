"""The cost model agrees with the formulas of lessons/formulas.md where they apply."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mpipar.engine import nn
from mpipar.parts import plan, schedules
from mpipar.parts import tp_models as TP
from mpipar.tools import hardware as H
from mpipar.tools import simulate as S

HW = S.this_machine(flops=1e9, alpha=1e-5, beta=1e-9)


# ----------------------------------------------------------------------------- mpipar.parts.plan
# The numbers below are the ones the flops() methods of nn's layers gave before FLOP counting
# moved to mpipar.parts.plan; the move changed none of them.
def test_layer_flops_of_the_default_mlp_and_gpt_are_pinned():
    # 2 N d_in d_out per Linear (N = 64 rows), nothing for ReLU
    assert plan.layer_flops(nn.MLP([64, 128, 64, 10]), (64, 64)) == \
        [1048576, 0, 1048576, 0, 81920]
    # a block: 24 N C^2 (qkv, proj, the MLP's two) + 4 B T^2 C (attention) + 16 N C (two
    # LayerNorms), N = B T = 32 * 32, C = 64; the head: 8 N C + 2 N C V, V = 96
    b, t, c, v = 32, 32, 64, 96
    n = b * t
    block, head = 24 * n * c * c + 4 * b * t * t * c + 16 * n * c, 8 * n * c + 2 * n * c * v
    assert (block, head) == (110100480, 13107200)
    assert plan.layer_flops(nn.GPT(v, c, 4, 2, t), (b, t)) == [0, block, block, head]
    assert plan.layer_flops(nn.GPT(v, c, 4, 2, t), (8, t)) == [0, 27525120, 27525120, 3276800]
    assert [r["flops"] for r in S.layer_table(S.GPTSpec(8, 32, 4, 3, 16, True), 4)] == \
        [1736704] * 3
    assert sum(r["flops"] for r in S.layer_table(S.GPT3, 1)) == 734843117764608


@pytest.mark.parametrize("rank,head", [(0, 6946816), (1, 6815744)])
def test_layer_flops_of_a_tensor_parallel_shard_are_pinned(rank, head):
    """One rank's shard of t = 2 (widths read from the parameters it holds): half of each
    block, and the head's share of a vocabulary of 97 split 49 + 48."""
    fake = SimpleNamespace(size=2, rank=rank)  # building a shard sends no message
    gpt = TP.parallel_gpt(97, 64, 4, 2, 32, fake)
    attn = gpt.layers[1][1].attn
    assert (attn.n_local_heads, attn.head_dim, attn.proj.W.shape[0]) == (2, 16, 32)  # H/t of D
    assert plan.layer_flops(gpt, (32, 32)) == [0, 55574528, 55574528, head]
    mlp = TP.parallel_mlp([64, 128, 64, 10], fake)
    assert plan.layer_flops(mlp, (64, 64)) == [524288, 0, 524288, 0, 81920]


def test_a_layer_without_a_flop_rule_is_refused():
    with pytest.raises(TypeError, match="no FLOP rule for MSE"):
        plan.flops(nn.MSE(), (4, 3))


def test_partition_balances_flops_and_gives_bounds():
    assert plan.partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]  # the big layer alone
    assert plan.partition([0, 0, 0, 0, 0, 0], 3) == [2, 2, 2]  # ties: even layer counts
    assert plan.stage_bounds([1, 5]) == [(0, 1), (1, 6)]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        plan.partition([1, 2], 3)


def test_the_cost_model_imports_no_mpi():
    """simulate and plan run where no MPI is installed: not one mpi4py module is imported."""
    code = "import mpipar.tools.simulate, sys; print([m for m in sys.modules if 'mpi4py' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_ring_allreduce_formula():
    n, p = 8e6, 4
    assert S.ring_allreduce_time(n, p, 1e-5, 1e-9) == pytest.approx(
        2 * 3 * 1e-5 + 2 * 3 / 4 * n * 1e-9)
    assert S.ring_allreduce_time(n, 1, 1e-5, 1e-9) == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_replayed_bubble_is_the_formula_for_equal_stages(name, p, m):
    """Equal stages, free messages: the replay's idle share is (p-1)/(m+p-1)."""
    spec = S.GPTSpec(vocab=8, d_model=32, n_heads=4, n_layers=p, seq_len=16, blocks_only=True)
    free = S.this_machine(flops=1e9, alpha=0.0, beta=0.0)
    r = S.predict(spec, free, pp=p, global_batch=4 * m, n_micro=m, schedule=name, dtype_bytes=4)
    busy = r["compute_s"]
    bubble = 1 - busy / r["step_s"]
    assert bubble == pytest.approx(schedules.bubble_formula(p, m, name), rel=1e-6)


@pytest.mark.parametrize("name,p,m", [
    ("interleaved", 2, 4), ("interleaved", 4, 8), ("zb-h1", 2, 4), ("zb-h1", 4, 4),
    ("zb-h1", 4, 2), ("zb-v", 2, 3), ("zb-v", 4, 8), ("dualpipev", 2, 4), ("dualpipev", 4, 9)])
def test_replayed_bubble_of_every_schedule_is_its_formula_for_equal_pieces(name, p, m):
    """Every piece a block (p x v of them with model chunks), free messages: F, B and W take
    equal times (a backward is twice a forward, a split one half B, half W), the conditions of
    each formula, so the step's idle share and the replay's are bubble_formula's."""
    v = 2 if name in schedules.CHUNKED else 1
    spec = S.GPTSpec(8, 32, 4, p * v, 16, blocks_only=True)
    free = S.this_machine(flops=1e9, alpha=0.0, beta=0.0)
    r = S.predict(spec, free, pp=p, global_batch=4 * m, n_micro=m, schedule=name, dtype_bytes=4)
    assert (r["n_chunks"], r["partition"]) == (v, [1] * (p * v))
    law = schedules.bubble_formula(p, m, name, v)
    assert 1 - r["compute_s"] / r["step_s"] == pytest.approx(law, rel=1e-6)
    assert r["replay_bubble"] == pytest.approx(law, rel=1e-6) and r["bubble_formula"] == law


def test_the_chunks_of_a_stage_are_the_pieces_its_placement_names():
    """p = 2, 4 pieces of a GPT (embedding + block, block, block, block + head): interleaved
    stage 0 holds pieces 0 and 2, a V's stage 0 pieces 0 and 3; its parameters, time and the
    activations it stashes are those pieces'."""
    spec = S.GPTSpec(94, 32, 4, 4, 16)
    free = S.this_machine(flops=1e9, alpha=0.0, beta=0.0)
    table = S.layer_table(spec, 2, dtype_bytes=4)
    pieces = [table[:2], table[2:3], table[3:4], table[4:]]
    params = [sum(r["params"] for r in rows) for rows in pieces]
    for name, held in [("interleaved", [(0, 2), (1, 3)]), ("zb-v", [(0, 3), (1, 2)])]:
        r = S.predict(spec, free, pp=2, global_batch=8, n_micro=4, schedule=name, dtype_bytes=4)
        assert r["partition"] == [2, 1, 1, 2]
        assert r["mem_params_bytes"] == 4 * max(params[a] + params[b] for a, b in held)
        lists = schedules.schedule(name, 2, 4, 2)
        stash = [[sum(r["stash"] for r in pieces[x]) for x in pair] for pair in held]
        assert r["mem_activations_bytes"] == pytest.approx(
            max(schedules.peak_stash(ins, b, b) for ins, b in zip(lists, stash)))
    one = S.predict(spec, free, pp=2, global_batch=8, n_micro=4, schedule="1f1b", dtype_bytes=4)
    assert one["n_chunks"] == 1 and one["mem_params_bytes"] == 4 * max(
        sum(params[:2]), sum(params[2:]))


def test_pipeline_messages_add_alpha_beta_per_hop():
    spec = S.GPTSpec(8, 32, 4, 2, 16, blocks_only=True)
    free = S.predict(spec, S.this_machine(1e9, 0.0, 0.0), pp=2, global_batch=4, n_micro=1)
    paid = S.predict(spec, S.this_machine(1e9, 1e-3, 0.0), pp=2, global_batch=4, n_micro=1)
    # one activation forward, one gradient back, both on the critical path
    assert paid["step_s"] - free["step_s"] == pytest.approx(2e-3)


def test_tensor_parallel_splits_compute_and_adds_four_allreduces_per_block():
    spec = S.GPTSpec(8, 64, 4, 3, 16, blocks_only=True)
    one = S.predict(spec, HW, tp=1, global_batch=4)
    two = S.predict(spec, HW, tp=2, global_batch=4)
    assert two["compute_s"] == pytest.approx(one["compute_s"] / 2)
    allreduce = S.ring_allreduce_time(4 * 16 * 64 * 2, 2, HW.tp_alpha, HW.tp_beta)
    assert two["tp_comm_s"] == pytest.approx(3 * 4 * allreduce)


def test_tensor_parallel_gpt_counts_every_allreduce_of_the_module():
    """(4L + 2) Allreduces of b*s*h values and 3 of b*s per micro-batch (the count in
    mpipar/tensor_parallel.py's docstring, and what the hybrid benchmark counts)."""
    b, s, h, layers, m = 4, 16, 64, 3, 2
    spec = S.GPTSpec(8, h, 4, layers, s)
    two = S.predict(spec, HW, tp=2, global_batch=b * m, n_micro=m)
    big = S.ring_allreduce_time(b * s * h * 2, 2, HW.tp_alpha, HW.tp_beta)
    small = S.ring_allreduce_time(b * s * 2, 2, HW.tp_alpha, HW.tp_beta)
    assert two["tp_comm_s"] == pytest.approx(m * ((4 * layers + 2) * big + 3 * small))


# ----------------------------------------------------------------------------- experts
MOE = S.GPTSpec(8, 32, 4, 3, 16, blocks_only=True, experts=8, top_k=2)


def test_expert_all_to_alls_are_the_counts_and_four_row_exchanges_per_layer():
    """Per MoE layer and micro-batch: an Alltoall of E/ep int64 counts to each of ep - 1
    partners, then dispatch, combine and both reversed, each k N (ep-1)/ep rows of C values,
    pairwise: (ep-1) alpha + bytes beta (mpipar/expert_parallel.py's byte count)."""
    b, m, ep, c, s, k, e, width = 16, 2, 4, 32, 16, 2, 8, 8  # float64 rows
    r = S.predict(MOE, HW, dp=4, global_batch=b, n_micro=m, dtype_bytes=width, ep=ep)
    rows = k * (b / 4 / m) * s * (ep - 1) / ep  # one micro-batch's pairs sent off the rank
    counts = (ep - 1) * HW.net_alpha + (ep - 1) * (e // ep) * 8 * HW.net_beta
    exchange = (ep - 1) * HW.net_alpha + rows * c * width * HW.net_beta
    assert r["ep_comm_s"] == pytest.approx(m * 3 * (counts + 4 * exchange))
    assert S.predict(MOE, HW, dp=4, global_batch=b, n_micro=m, ep=1)["ep_comm_s"] == 0
    # the busiest rank's received (and returned) rows scale with the imbalance, not the counts
    skew = S.predict(MOE, HW, dp=4, global_batch=b, n_micro=m, dtype_bytes=width, ep=ep,
                     imbalance=1.5)
    extra = 4 * 0.5 * rows * c * width * HW.net_beta
    assert skew["ep_comm_s"] - r["ep_comm_s"] == pytest.approx(m * 3 * extra)


def test_the_busiest_ranks_expert_flops_scale_with_the_imbalance():
    """Forward, backward (twice the forward): the experts' FLOPs of the busiest rank times the
    imbalance; the router's and attention's do not change."""
    b, ep = 16, 4
    even, skew = (S.predict(MOE, HW, dp=4, global_batch=b, ep=ep, imbalance=i)
                  for i in (1.0, 2.0))
    tokens = b // 4 * MOE.seq_len
    expert = 2 * (2 * tokens * 32 * 128) * 2  # k = 2 experts of C -> 4C -> C a token
    assert skew["compute_s"] - even["compute_s"] == pytest.approx(3 * 3 * expert / HW.flops)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_replica_holds_e_over_ep_experts_and_sums_them_over_dp_over_ep(ep):
    """Parameters per rank: the dense part and 1/ep of the experts; the gradients' allreduce:
    the dense part over all dp replicas, the experts' over their dp/ep replicas."""
    dp, width = 4, 8
    r = S.predict(MOE, HW, dp=dp, global_batch=16, dtype_bytes=width, ep=ep)
    model = MOE.model()
    names = [n for n, _ in model.named_parameters()]
    sizes = dict(zip(names, (p.size for p in model.parameters())))
    experts = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    dense = sum(sizes.values()) - experts
    assert experts == 3 * 8 * (32 * 128 + 128 + 128 * 32 + 32)  # 8 FeedForwards a block
    assert r["mem_params_bytes"] == (dense + experts / ep) * width
    want = S.ring_allreduce_time(dense * width, dp, HW.net_alpha, HW.net_beta) \
        + S.ring_allreduce_time(experts / ep * width, dp // ep, HW.net_alpha, HW.net_beta)
    assert r["dp_comm_s"] == pytest.approx(want)


def test_a_pipeline_of_experts_is_cut_by_the_dense_flops_as_the_hybrid_cuts():
    spec = S.GPTSpec(96, 64, 4, 4, 32, experts=8, top_k=2)
    dense = S.GPTSpec(96, 64, 4, 4, 32)
    for pp in (2, 3):
        assert S.predict(spec, HW, dp=2, pp=pp, n_micro=2, schedule="gpipe", ep=2)[
            "partition"] == S.predict(dense, HW, dp=2, pp=pp, n_micro=2)["partition"]


# ----------------------------------------------------------------------------- context
DENSE = S.GPTSpec(8, 32, 4, 3, 64, blocks_only=True)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_exchanges_are_the_formulas(cp):
    """Per attention layer and micro-batch: the ring sends K and V (2 b n h values) cp-1 times
    forward and cp-1 backward and dK, dV cp times, a message each; Ulysses four all-to-alls of
    3 b n h (cp-1)/cp and b n h (cp-1)/cp values, pairwise (lessons/formulas.md)."""
    b, m, w, h, s = 8, 2, 8, 32, 64
    n = s // cp
    ring = S.predict(DENSE, HW, dp=1, global_batch=b * m, n_micro=m, dtype_bytes=w, cp=cp)
    message = HW.net_alpha + 2 * b * n * h * w * HW.net_beta
    assert ring["cp_comm_s"] == pytest.approx(m * 3 * (3 * cp - 2) * message)
    uly = S.predict(DENSE, HW, dp=1, global_batch=b * m, n_micro=m, dtype_bytes=w, cp=cp,
                    cp_algo="ulysses")
    each = [(cp - 1) * HW.net_alpha + v * b * n * h * w * (cp - 1) / cp * HW.net_beta
            for v in (3, 1)]
    assert uly["cp_comm_s"] == pytest.approx(m * 3 * 2 * sum(each))
    assert ring["ep_comm_s"] == 0 and S.predict(DENSE, HW, global_batch=b)["cp_comm_s"] == 0


def test_the_busiest_cp_rank_computes_its_share_of_the_core():
    """Everything but attention's core over cp; the core (4 b s^2 h, every score) over cp for
    the ring and Ulysses, (2cp+1)/(4cp^2) of it for the zigzag, which skips masked pairs."""
    free = S.this_machine(1e9, 0.0, 0.0)
    b, s, h, layers, cp = 4, 64, 32, 3, 4
    core = layers * 4 * b * s * s * h
    serial = S.predict(DENSE, free, global_batch=b)["compute_s"]
    for algo, share in (("ring", 1 / cp), ("ulysses", 1 / cp), ("zigzag", 9 / 64)):
        r = S.predict(DENSE, free, global_batch=b, cp=cp, cp_algo=algo)["compute_s"]
        want = serial / cp + 3 * core * (share - 1 / cp) / 1e9  # forward + twice backward
        assert r == pytest.approx(want), algo


def test_context_parallel_divides_activations_and_sums_over_dp_times_cp():
    b, w = 4, 2
    serial = S.predict(DENSE, HW, dp=2, global_batch=2 * b, dtype_bytes=w)
    for algo in ("ring", "ulysses"):
        r = S.predict(DENSE, HW, dp=2, global_batch=2 * b, dtype_bytes=w, cp=4, cp_algo=algo)
        s, a = 64, 4
        core = 5 * a * s * s * b * w / 2 * 3  # Korthikanti's s x s term, 3 blocks
        want = serial["mem_activations_bytes"] - (core if algo == "ring" else 0)
        assert r["mem_activations_bytes"] == pytest.approx(want / 4), algo
        assert r["mem_params_bytes"] == serial["mem_params_bytes"]
        assert r["dp_comm_s"] == pytest.approx(S.ring_allreduce_time(
            r["mem_params_bytes"], 8, HW.net_alpha, HW.net_beta))


def test_a_measured_allreduce_cost_replaces_the_ring_formula():
    spec = S.GPTSpec(8, 64, 4, 3, 16, blocks_only=True)
    calls = []

    def measured(n_bytes, p):
        calls.append((n_bytes, p))
        return 1e-3

    hw = S.this_machine(1e9, 1e-5, 1e-9, allreduce=measured)
    two = S.predict(hw=hw, spec=spec, tp=2, global_batch=4)
    assert two["tp_comm_s"] == pytest.approx(3 * 4 * 1e-3)
    assert (4 * 16 * 64 * 2, 2) in calls
    assert S.predict(spec, hw, tp=1, global_batch=4)["tp_comm_s"] == 0.0


NET_ROWS = [dict(kind="allreduce", algo="mpi", ranks="2", bytes=str(n), seconds=str(t))
            for n, t in ((1000, 1e-4), (100000, 1e-3), (1000000, 4e-3))] + [
    dict(kind="allreduce", algo="ring", ranks="2", bytes="10000", seconds="1"),  # not MPI's
    dict(kind="allreduce", algo="mpi", ranks="4", bytes="1000", seconds="5e-4"),
    dict(kind="pingpong", algo="send-recv", ranks="2", bytes="8", seconds="1")]
NET_ROWS_MPI_2 = ((1000, 1e-4), (100000, 1e-3), (1000000, 4e-3))  # MPI's, on 2 ranks, sorted


def test_allreduce_table_keeps_mpis_allreduce_by_ranks_sorted_by_size():
    table = H.allreduce_table(reversed(NET_ROWS))
    assert table == {2: NET_ROWS_MPI_2, 4: ((1000, 5e-4),)}


def test_a_collective_costs_what_the_same_call_measured_else_the_formula():
    """Measured sizes: their time; between two: log-log linear; outside them, or on a rank
    count not measured: the ring formula; an allgather or reduce-scatter half an allreduce."""
    alpha, beta = 1e-5, 1e-9
    hw = S.this_machine(1e9, alpha, beta, measured=H.allreduce_table(NET_ROWS))
    cost = lambda n, p=2, kind="allreduce": hw.collective_time(kind, n, p, alpha, beta)  # noqa
    assert cost(100000) == pytest.approx(1e-3, rel=1e-12)
    assert cost(10000) == pytest.approx((1e-4 * 1e-3) ** 0.5, rel=1e-12)  # halfway in log n
    assert cost(10**5.5) == pytest.approx(1e-3 * 4**0.5, rel=1e-12)
    assert cost(100) == pytest.approx(S.ring_allreduce_time(100, 2, alpha, beta), rel=1e-12)
    assert cost(2e6) == pytest.approx(S.ring_allreduce_time(2e6, 2, alpha, beta), rel=1e-12)
    assert cost(1000, p=4) == pytest.approx(5e-4)
    assert cost(1000, p=8) == pytest.approx(S.ring_allreduce_time(1000, 8, alpha, beta))
    assert cost(10000, kind="allgather") == cost(10000, kind="reduce_scatter") == \
        pytest.approx(cost(10000) / 2, rel=1e-12)
    assert cost(10000, p=1) == 0.0
    plain = S.this_machine(1e9, alpha, beta)  # the presets' way: the formula everywhere
    assert plain.collective_time("allreduce", 100000, 2, alpha, beta) == \
        S.ring_allreduce_time(100000, 2, alpha, beta)


def test_tensor_parallel_allreduces_cost_the_measured_call():
    """A block of width 64, 4 rows of 16 tokens in 16-bit: 8,192 bytes, between the table's
    1,000 and 100,000; 3 blocks x 4 allreduces; ZeRO-3's 3 calls cost 1.5 allreduces."""
    spec = S.GPTSpec(8, 64, 4, 3, 16, blocks_only=True)
    hw = S.this_machine(1e9, 1e-5, 1e-9, measured=H.allreduce_table(NET_ROWS))
    one = H.interpolate(NET_ROWS_MPI_2, 4 * 16 * 64 * 2)
    assert S.predict(spec, hw, tp=2, global_batch=4)["tp_comm_s"] == pytest.approx(12 * one)
    mlp = S.MLPSpec((100, 125))  # 12,625 values: 50,500 bytes in float32
    zero3 = S.predict(mlp, hw, dp=2, global_batch=4, dtype_bytes=4, zero=3)["dp_comm_s"]
    assert zero3 == pytest.approx(1.5 * H.interpolate(NET_ROWS_MPI_2, 50500), rel=1e-12)


def test_this_machine_reads_the_allreduces_unless_alpha_or_beta_is_given(tmp_path):
    fields = ["kind", "algo", "ranks", "bytes", "seconds", "alpha", "beta"]
    with open(tmp_path / "net.csv", "w") as f:
        f.write(",".join(fields) + "\n" + "".join(
            ",".join(str(dict(r, alpha="5e-6", beta="1e-10")[k]) for k in fields) + "\n"
            for r in [NET_ROWS[-1]] + NET_ROWS[:-1]))
    (tmp_path / "flops.csv").write_text("ranks,computing,gflops_per_rank\n1,1,10\n")
    hw = H.measured_machine(folder=tmp_path)
    assert hw.measured == H.allreduce_table(NET_ROWS) and hw.tp_alpha == 5e-6
    assert H.measured_machine(alpha=0.0, folder=tmp_path).measured is None
    assert H.measured_machine(flops=1e9, folder=tmp_path).measured == hw.measured


def test_memory_follows_korthikanti_and_zero():
    spec = S.GPTSpec(50, 64, 4, 2, 32)
    s, b, h, a = 32, 4, 64, 4
    block = nn.Block(h, a)
    assert spec.stash_bytes(block, b, 1, 2) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert spec.stash_bytes(block, b, 2, 2) == pytest.approx(
        s * b * h * (10 + 24 / 2 + 5 * a * s / (h * 2)))
    plain = S.predict(spec, HW, dp=4, global_batch=16)
    zero = S.predict(spec, HW, dp=4, global_batch=16, zero=1)
    assert zero["mem_optimizer_bytes"] == pytest.approx(plain["mem_optimizer_bytes"] / 4)


def test_gpt3_parameter_count():
    """h V + L (12 h^2 + 13 h) + 2 h, plus the learned positions (s h) of this GPT."""
    g = S.GPT3
    table = S.layer_table(g, 1)
    total = sum(r["params"] for r in table)
    h, L, V = g.d_model, g.n_layers, g.vocab
    # the head here has its own matrix and bias (no weight tying): + h V + V
    assert total == h * V + g.seq_len * h + L * (12 * h * h + 13 * h) + 2 * h + h * V + V


def test_cli_prints_a_prediction(capsys):
    S.main(["--tp", "2", "--pp", "2", "--micro-batches", "4"])
    out = capsys.readouterr().out
    assert "predicted step" in out and "bubble" in out and "memory per rank" in out


def test_mixed_precision_adam_holds_16_bytes_per_parameter():
    """ZeRO (Rajbhandari et al. 2020): 2 + 2 + 12 bytes per parameter; stage 1 divides the 12."""
    spec = S.GPTSpec(50, 64, 4, 2, 32)
    n = sum(r["params"] for r in S.layer_table(spec, 1))
    plain = S.predict(spec, HW, dp=4, global_batch=16, dtype_bytes=2)
    state = sum(plain[f"mem_{k}_bytes"] for k in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * n)
    zero = S.predict(spec, HW, dp=4, global_batch=16, dtype_bytes=2, zero=1)
    assert zero["mem_optimizer_bytes"] == pytest.approx(12 * n / 4)


def _end(timeline):
    return max(end for events in timeline for _, _, end in events)


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_shared_replay_with_a_core_per_rank_is_the_plain_replay(name):
    lists = schedules.schedule(name, 3, 4)
    plain = schedules.simulate(lists, [1.0, 1.5, 1.0], [2.0, 3.0, 2.0], 0.25)
    shared = S.shared_replay(lists, [1.0, 1.5, 1.0], [2.0, 3.0, 2.0], [0.0] * 3, 0.25,
                             {1: 1.0, 2: 1.0, 3: 1.0})
    assert _end(shared) == pytest.approx(_end(plain), rel=1e-12)


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_shared_replay_on_one_core_serialises_the_work(name):
    """One core for two stages: whatever the schedule, the step takes all the compute one
    after the other (naive never computes on both stages at once, so it is unchanged)."""
    lists = schedules.schedule(name, 2, 4)
    one_core = {1: 1.0, 2: 0.5}
    shared = S.shared_replay(lists, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 0.0,
                             one_core)
    assert _end(shared) == pytest.approx(2 * 4 * (1.0 + 2.0), rel=0.02)
    plain = schedules.simulate(lists, 1.0, 2.0)
    if name != "naive":
        assert _end(plain) < 0.7 * _end(shared)


def test_shared_replay_counts_a_stage_as_its_group_of_ranks():
    """Stages of 2 ranks each (say DP 2): 2 stages computing at once are 4 ranks."""
    lists = schedules.schedule("gpipe", 2, 4)
    share = {1: 1.0, 2: 1.0, 3: 2 / 3, 4: 0.5}  # two cores
    shared = S.shared_replay(lists, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 0.0,
                             share, group=2)
    assert _end(shared) == pytest.approx(24.0, rel=0.02)  # as the one-core case above


def test_predict_with_a_share_table_slows_only_what_runs_at_once():
    spec = S.MLPSpec((256,) * 9)
    hw = S.this_machine(1e10, 1e-6, 1e-10)
    kw = dict(pp=4, global_batch=64, n_micro=1, schedule="naive", dtype_bytes=4)
    alone = S.predict(spec, hw, **kw)["step_s"]
    table = {1: 1.0, 2: 1.0, 3: 2 / 3, 4: 0.5}
    # naive, one micro-batch: one stage computes at a time, so sharing costs nothing
    assert S.predict(spec, hw, compute_share=table, **kw)["step_s"] == pytest.approx(alone)
    # an even share of 0.5 at every moment would double it
    assert S.predict(spec, hw, compute_share=0.5, **kw)["step_s"] > 1.9 * alone


def test_stage_share_replays_single_rank_stages_and_leaves_groups_in_lockstep():
    """Stages of one rank replay at the mean speed (``stage_share``); stages of dp*tp ranks
    keep the lockstep table (``compute_share``), whatever stage_share says."""
    spec = S.MLPSpec((256,) * 9)
    hw = S.this_machine(1e10, 0.0, 0.0)
    lockstep = {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5}
    mean = {1: 1.0, 2: 1.0, 3: 2 / 3, 4: 0.5}
    kw = dict(global_batch=64, n_micro=8, schedule="1f1b", dtype_bytes=4,
              compute_share=lockstep)
    pp4 = {name: S.predict(spec, hw, pp=4, stage_share=t, **kw)["step_s"]
           for name, t in (("lockstep", None), ("mean", mean), ("lockstep again", lockstep))}
    assert pp4["mean"] < 0.99 * pp4["lockstep"]  # 3 stages at once go faster at 2/3
    assert pp4["lockstep again"] == pytest.approx(pp4["lockstep"], rel=1e-12)
    grouped = [S.predict(spec, hw, dp=2, pp=2, stage_share=t, **kw)["step_s"]
               for t in (None, {k: 1.0 for k in mean})]
    assert grouped[0] == pytest.approx(grouped[1], rel=1e-12)


def test_zero1_shards_the_optimizer_update():
    spec = S.MLPSpec((256, 256, 256))
    hw = S.this_machine(1e10, 0.0, 0.0, update_per_param=1e-8)
    plain, zero = (S.predict(spec, hw, dp=4, global_batch=64, dtype_bytes=4, zero=z)["step_s"]
                   for z in (0, 1))
    n = 2 * (256 * 256 + 256)
    assert plain - zero == pytest.approx(n * 1e-8 * (1 - 1 / 4), rel=1e-9)


def test_zero3_adds_two_allgathers_and_a_reduce_scatter_per_layer_and_micro_batch():
    """The MLP's 2 layers of 65,792 values in float32 over 4 ranks, 2 micro-batches: 3 calls
    of (d-1) alpha + (d-1)/d n beta per layer and micro-batch, in place of one allreduce."""
    spec, alpha, beta = S.MLPSpec((256, 256, 256)), 1e-5, 1e-9
    hw = S.this_machine(1e10, alpha, beta)
    two, three = (S.predict(spec, hw, dp=4, global_batch=64, n_micro=2, dtype_bytes=4, zero=z)
                  for z in (2, 3))
    n = 4 * (256 * 256 + 256)
    assert two["dp_comm_s"] == pytest.approx(6 * alpha + 1.5 * 2 * n * beta, rel=1e-12)
    assert three["dp_comm_s"] == pytest.approx(2 * 2 * 3 * (3 * alpha + 0.75 * n * beta))
    assert three["step_s"] - two["step_s"] == pytest.approx(
        three["dp_comm_s"] - two["dp_comm_s"], rel=1e-9)


@pytest.mark.parametrize("dp", [1, 4])
def test_zero3_gather_work_is_every_layers_values_twice_per_micro_batch_at_any_dp(dp):
    """ZeRO-3's own work: 2 gathers per layer and micro-batch of the full layer, whatever d."""
    spec = S.MLPSpec((256, 256, 256))
    base, work = (S.predict(spec, S.this_machine(1e10, 1e-5, 1e-9, zero3_per_value=v), dp=dp,
                            global_batch=64, n_micro=2, dtype_bytes=4, zero=3)
                  for v in (0.0, 3e-9))
    n = 2 * (256 * 256 + 256)
    assert work["step_s"] - base["step_s"] == pytest.approx(2 * 2 * n * 3e-9, rel=1e-9)
    assert work["compute_s"] - base["compute_s"] == pytest.approx(2 * 2 * n * 3e-9, rel=1e-9)
    two = S.predict(spec, S.this_machine(1e10, 1e-5, 1e-9, zero3_per_value=3e-9), dp=dp,
                    global_batch=64, n_micro=2, dtype_bytes=4, zero=2)
    assert two["step_s"] == pytest.approx(S.predict(spec, S.this_machine(1e10, 1e-5, 1e-9), dp=dp,
                                                    global_batch=64, n_micro=2, dtype_bytes=4,
                                                    zero=2)["step_s"])  # ZeRO-2: no gathers


def test_zero3_cost_is_the_one_rank_difference_over_the_values_gathered(tmp_path):
    from mpipar.tools.bench import memory as M

    rows = [dict(experiment="zero", ranks=p, config=c, params="1000", step_ms=str(t))
            for p, c, t in ((1, "ZeRO-0", 50.0), (1, "ZeRO-3", 53.0), (2, "ZeRO-3", 99.0),
                            (1, "ZeRO-2", 70.0))]
    assert M.zero3_cost(rows) == pytest.approx(3e-3 / (2 * 1 * 1000), rel=1e-12)
    assert M.zero3_cost(rows[2:]) == 0.0  # no one-rank ZeRO-0 and ZeRO-3: no term
    (tmp_path / "memory_bench.csv").write_text("config,zero3_ns_per_value\nZeRO-0,1.5\n")
    assert H.zero3_cost(tmp_path) == pytest.approx(1.5e-9)
    assert H.zero3_cost(tmp_path / "absent") == 0.0


def test_selective_recomputation_adds_attention_core_and_keeps_the_rest():
    """GPT blocks of width 64 over 32 tokens, 4 rows: the backward runs attention's core (q k^T
    and p v, 4 b s^2 h FLOPs a block) once more; the stash loses the softmax term 5 a s/h only."""
    spec, b, s, h = S.GPTSpec(50, 64, 4, 2, 32), 4, 32, 64
    hw = S.this_machine(1e9, 0.0, 0.0)
    none, full, sel = (S.predict(spec, hw, global_batch=b, dtype_bytes=2, recompute=r)
                       for r in (False, "full", "selective"))
    assert sel["step_s"] - none["step_s"] == pytest.approx(2 * 4 * b * s * s * h / 1e9, rel=1e-9)
    assert none["step_s"] < sel["step_s"] < full["step_s"]
    assert none["mem_activations_bytes"] - sel["mem_activations_bytes"] == pytest.approx(
        2 * s * b * h * 5 * 4 * s / h)
    assert full["mem_activations_bytes"] < sel["mem_activations_bytes"]
    assert S.predict(spec, hw, global_batch=b, recompute=True)["step_s"] == full["step_s"]


@pytest.mark.parametrize("flags, says", [
    (["--tp", "0"], "argument --tp: expected a whole number > 0, got '0'"),
    (["--dp", "-2"], "argument --dp: expected a whole number > 0, got '-2'"),
    (["--pp", "0"], "argument --pp: expected a whole number > 0"),
    (["--micro-batches", "0"], "argument --micro-batches: expected a whole number > 0"),
    (["--batch-size", "-1"], "argument --batch-size: expected a whole number > 0"),
    (["--d-model", "0"], "argument --d-model: expected a whole number > 0"),
    (["--n-heads", "0"], "argument --n-heads"),
    (["--n-layers", "0"], "argument --n-layers"),
    (["--seq-len", "0"], "argument --seq-len"),
    (["--vocab", "0"], "argument --vocab"),
    (["--dtype-bytes", "0"], "argument --dtype-bytes"),
    (["--tp", "1.5"], "argument --tp: expected a whole number > 0, got '1.5'"),
    (["--flops", "0"], "argument --flops: expected a finite number > 0, got '0'"),
    (["--flops=-1e9"], "argument --flops: expected a finite number > 0"),
    (["--flops", "nan"], "argument --flops: expected a finite number > 0, got 'nan'"),
    (["--flops", "inf"], "argument --flops: expected a finite number > 0, got 'inf'"),
    (["--alpha=-1e-6"], "argument --alpha: expected a finite number >= 0"),
    (["--alpha", "nan", "--json"], "argument --alpha: expected a finite number >= 0"),
    (["--beta", "inf"], "argument --beta: expected a finite number >= 0"),
    (["--zero", "4"], "argument --zero: invalid choice: 4"),
    (["--n-heads", "5"], "--d-model 64 is not divisible by --n-heads 5"),
    (["--tp", "3"], "--tp 3 must divide the head count (4) and the hidden size (64)"),
    (["--pp", "5"], "--pp 5 stages but the model has only 4 layers"),
    (["--dp", "4", "--micro-batches", "4", "--batch-size", "8"],
     "--batch-size 8 cannot give every one of --dp 4 replicas x --micro-batches 4 a row"),
    (["--experts", "-1"], "argument --experts: expected a whole number >= 0, got '-1'"),
    (["--experts", "4", "--top-k", "5"], "--top-k 5 of --experts 4: each token goes to 1 to E"),
    (["--ep", "2", "--dp", "2"], "--ep 2 splits experts: give --experts E"),
    (["--experts", "6", "--dp", "4", "--ep", "4"], "--ep 4 must divide the --dp 4 replicas "
                                                    "and the --experts 6"),
    (["--experts", "8", "--dp", "4", "--ep", "3"], "--ep 3 must divide the --dp 4 replicas"),
    (["--experts", "8", "--tp", "2"], "--experts takes no --tp"),
    (["--experts", "8", "--pp", "2"], "--experts with --pp needs --schedule gpipe"),
    (["--experts", "8", "--dp", "4", "--ep", "4", "--imbalance", "0.5"],
     "--imbalance 0.5 is below 1"),
    (["--experts", "8", "--imbalance", "1.5"], "--imbalance 1.5 needs --ep above 1"),
    (["--experts", "8", "--dp", "4", "--ep", "4", "--imbalance", "4.5"],
     "--imbalance 4.5 is above 4: the busiest of 4 ranks, holding 2 expert(s), gets at most 2 "
     "of each token's 2 pairs"),
    (["--cp", "4", "--seq-len", "30"], "--seq-len 30 does not cut into the 4 chunks of "
                                       "--cp-algo ring on --cp 4"),
    (["--cp", "4", "--cp-algo", "zigzag", "--seq-len", "36"],
     "--seq-len 36 does not cut into the 8 chunks of --cp-algo zigzag on --cp 4"),
    (["--cp", "8", "--cp-algo", "ulysses"], "--cp-algo ulysses needs --n-heads 4 divisible"),
    (["--cp", "2", "--experts", "4"], "--cp takes no --experts"),
    (["--cp", "0"], "argument --cp: expected a whole number > 0, got '0'"),
    (["--pp", "2", "--micro-batches", "3", "--schedule", "dualpipev", "--n-layers", "6"],
     "dualpipev needs at least 2 x 2 = 4 micro-batches, got 3"),
    (["--pp", "4", "--micro-batches", "8", "--schedule", "zb-v"],
     "--pp 4 stages x 2 chunks = 8 model pieces but the model has only 4 layers"),
    (["--pp", "4", "--micro-batches", "6", "--schedule", "interleaved", "--n-layers", "6"],
     "interleaved 1F1B needs the micro-batches (6) to be a multiple of the stages (4)"),
    (["--pp", "2", "--chunks", "2"], "schedule 1f1b runs one model chunk per stage, not 2"),
    (["--pp", "2", "--chunks", "3", "--schedule", "zb-v", "--n-layers", "6"],
     "schedule zb-v runs two model chunks per stage, not 3"),
    (["--pp", "2", "--warmup", "lean"], "--warmup is interleaved 1F1B's, not --schedule 1f1b's"),
    (["--experts", "4", "--dp", "4", "--ep", "4", "--imbalance", "2.5"],
     "--imbalance 2.5 is above 2: the busiest of 4 ranks, holding 1 expert(s), gets at most 1"),
])
def test_cli_refuses_impossible_input_with_one_error_line(flags, says, capsys):
    """Zero, negative or non-finite numbers once gave negative memory, NaN in the JSON or a
    traceback; each is refused before predicting (exit 2), in one line on stderr: argparse's
    usage block once came before it."""
    with pytest.raises(SystemExit) as exit_info:
        S.main(flags)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.startswith("error: ") and "\n" not in err.strip(), err
    assert says in err and err.strip().endswith("(see --help)"), err


def test_cli_accepts_free_links_and_the_lesson_commands(capsys):
    """alpha = beta = 0 is an ideal machine, not an error; the lesson's commands still run."""
    S.main(["--alpha", "0", "--beta", "0", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["step_s"] > 0 and r["mem_total_bytes"] > 0
    S.main("--preset gpt3 --hardware a100 --dp 8 --tp 8 --pp 16 --micro-batches 64 "
           "--batch-size 1536 --dtype-bytes 2 --zero 1 --recompute".split())
    assert "predicted step" in capsys.readouterr().out


def _cli_json(flags, capsys):
    S.main([*flags, "--alpha", "1e-5", "--beta", "1e-9", "--flops", "1e9", "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_cli_zero_3_holds_16_bytes_a_parameter_over_the_replicas(dp, capsys):
    """Adam in float32: 4 + 4 + 8 bytes a parameter, each sharded over d ranks by ZeRO-3 (d = 1
    is legal and shards nothing); ZeRO-2 keeps the parameters whole, ZeRO-0 everything."""
    n = sum(p.size for p in S.GPTSpec(94, 64, 4, 2, 32).model().parameters())  # the corpus
    state = ("params", "grads", "optimizer")
    flags = ["--dp", str(dp), "--dtype-bytes", "4"]
    three, two, none = (_cli_json(flags + ["--zero", z], capsys) for z in "320")
    assert sum(three[f"mem_{k}_bytes"] for k in state) == pytest.approx(16 * n / dp, rel=1e-12)
    assert sum(two[f"mem_{k}_bytes"] for k in state) == pytest.approx(4 * n + 12 * n / dp)
    assert sum(none[f"mem_{k}_bytes"] for k in state) == pytest.approx(16 * n)
    assert (three["dp_comm_s"] > 0) == (dp > 1)


def test_cli_recompute_takes_full_or_selective_and_alone_means_full(capsys):
    spec, hw = S.GPTSpec(94, 64, 4, 2, 32), S.this_machine(1e9, 1e-5, 1e-9)
    runs = {what: _cli_json(flags, capsys) for what, flags in (
        ("none", []), ("alone", ["--recompute"]), ("full", ["--recompute", "full"]),
        ("selective", ["--recompute", "selective"]))}
    for what, r in runs.items():
        want = S.predict(spec, hw, dtype_bytes=4, recompute=what != "none" and (
            "selective" if what == "selective" else True))
        assert (r["step_s"], r["mem_activations_bytes"]) == pytest.approx(
            (want["step_s"], want["mem_activations_bytes"]), rel=1e-12), what
    assert runs["none"]["step_s"] < runs["selective"]["step_s"] < runs["full"]["step_s"]
    with pytest.raises(SystemExit) as exit_info:
        S.main(["--recompute", "some"])
    assert exit_info.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err
    S.main(["--dp", "2", "--zero", "3", "--recompute", "selective"])
    assert "ZeRO-3; recompute selective" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [
    (["--tp", "-2"], "error: argument --tp: expected a whole number > 0, got '-2' (see --help)"),
    (["--n-heads", "5"], "error: --d-model 64 is not divisible by --n-heads 5 (see --help)"),
    (["--hardware", "tpu"], "error: argument --hardware: invalid choice: 'tpu'"),
    (["--bogus"], "error: unrecognized arguments: --bogus (see --help)"),
])
def test_cli_refusal_exits_2_from_the_command_line_in_one_line(flags, says):
    """The refusal is the only line on stderr, as the trainers' are: no usage block."""
    out = subprocess.run([sys.executable, "-m", "mpipar.tools.simulate", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert "Traceback" not in out.stderr and "\n" not in out.stderr.strip(), out.stderr
    assert out.stderr.startswith(says), out.stderr
