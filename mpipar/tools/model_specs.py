"""The models the cost model (:mod:`mpipar.tools.simulate`) prices, as tables of their layers:
each layer's forward FLOPs for a micro-batch, its parameters, its tensor-parallel allreduces and
the activation bytes it stashes; and the layouts a model cannot take (:func:`layout_problem`).
Only shapes: no parameter is ever allocated."""

from dataclasses import asdict, dataclass

from mpipar.engine import moe, nn
from mpipar.parts import plan, schedules


@dataclass
class GPTSpec:
    """A GPT's sizes; ``blocks_only`` models just the transformer blocks (no embedding, head)."""

    vocab: int
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    blocks_only: bool = False
    experts: int = 0  # a mixture of E experts as every block's feed-forward (0: the dense one)
    top_k: int = 1

    def __str__(self):
        """The fields as the dataclass shows them, the experts' only where there are some."""
        shown = {k: v for k, v in asdict(self).items()
                 if self.experts or k not in ("experts", "top_k")}
        return "GPTSpec(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def model(self, dense=False):
        """The layer list (shapes only: parameters are never allocated); ``dense``: with the
        plain feed-forward even where the spec has experts."""
        if self.blocks_only:
            model = nn.Sequential((f"blocks.{i}", nn.Block(self.d_model, self.n_heads))
                                  for i in range(self.n_layers))
        else:
            model = nn.GPT(self.vocab, self.d_model, self.n_heads, self.n_layers, self.seq_len)
        for name, block in model.layers:
            if self.experts and not dense and name.startswith("blocks."):
                block.mlp = moe.MoE(self.d_model, self.experts, self.top_k, 0.0)
        return model

    def input_shape(self, rows):
        return (rows, self.seq_len, self.d_model) if self.blocks_only else (rows, self.seq_len)

    def message_bytes(self, rows, dtype_bytes):
        """One activation (or gradient) between stages, and one tensor-parallel allreduce."""
        return rows * self.seq_len * self.d_model * dtype_bytes

    def stash_bytes(self, layer, rows, tp, dtype_bytes, recompute=False, cp=1, cp_algo="ring"):
        if not isinstance(layer, nn.Block):
            return 0.0
        if recompute and recompute != "selective":  # full: only the block's input is kept
            return self.message_bytes(rows, dtype_bytes) / cp
        # Korthikanti et al. 2022: s b h (10 + 24/t + 5 a s / (h t)) bytes in 16-bit; selective
        # recomputation drops the last term, attention's softmax part (their Sec. 5)
        s, h, a = self.seq_len, self.d_model, self.n_heads
        core = 0 if recompute == "selective" else 5 * a * s / (h * tp)
        if cp > 1 and cp_algo != "ulysses":  # the ring keeps a log-sum-exp, not the s x s part
            core = 0
        # with experts, each of a token's k routed copies keeps a feed-forward's 19 s b h
        routed = 19 * (self.top_k - 1) if self.experts else 0
        return s * rows * h * (10 + 24 / tp + core + routed) * dtype_bytes / 2 / cp


@dataclass
class MLPSpec:
    """An MLP of the given widths (Linear layers with ReLU between)."""

    sizes: tuple

    def model(self, dense=True):
        return nn.MLP(list(self.sizes))

    def input_shape(self, rows):
        return (rows, self.sizes[0])

    def message_bytes(self, rows, dtype_bytes):
        return rows * max(self.sizes[1:-1] or self.sizes) * dtype_bytes

    def stash_bytes(self, layer, rows, tp, dtype_bytes, recompute=False, cp=1, cp_algo="ring"):
        if isinstance(layer, nn.Linear):  # a Linear keeps its input for dW = x^T dout
            return rows * layer.W.shape[0] * dtype_bytes / tp
        return 0.0

GPT3 = GPTSpec(vocab=50257, d_model=12288, n_heads=96, n_layers=96, seq_len=2048)  # 175B


# tensor-parallel Allreduces per micro-batch, forward and backward together, of an activation
# (b*s*h) and of one number per token (b*s), by layer (mpipar.tensor_parallel): a block's 2 + 2,
# the embedding's partial lookups, the head's input gradient and the cross-entropy's softmax
# statistics (max, target logit, sum of exponentials)
TP_ALLREDUCES = {nn.Block: (4, 0), nn.GPTEmbedding: (1, 0), nn.GPTHead: (1, 3)}
# ZeRO-3's collectives per layer and micro-batch (mpipar.zero): its parameters gathered for the
# forward and again for the backward, its gradient reduce-scattered
ZERO3_CALLS = ("allgather", "allgather", "reduce_scatter")


