"""The V-shaped pipeline schedules: two model chunks a stage, placed in a V (stage r holds
pieces r and 2p-1-r of the model, :func:`mpipar.parts.instructions.piece_of`), so the middle
of the model stays on stage p-1 and the loss is computed on stage 0, beside the input.
:mod:`mpipar.parts.schedules` runs them like every other list."""

from collections import deque

from mpipar.parts.instructions import (
    Backward,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    _backward,
    _check,
    _forward,
)


class _VList:
    """One rank's list under construction for a V-shaped schedule: each call appends a chunk's
    forward or backward (with its messages, :func:`_forward`) for the next micro-batch of
    that chunk; a split backward's W waits in ``owed`` (first in, first out) for :meth:`w`."""

    def __init__(self, n_stages, stage, pairs="order"):
        self.p, self.r, self.out, self.owed, self.pairs = n_stages, stage, [], deque(), pairs
        self.f, self.b = [0, 0], [0, 0]  # the next micro-batch of each chunk

    def F(self, c):
        self.out += _forward(self.p, self.r, self.f[c], c, 2, "v")
        self.f[c] += 1

    def B(self, c, split=True):
        self.out += _backward(self.p, self.r, self.b[c], c, 2, "v")
        if split:
            self.owed.append(BackwardWeight(self.b[c], c))
        self.b[c] += 1

    def w(self):
        self.out.append(self.owed.popleft())

    def FB(self, c_f, c_b):
        """A forward on chunk ``c_f`` beside the (whole) backward of another micro-batch on
        ``c_b``: the forward's output is sent (posted, non-blocking) before the backward's
        gradient is waited for, so that message travels while the backward computes. DualPipe
        waits for both receives first, then runs the two computations at once on a GPU; with
        one computation at a time that wait would hold the forward up for the backward's
        gradient (the replay's bubble at p = 2, m = 4 grows from 0.040 to 0.077). ``pairs``
        "report" writes the pair as DualPipe does: both receives, both computations, both
        sends (:func:`published_bubble` is its idle time)."""
        start = len(self.out)
        self.F(c_f)
        self.B(c_b, split=False)
        if self.pairs == "report":
            pair = self.out[start:]
            recvs = [i for i in pair if isinstance(i, (RecvAct, RecvGrad))]
            work = [i for i in pair if isinstance(i, (Forward, Backward))]
            self.out[start:] = recvs + work + [i for i in pair if i not in recvs + work]


def zb_v(n_stages, stage, n_micro):
    """ZB-V (Qi et al. 2024, arXiv:2401.10241, Sec. 6): two chunks a rank in a V (rank r holds
    pieces r and 2p-1-r of the 2p, :func:`piece_of`), every backward split into B and W. With
    n = max(m, 2p-1) micro-batches (those past m dropped after): 2(p-r)-1 forwards of chunk 0;
    r pairs F1 F0; p-r triples F1 B1 W1; then, while chunk 1 lags or chunk 0 has forwards
    left, [F0] B0 W0 F1 B1 W1; to cool down, r pairs B0 B1, p-r pairs B0 W0, and the W's
    still owed (PyTorch's ScheduleZBVZeroBubble orders its actions the same way). With F, B
    and W of equal times and m >= 2p-1 no rank idles between its first instruction and its
    last (the paper's zero bubble); each starts one chunk-forward after the one before, so
    the step is 6m + p - 1 chunk-units long, the least any schedule can take: bubble
    (p-1)/(6m+p-1). Every rank stashes at most 2p chunk activations: p micro-batches' worth,
    what 1F1B's first stage holds."""
    _check(n_stages, stage, n_micro)
    p, r, n = n_stages, stage, max(n_micro, 2 * n_stages - 1)
    v = _VList(p, r)
    for _ in range(2 * (p - r) - 1):
        v.F(0)
    for _ in range(r):
        v.F(1), v.F(0)
    for _ in range(p - r):
        v.F(1), v.B(1), v.w()
    while v.f[1] < v.f[0] or v.f[0] < n:
        if v.f[0] < n:
            v.F(0)
        v.B(0), v.w(), v.F(1), v.B(1), v.w()
    for _ in range(r):
        v.B(0), v.B(1)
    for _ in range(p - r):
        v.B(0), v.w()
    while v.owed:
        v.w()
    return [i for i in v.out if i.micro < n_micro] + [OptimizerStep()]


def dualpipev(n_stages, stage, n_micro, pairs="order"):
    """DualPipeV (the DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.2.1, cut in half as in its
    DualPipe repository): the V of :func:`zb_v`, m >= 2p micro-batches, and each rank's eight
    phases: (1) 2(p-r-1) F0; (2) r+1 pairs F0 F1; (3) p-r-1 of B1 (split) W F1; (4) m-2p+r+1
    of F0&B1 F1&B0, each forward beside another micro-batch's backward (:meth:`_VList.FB`:
    what the report overlaps, so that one's messages travel while the other computes); (5)
    p-r-1 of B1 F1&B0; (6) r+1 pairs B1 B0, split from the middle one on; (7) p-r-1 of W B0
    (split); (8) the r+1 W's still owed. Every rank stashes at most 2p+1 chunk activations
    (the report's PP+1). With F, B and W equal and nothing overlapped the step is 6m + p - 1
    chunk-units long, as ZB-V's (bubble (p-1)/(6m+p-1)). ``pairs`` "report" writes each pair
    in DualPipe's own order (:meth:`_VList.FB`), whose bubble is the published one
    (:func:`published_bubble`)."""
    _check(n_stages, stage, n_micro)
    p, r, m = n_stages, stage, n_micro
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2 x {p} = {2 * p} micro-batches, got {m}")
    v = _VList(p, r, pairs)
    for _ in range(2 * (p - r - 1)):  # (1)
        v.F(0)
    for _ in range(r + 1):  # (2)
        v.F(0), v.F(1)
    for _ in range(p - r - 1):  # (3)
        v.B(1), v.w(), v.F(1)
    for _ in range(m - 2 * p + r + 1):  # (4)
        v.FB(0, 1), v.FB(1, 0)
    for _ in range(p - r - 1):  # (5)
        v.B(1, split=False), v.FB(1, 0)
    for i in range(r + 1):  # (6): the odd ranks split from chunk 1 of the middle pair on
        v.B(1, split=i > (r + 1) // 2 or i == (r + 1) // 2 and r % 2 == 1)
        v.B(0, split=i >= (r + 1) // 2)
    for _ in range(p - r - 1):  # (7)
        v.w(), v.B(0)
    while v.owed:  # (8)
        v.w()
    return v.out + [OptimizerStep()]


# ----------------------------------------------------------------------------- the report's bubble
def published_bubble(n_stages, f, b, w, fb):
    """DualPipeV's bubble as the DeepSeek-V3 report's Table 2 gives it, (PP/2-1)(F&B+B-3W):
    the time a rank idles in a step, with PP = 2p pieces, F a chunk's forward, B its whole
    backward (input and weights), W the weights' part, and F&B a forward and another
    micro-batch's backward run at once (from max(F, B) if fully overlapped to F + B if not
    at all). With F, B = 2F and W = F and nothing overlapped: 2(p-1)F. It is what rank 0
    idles with the pairs in the report's order (``pairs="report"``) when a chunk's input
    gradient takes as long as its forward (B = F + W) and W <= F, for any overlap; elsewhere
    it is not exact, either way (``tests/test_schedules.py > pair_replay`` replays it)."""
    return (n_stages - 1) * (fb + b - 3 * w)

