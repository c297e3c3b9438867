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
differences agree. The batch is the global batch: f and P are over every token of the step.
So a forward only records its routing (per micro-batch), and :func:`balance`, called after the
step's last forward and before its first backward, adds the records up (over the ranks too,
in :mod:`mpipar.expert_parallel`) into aux and f: the serial trainer calls it after its one
forward. Computing aux per micro-batch, or per rank, would give another (wrong) loss.

Parameters are named ``blocks.L.mlp.router.W`` and ``blocks.L.mlp.experts.e.fc.W`` (and
``.b``, ``.proj.W``, ``.proj.b``), so each expert starts from its own seeded values.
"""

from mpipar.engine import backend as B
from mpipar.engine import nn


class MoE(nn.SplitBackward):
    """Router, top-k and the experts over the rows of x (B, T, C) -> (B, T, C).

    ``held``: the expert indices this layer holds (all E, serially; a rank's share in
    :mod:`mpipar.expert_parallel`, which changes :meth:`run_experts` and
    :meth:`experts_backward` only). After the forwards of a step, :func:`balance` turns their
    routing counts into ``aux``, this layer's load-balancing loss, and ``tokens_per_expert``."""

    def __init__(self, d_model, n_experts, top_k, aux_coef, held=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top-k {top_k} of {n_experts} experts: need 1 <= k <= E")
        self.router = nn.Linear(d_model, n_experts, bias=False, std=0.02)
        held = range(n_experts) if held is None else held
        self.experts = nn.Sequential([(str(e), nn.FeedForward(d_model)) for e in held])
        self.n_experts, self.k, self.coef = n_experts, top_k, aux_coef
        self.aux, self.tokens_per_expert = 0.0, None
        self.seen = {}  # micro_id -> [routing counts (E), sum of p (E), tokens] of its forward
        self.f = self.n_tokens = None  # the step's shares f_e and its token count, by balance
        self.loss_scale = 1.0  # fp16's, by balance: the aux gradient is scaled as the loss's

    def held(self):
        """(expert index, expert) of the experts this layer holds."""
        return [(int(name), expert) for name, expert in self.experts.layers]

    def forward(self, x, micro_id=0):
        h = x.reshape(-1, x.shape[-1])  # (N, C): every token a row
        logits = self.router.forward(h, micro_id)
        p = B.xp.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        chosen = B.xp.argsort(-p, axis=1, kind="stable")[:, :self.k]  # (N, k): ties to lower e
        rows = [B.xp.nonzero(chosen == e)[0] for e in range(self.n_experts)]  # each token once
        out, state = self.run_experts(h, p, rows, micro_id)
        counts = B.xp.asarray([len(r) for r in rows], dtype=p.dtype)
        self.seen[micro_id] = B.xp.concatenate([counts, p.sum(axis=0),
                                                B.xp.asarray([h.shape[0]], dtype=p.dtype)])
        self.save(micro_id, p, state)
        return out.reshape(x.shape)

    def run_experts(self, h, p, rows, micro_id):
        """sum over the chosen experts e of p_e * expert_e(x), for every row of h; ``rows[e]``:
        the rows routed to e. Returns it and what :meth:`experts_backward` needs."""
        out, ys = B.xp.zeros_like(h), {}
        for e, expert in self.held():
            ys[e] = expert.forward(h[rows[e]], micro_id)
            out[rows[e]] += p[rows[e], e:e + 1] * ys[e]
        return out, (rows, ys)

    def experts_backward(self, d, p, state, micro_id):
        """(d h, d p) through the experts, from d out (N, C)."""
        rows, ys = state
        dh, dp = B.xp.zeros_like(d), B.xp.zeros_like(p)
        for e, expert in self.held():
            dp[rows[e], e] = (d[rows[e]] * ys[e]).sum(axis=1)  # d out / d p_e = expert_e(x)
            dh[rows[e]] += expert.backward_input(p[rows[e], e:e + 1] * d[rows[e]], micro_id)
        return dh, dp

    def backward_input(self, dout, micro_id=0):
        p, state = self.saved(micro_id)
        d = dout.reshape(-1, dout.shape[-1])
        dh, dp = self.experts_backward(d, p, state, micro_id)
        dp += self.loss_scale * self.coef * self.n_experts * self.f / self.n_tokens  # aux, via P_e
        dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))  # softmax's backward
        dh += self.router.backward_input(dlogits, micro_id)
        return dh.reshape(dout.shape)

    def settle(self, add=None, n_micro=None, loss_scale=1.0):
        """The load-balancing loss of the step's forwards (every micro-batch): their counts,
        sums of p and token counts, added over ranks by ``add`` (an in-place sum of one array;
        None: this process saw the whole batch). ``n_micro``: the forwards there must have been
        (a schedule that starts a backward earlier would settle on part of the batch).
        ``loss_scale``: fp16's, by which the backward multiplies the aux loss's gradient as it
        does the cross-entropy's. Returns aux."""
        if n_micro is not None and len(self.seen) != n_micro:
            raise RuntimeError(f"the load-balancing loss needs the routing of all {n_micro} "
                               f"micro-batches before the first backward, but {len(self.seen)} "
                               "forwards ran: use a schedule with every forward first (GPipe)")
        stats = sum(self.seen[m] for m in sorted(self.seen))  # micro-batches in order
        self.seen, self.loss_scale = {}, loss_scale
        if add is not None:
            add(stats)
        e = self.n_experts
        counts, p_sum, self.n_tokens = stats[:e], stats[e:2 * e], float(stats[2 * e])
        self.f = counts / (self.k * self.n_tokens)
        self.aux = float(self.coef * e * (self.f * p_sum / self.n_tokens).sum())
        self.tokens_per_expert = counts.astype(int)
        return self.aux


def gpt(vocab, d_model, n_heads, n_layers, seq_len, n_experts, top_k, aux_coef):
    """The GPT of :func:`mpipar.engine.nn.GPT` with an :class:`MoE` as every block's
    feed-forward."""
    model = nn.GPT(vocab, d_model, n_heads, n_layers, seq_len)
    for name, block in model.layers:
        if name.startswith("blocks."):
            block.mlp = MoE(d_model, n_experts, top_k, aux_coef)
    return model


def balance(model, add=None, n_micro=None, loss_scale=1.0):
    """The load-balancing losses of the step's forwards, summed over the model's MoE layers
    (:meth:`MoE.settle`; ``add`` sums each layer's routing over the ranks): call it after the
    step's last forward and before its first backward, which needs the step's shares f_e."""
    return sum(m.settle(add, n_micro, loss_scale) for m in model.modules()
               if isinstance(m, MoE))
