"""The vocabulary of the pipeline schedules: the instructions a stage's list is made of, where
each model chunk sits (the placement), and the messages around a chunk's forward and backward.
:mod:`mpipar.parts.schedules` builds the lists from these and replays them."""

from dataclasses import dataclass
from typing import Optional


# ----------------------------------------------------------------------------- instructions
@dataclass(frozen=True)
class Instruction:
    micro: Optional[int] = None  # the micro-batch id (None for the optimizer step)
    chunk: int = 0  # the model chunk the stage runs it on (interleaved 1F1B; else always 0)
    code = "?"  # short name for printing
    kind = "?"  # trace kind: forward, backward, send, recv, optimizer
    part = None  # drawn in a colour of its own on a timeline (W: "weight"), else by its kind

    def __str__(self):
        if self.micro is None:
            return self.code
        return f"{self.code}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


class Forward(Instruction):
    """Run the stage forward on micro-batch ``micro`` (the last stage also computes the loss)."""
    code, kind = "F", "forward"


class Backward(Instruction):
    """Run the stage backward on micro-batch ``micro`` (the last stage starts from the loss);
    in a schedule with W instructions only its input's gradient (B), keeping what W needs."""
    code, kind = "B", "backward"


class BackwardWeight(Instruction):
    """W: accumulate the parameter gradients of micro-batch ``micro`` from what its B kept.
    Backward work, so traced as such (the bubble counts it busy); drawn in its own colour."""
    code, kind, part = "W", "backward", "weight"


class SendAct(Instruction):
    """Send the stage's output activation of ``micro`` to the next stage."""
    code, kind = "SA", "send"


class RecvAct(Instruction):
    """Receive the input activation of ``micro`` from the previous stage."""
    code, kind = "RA", "recv"


class SendGrad(Instruction):
    """Send the gradient of the stage's input of ``micro`` to the previous stage."""
    code, kind = "SG", "send"


class RecvGrad(Instruction):
    """Receive the gradient of the stage's output of ``micro`` from the next stage."""
    code, kind = "RG", "recv"


class OptimizerStep(Instruction):
    """Update the stage's parameters with the gradients summed over all micro-batches."""
    code, kind = "OPT", "optimizer"


# ----------------------------------------------------------------------------- placement
# Which model piece each (rank, chunk) holds, the model cut into p*v pieces: "loop" (interleaved
# 1F1B: chunk c of rank r is piece c*p + r, a micro-batch goes round the ranks v times) or "v"
# (the V-shaped schedules, v = 2: rank r holds pieces r and 2p-1-r, so piece p-1 hands its
# output to piece p on the same rank, and the last piece is on rank 0, beside the first).
def piece_of(placement, n_stages, stage, chunk):
    if placement == "v":
        return stage if chunk == 0 else 2 * n_stages - 1 - stage
    return chunk * n_stages + stage


def holder(placement, n_stages, piece):
    """The (rank, chunk) that holds model piece ``piece``."""
    if placement == "v":
        return (piece, 0) if piece < n_stages else (2 * n_stages - 1 - piece, 1)
    return piece % n_stages, piece // n_stages


def neighbour(placement, n_stages, n_chunks, stage, chunk, step):
    """The (rank, chunk) holding the piece ``step`` (+1 or -1) after (stage, chunk)'s, or None
    past either end of the model."""
    piece = piece_of(placement, n_stages, stage, chunk) + step
    return holder(placement, n_stages, piece) if 0 <= piece < n_stages * n_chunks else None


# ----------------------------------------------------------------------------- schedules
def _forward(n_stages, stage, k, chunk=0, n_chunks=1, placement="loop"):
    """Receive the input (unless from the first piece or from this rank), run forward, send the
    output (unless from the last piece or to this rank)."""
    before, after = (neighbour(placement, n_stages, n_chunks, stage, chunk, d) for d in (-1, 1))
    return ([RecvAct(k, chunk)] if before and before[0] != stage else []) + [Forward(k, chunk)] \
        + ([SendAct(k, chunk)] if after and after[0] != stage else [])


def _backward(n_stages, stage, k, chunk=0, n_chunks=1, placement="loop"):
    """Receive the output's gradient (unless at the last piece or from this rank), run
    backward, send the input's gradient (unless from the first piece or to this rank)."""
    before, after = (neighbour(placement, n_stages, n_chunks, stage, chunk, d) for d in (-1, 1))
    return ([RecvGrad(k, chunk)] if after and after[0] != stage else []) \
        + [Backward(k, chunk)] + ([SendGrad(k, chunk)] if before and before[0] != stage else [])


def _check(n_stages, stage, n_micro):
    if n_stages < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is not one of {n_stages} stages")
    if n_micro < 1:
        raise ValueError(f"the number of micro-batches must be positive, got {n_micro}")
