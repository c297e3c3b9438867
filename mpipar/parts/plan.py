"""Pure planning: per-layer forward FLOPs and output shapes, the balanced partition into
stages, stage bounds, about how much activation memory a step needs (to refuse a batch that
cannot fit before any rank starts), whether a model splits over t tensor-parallel ranks, and
each model's default run (:data:`DEFAULTS`).

The layers in :mod:`mpipar.engine.nn` know how to run forward and backward and nothing else; what a
layer costs is read here from its parameters' shapes, one rule per layer type. The pipeline
(:func:`plan_stages`) cuts its stages with these numbers and the cost model
(:mod:`mpipar.tools.simulate`) prices them, so this module imports no MPI: the cost model runs on a
laptop without one.

FLOPs count a multiply-add as 2 and only the forward pass (backward is about twice that). A
tensor-parallel layer is counted on one rank's shard: its widths come from the shapes of the
parameters it holds (``proj.W.shape[0]`` is C for the dense attention, C/t for a rank's heads),
so the same rules serve the dense and the parallel model.

Shapes: B batch, T sequence length, C model width, V vocabulary.
"""

import math
import os

import numpy as np

from mpipar.engine import moe, nn

FREE = (nn.ReLU, nn.GELU, nn.Embedding, nn.GPTEmbedding)  # elementwise or a lookup: ~0 FLOPs
DEFAULTS = {  # per model, what a run takes unless told: trains well within a minute on 2 cores
    "mlp": dict(steps=300, batch_size=64, lr=0.05, optim="sgd"),
    "gpt": dict(steps=250, batch_size=32, lr=3e-3, optim="adam"),
}


# ----------------------------------------------------------------------------- FLOPs and shapes
def flops(layer, x_shape):
    """Estimated forward FLOPs of one layer for an input of shape x_shape."""
    x_shape = tuple(x_shape)
    if isinstance(layer, nn.Linear):
        return 2 * int(math.prod(x_shape)) * layer.W.shape[1]  # (N, d_in) @ (d_in, d_out)
    if isinstance(layer, nn.LayerNorm):
        return 8 * int(math.prod(x_shape))  # mean, centre, variance, scale: a few passes over x
    if isinstance(layer, nn.CausalSelfAttention):
        Bn, T, _ = x_shape
        local = layer.proj.W.shape[0]  # width of the heads computed here: C, or C/t on a rank
        core = 4 * Bn * T * T * local  # q k^T and p v: (B, H, T, D) x (B, H, D, T), twice
        return flops(layer.qkv, x_shape) + flops(layer.proj, x_shape[:-1] + (local,)) + core
    if isinstance(layer, nn.FeedForward):
        return flops(layer.fc, x_shape) + flops(layer.proj, out_shape(layer.fc, x_shape))
    if isinstance(layer, moe.MoE):  # the router, then k experts a token (balanced, on average)
        one = flops(layer.experts.layers[0][1], x_shape)  # one expert on every token
        return flops(layer.router, x_shape) + layer.k * one
    if isinstance(layer, nn.Block):  # the LayerNorms keep the shape, so all four see x_shape
        return sum(flops(m, x_shape) for m in (layer.ln1, layer.attn, layer.ln2, layer.mlp))
    if isinstance(layer, nn.GPTHead):
        return flops(layer.ln, x_shape) + flops(layer.out, x_shape)
    if isinstance(layer, FREE):
        return 0
    raise TypeError(f"mpipar.parts.plan has no FLOP rule for {type(layer).__name__}: add one to "
                    f"plan.flops (and to out_shape if it changes the shape)")


def out_shape(layer, shape):
    """The shape of a layer's output for an input of this shape."""
    shape = tuple(shape)
    if isinstance(layer, nn.Linear):
        return shape[:-1] + (layer.W.shape[1],)  # (..., d_out)
    if isinstance(layer, nn.GPTEmbedding):
        return shape + (layer.pos.shape[1],)  # ids (B, T) -> (B, T, C)
    if isinstance(layer, nn.GPTHead):
        return out_shape(layer.out, shape)  # (B, T, V), or (B, T, V/t) on a rank
    return shape  # activations, LayerNorm, attention, feed-forward, block


def layer_flops(model, x_shape):
    """Forward FLOPs of each layer of an nn.Sequential for an input of shape x_shape: the
    costs a pipeline is cut by."""
    out, shape = [], tuple(x_shape)
    for _, layer in model.layers:
        out.append(flops(layer, shape))
        shape = out_shape(layer, shape)
    return out


