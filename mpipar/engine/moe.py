"""A mixture-of-experts feed-forward: a router sends each token to k of E expert FFNs.

    python -m mpipar.serial --model gpt --experts 4 --top-k 2

In a GPT with ``--experts E`` every block's feed-forward is an :class:`MoE`. For each token
(a row x of width C):

1. the router, a Linear(C, E) without bias, gives E logits; p = softmax(logits);
2. the token goes to the k experts of highest p (top-k; equal probabilities go to the lower
   expert index first, so the choice is deterministic), each a :class:`mpipar.engine.nn.
   FeedForward` of its own;
3. the output is sum over the chosen experts e of p_e * expert_e(x): weighted by the full
   softmax's probabilities (as the Switch Transformer weights its one expert), not
   renormalised over the k. No token is dropped: an expert takes every token sent to it, so
   the model's output depends on its parameters alone (no capacity, no batch composition).

Left alone, a router learns to send most tokens to a few experts. The load-balancing loss
(Switch Transformer, Fedus et al. 2021, arXiv:2101.03961, eq. 4) adds, per MoE layer,

    aux = coef * E * sum_e f_e * P_e

over the N tokens of the batch: f_e = (tokens routed to e) / (k N), the share of the routed
(token, expert) pairs that e got, and P_e = the mean of p_e over the tokens. Balanced routing
(f_e = P_e = 1/E) gives aux = coef. f is a count: constant between two routing changes, so
its derivative is zero and d aux / d p_e = coef * E * f_e / N for every token; finite
differences agree. The batch is the global batch: f and P are over every token of the step,
which :class:`MoE` sees at once in the serial trainer.

Parameters are named ``blocks.L.mlp.router.W`` and ``blocks.L.mlp.experts.e.fc.W`` (and
``.b``, ``.proj.W``, ``.proj.b``), so each expert starts from its own seeded values.
"""

from mpipar.engine import backend as B
from mpipar.engine import nn


class MoE(nn.SplitBackward):
    """Router, top-k and E experts over the rows of x (B, T, C) -> (B, T, C); after each
    forward, ``aux`` holds this layer's load-balancing loss and ``tokens_per_expert`` its
    routing counts."""

    def __init__(self, d_model, n_experts, top_k, aux_coef):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top-k {top_k} of {n_experts} experts: need 1 <= k <= E")
        self.router = nn.Linear(d_model, n_experts, bias=False, std=0.02)
        self.experts = nn.Sequential([(str(e), nn.FeedForward(d_model))
                                      for e in range(n_experts)])
        self.k, self.coef = top_k, aux_coef
        self.aux, self.tokens_per_expert = 0.0, None

    def forward(self, x, micro_id=0):
        h = x.reshape(-1, x.shape[-1])  # (N, C): every token a row
        n, n_experts = h.shape[0], len(self.experts.layers)
        logits = self.router.forward(h, micro_id)
        p = B.xp.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        chosen = B.xp.argsort(-p, axis=1, kind="stable")[:, :self.k]  # (N, k): ties to lower e
        out, routed = B.xp.zeros_like(h), []
        for e, (_, expert) in enumerate(self.experts.layers):
            rows = B.xp.nonzero(chosen == e)[0]  # the tokens sent to e, each at most once
            y = expert.forward(h[rows], micro_id)
            out[rows] += p[rows, e:e + 1] * y
            routed.append((rows, y))
        counts = B.xp.bincount(chosen.ravel(), minlength=n_experts)
        f = counts / (self.k * n)
        self.aux = float(self.coef * n_experts * (f * p.mean(axis=0)).sum())
        self.tokens_per_expert = counts
        self.save(micro_id, p, f, routed)
        return out.reshape(x.shape)

    def backward_input(self, dout, micro_id=0):
        p, f, routed = self.saved(micro_id)
        d = dout.reshape(-1, dout.shape[-1])
        n, n_experts = p.shape
        dh, dp = B.xp.zeros_like(d), B.xp.zeros_like(p)
        for e, ((_, expert), (rows, y)) in enumerate(zip(self.experts.layers, routed)):
            dp[rows, e] = (d[rows] * y).sum(axis=1)  # d out / d p_e = expert_e(x)
            dh[rows] += expert.backward_input(p[rows, e:e + 1] * d[rows], micro_id)
        dp += self.coef * n_experts * f / n  # the load-balancing loss, through P_e
        dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))  # softmax's backward
        dh += self.router.backward_input(dlogits, micro_id)
        return dh.reshape(dout.shape)


def gpt(vocab, d_model, n_heads, n_layers, seq_len, n_experts, top_k, aux_coef):
    """The GPT of :func:`mpipar.engine.nn.GPT` with an :class:`MoE` as every block's
    feed-forward."""
    model = nn.GPT(vocab, d_model, n_heads, n_layers, seq_len)
    for name, block in model.layers:
        if name.startswith("blocks."):
            block.mlp = MoE(d_model, n_experts, top_k, aux_coef)
    return model


def aux_loss(model):
    """The load-balancing losses of the last forward, summed over the model's MoE layers."""
    return sum(m.aux for m in model.modules() if isinstance(m, MoE))