def layer_table(spec, micro_rows, tp=1, dtype_bytes=2, recompute=False, cp=1, cp_algo="ring"):
    """Per layer: forward FLOPs for one micro-batch, parameters, its tensor-parallel allreduces
    (of activations, of one number per token: see ``TP_ALLREDUCES``), and the activation bytes
    it stashes; with experts, also the part of the FLOPs and of the parameters that are the
    experts', and the layer's dense FLOPs (the pipeline cuts the model by those)."""
    model = spec.model()
    flops = plan.layer_flops(model, spec.input_shape(micro_rows))
    dense = plan.layer_flops(spec.model(dense=True), spec.input_shape(micro_rows))
    tokens = (micro_rows, getattr(spec, "seq_len", 1), getattr(spec, "d_model", 1))
    return [dict(name=name, flops=f, dense_flops=fd, params=sum(p.size for p in layer.parameters()),
                 expert_params=sum(p.size for n, p in layer.named_parameters()
                                   if ".experts." in n),
                 # k experts a token, on average (the router's own FLOPs are not the experts')
                 expert_flops=sum(plan.flops(m, tokens) - plan.flops(m.router, tokens)
                                  for m in layer.modules() if isinstance(m, moe.MoE)),
                 tp_allreduces=TP_ALLREDUCES.get(type(layer), (0, 0)),
                 stash=spec.stash_bytes(layer, micro_rows, tp, dtype_bytes, recompute, cp,
                                        cp_algo),
                 # attention's core (q k^T, p v: 2 b s^2 h FLOPs each), which selective
                 # recomputation runs again in the backward
                 core=4 * micro_rows * spec.seq_len ** 2 * spec.d_model
                 if isinstance(layer, nn.Block) else 0)
            for (name, layer), f, fd in zip(model.layers, flops, dense)]


def layout_problem(spec, a):
    """Why this model cannot run on the layout of the flags ``a`` (one sentence), or None."""
    if spec.d_model % spec.n_heads:
        return f"--d-model {spec.d_model} is not divisible by --n-heads {spec.n_heads}"
    if spec.n_heads % a.tp or spec.d_model % a.tp:
        return (f"--tp {a.tp} must divide the head count ({spec.n_heads}) and the hidden size "
                f"({spec.d_model}): tensor parallelism splits both")
    if spec.vocab < a.tp:
        return f"--vocab {spec.vocab} has fewer entries than the {a.tp} tensor-parallel ranks"
    n_layers = spec.n_layers + 2  # the embedding and the head are layers of their own
    if a.pp > n_layers:
        return (f"--pp {a.pp} stages but the model has only {n_layers} layers (embedding, "
                f"{spec.n_layers} blocks, head): each stage needs at least one")
    v = a.chunks or (2 if a.schedule in schedules.CHUNKED else 1)
    if a.pp * v > n_layers:
        return (f"--pp {a.pp} stages x {v} chunks = {a.pp * v} model pieces but the model has "
                f"only {n_layers} layers (embedding, {spec.n_layers} blocks, head)")
    if a.warmup and a.schedule != "interleaved":
        return f"--warmup is interleaved 1F1B's, not --schedule {a.schedule}'s"
    try:  # what the schedule itself refuses (chunks, micro-batch counts)
        schedules.schedule(a.schedule, a.pp, a.micro_batches, v, a.warmup or "production")
    except ValueError as e:
        return str(e)
    if a.cp > 1 and a.experts:
        return "--cp takes no --experts: context parallelism is modelled for the dense GPT"
    if a.cp > 1 and a.seq_len % (2 * a.cp if a.cp_algo == "zigzag" else a.cp):
        return (f"--seq-len {spec.seq_len} does not cut into the "
                f"{2 * a.cp if a.cp_algo == 'zigzag' else a.cp} chunks of --cp-algo "
                f"{a.cp_algo} on --cp {a.cp}")
    if a.cp > 1 and a.cp_algo == "ulysses" and spec.n_heads % a.cp:
        return f"--cp-algo ulysses needs --n-heads {spec.n_heads} divisible by --cp {a.cp}"
    if a.experts and not 1 <= a.top_k <= a.experts:
        return f"--top-k {a.top_k} of --experts {a.experts}: each token goes to 1 to E experts"
    if a.ep > 1 and not a.experts:
        return f"--ep {a.ep} splits experts: give --experts E"
    if a.experts and (a.dp % a.ep or a.experts % a.ep):
        return (f"--ep {a.ep} must divide the --dp {a.dp} replicas and the --experts "
                f"{a.experts}: each of ep replicas holds E/ep experts")
    if a.experts and a.tp > 1:
        return "--experts takes no --tp: the experts are split over replicas, not tensor ranks"
    if a.experts and a.pp > 1 and a.schedule != "gpipe":
        return ("--experts with --pp needs --schedule gpipe: the load-balancing loss needs every "
                "micro-batch's routing before the first backward")
    if a.imbalance < 1:
        return f"--imbalance {a.imbalance:g} is below 1: it is the busiest rank's over the mean"
    if a.imbalance > 1 and a.ep == 1:
        return (f"--imbalance {a.imbalance:g} needs --ep above 1 (and --experts): one rank "
                f"holding every expert does the mean work")
    most = a.ep * min(a.top_k, a.experts // a.ep) / a.top_k if a.experts else 1
    if a.imbalance > most:  # a token's k pairs go to k different experts
        return (f"--imbalance {a.imbalance:g} is above {most:g}: the busiest of {a.ep} ranks, "
                f"holding {a.experts // a.ep} expert(s), gets at most "
                f"{min(a.top_k, a.experts // a.ep)} of each token's {a.top_k} pairs")
    if a.batch_size < a.dp * a.micro_batches:
        return (f"--batch-size {a.batch_size} cannot give every one of --dp {a.dp} replicas x "
                f"--micro-batches {a.micro_batches} a row: use at least {a.dp * a.micro_batches}")
    return None