# ----------------------------------------------------------------------------- stages
def partition(costs, n_stages):
    """Layers per stage: the contiguous cut into n_stages non-empty stages whose most expensive
    stage is as cheap as possible; among such cuts, the one with the most even layer counts.

    Two small dynamic programmes over (stages, layers), O(p n^2): the first finds the least
    possible maximum stage cost, the second the least possible maximum layer count under it.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} non-empty stages")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))
    inf = float("inf")

    def solve(size):
        """best[k][j]: least max size(i, j) over cuts of layers[:j] into k stages; choice: i."""
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, n_stages + 1):
            for j in range(k, n + 1):
                for i in range(k - 1, j):
                    value = max(best[k - 1][i], size(i, j))
                    if value < best[k][j]:
                        best[k][j], choice[k][j] = value, i
        return best, choice

    best, _ = solve(lambda i, j: prefix[j] - prefix[i])
    limit = best[n_stages][n] * (1 + 1e-12)
    _, choice = solve(lambda i, j: (j - i) if prefix[j] - prefix[i] <= limit else inf)
    cuts, j = [n], n
    for k in range(n_stages, 0, -1):
        j = choice[k][j]
        cuts.append(j)
    cuts = cuts[::-1]
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def stage_bounds(counts):
    """[(first layer, end layer)] per stage from layer counts."""
    ends = np.cumsum(counts).tolist()
    return list(zip([0] + ends[:-1], ends))


def plan_stages(task, n_stages, n_micro, partition_arg=None):
    """The layer counts per stage (as ``--partition`` gives them, else balanced by FLOPs) and
    the per-layer forward FLOPs of one micro-batch: (counts, flops). The runner has refused
    what cannot be cut (mpipar.runner.cli.MODEL_RULES)."""
    model = task.build_model()
    rows = -(-task.args.batch_size // n_micro)  # the first (largest) micro-batch
    flops = layer_flops(model, task.input_shape(rows))
    if partition_arg:
        return [int(v) for v in partition_arg.split(",")], flops
    return partition(flops, n_stages), flops


def activation_bytes(a):
    """About how many bytes of activations one step keeps for its backward: for the GPT,
    s b h (34 + 5 a s / h) per block (Korthikanti et al. 2022, eq. 1, counted at 2 bytes a
    value, scaled to ours) and the logits; for the MLP, a few copies of every layer's output."""
    w = 8 if a.dtype == "float64" else 4
    if a.model == "mlp":
        need = 4 * a.batch_size * sum(a.sizes) * w
    else:
        b, s, h = a.batch_size, a.seq_len, a.d_model
        need = a.n_layers * s * b * h * (34 + 5 * a.n_heads * s / h) * w / 2 + 3 * b * s * 128 * w
    a.need_gib, a.have_gib = need / 2**30, memory_bytes() / 2**30
    return need


def memory_bytes():
    """This machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_size_problem(a, t, vocab=None):
    """Why this model cannot be split over t tensor-parallel ranks (one sentence), or None.
    The vocabulary is split into near-equal blocks, so it only needs at least t entries."""
    def not_divisible(what, n, fits=lambda v: True, ranks=None):
        """``fits``: what else a value must satisfy, ``ranks`` the rank counts that divide it
        and everything else: only what runs is named."""
        ok = lambda v: v % t == 0 and fits(v)  # noqa: E731
        below = next((v for v in range(n - 1, 0, -1) if ok(v)), None)
        above = next((v for v in range(n + 1, 4 * n + 4 * t) if ok(v)), None)
        near = [v for v in (below, above) if v is not None]
        return (f"{what} {n} is not divisible by the {t} tensor-parallel ranks; rank counts "
                f"that divide it: {', '.join(map(str, _divisors(ranks or n)))}"
                + (f" (or make it {' or '.join(map(str, near))} for {t} ranks)" if near else ""))

    if a.model == "gpt":
        if a.d_model % t:  # a head count must still divide it
            return not_divisible("the hidden size --d-model", a.d_model,
                                 lambda v: v % a.n_heads == 0, math.gcd(a.d_model, a.n_heads))
        if a.n_heads % t:  # and it must divide the hidden size
            return not_divisible("the head count --n-heads", a.n_heads,
                                 lambda v: a.d_model % v == 0)
        if vocab is not None and vocab < t:
            return (f"the vocabulary has {vocab} entries, fewer than the {t} tensor-parallel "
                    f"ranks; use at most {vocab} ranks")
        return None
    for i in range(0, len(a.sizes) - 2, 2):  # column-parallel layers split their output width
        if a.sizes[i + 1] % t:
            return not_divisible(f"--sizes entry {i + 1} (the output width of fc{i}, split by "
                                 f"columns)", a.sizes[i + 1])
    return None
