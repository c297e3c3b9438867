"""Number formats, and the dynamic loss scale of fp16 training.

    python -m mpipar.engine.precision          # the formats' facts, from NumPy and ml_dtypes

A format of e exponent bits and m mantissa bits holds numbers (1 + f) 2^x with m bits of f;
its epsilon (the gap above 1) is 2^-m, its smallest normal 2^(2 - 2^(e-1)), and below that the
subnormals reach 2^-m times it; its largest number is just under 2^(2^(e-1)) where the top
exponent is kept for inf and NaN (fp32, fp16, bf16, fp8 e5m2; fp8 e4m3 keeps only NaN, so
reaches 448). fp16 has
5 exponent bits: a gradient of 1e-8 rounds to 0 and an activation of 70,000 overflows. bf16
keeps fp32's 8 exponent bits (its range) and 7 mantissa bits: nothing overflows that fits
fp32, but 1 + 2^-9 rounds back to 1. :func:`facts` reads them from the formats themselves.

Loss scaling (Micikevicius et al. 2018, arXiv:1710.03740, Sec. 3.2): fp16 gradients would
vanish, so the loss is multiplied by a scale S before the backward, which multiplies every
gradient by S, and the gradients are divided by S before the update, in fp32. Too large an S
overflows: some gradient is inf or NaN, and that step must be skipped. :class:`LossScaler`
adjusts S as Megatron-LM's DynamicGradScaler does:

1. S starts at ``init_scale`` (2^16);
2. a step whose gradients are finite on every rank is taken; after ``growth_interval``
   finite steps in a row, S is multiplied by ``growth_factor`` (2), the count restarts and the
   hysteresis is reset;
3. a step with a non-finite gradient anywhere is skipped on every rank and the count of finite
   steps restarts; S is multiplied by ``backoff_factor`` (0.5), never below ``min_scale``,
   once ``hysteresis`` overflowing steps have been seen since the last growth (and at every
   overflowing step after that, until the next growth).

With ``hysteresis`` 1 and ``min_scale`` 0 these are PyTorch's ``torch.amp.GradScaler`` rules
(back off at every overflow, grow after ``growth_interval`` finite steps); Megatron-LM's
default hysteresis is 2: one overflow alone skips the step but keeps S.

Whether a step overflowed must be one answer for the whole job, agreed by the ranks before
:meth:`LossScaler.update`: a rank that skips while another updates leaves replicas that differ
from then on, and a tensor-parallel rank that updates its shard while its partner does not
breaks the layer.
"""

import math

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bf16 and fp8 need it; fp32 and fp16 are NumPy's own
    ml_dtypes = None


def dtype_of(name):
    """The NumPy dtype of ``name`` (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2)."""
    if name in ("fp32", "fp16"):
        return np.dtype(np.float32 if name == "fp32" else np.float16)
    if ml_dtypes is None:
        raise ImportError(f"{name} needs the ml_dtypes package: pip install ml_dtypes")
    return np.dtype({"bf16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
                     "fp8_e5m2": ml_dtypes.float8_e5m2}[name])


FORMATS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def facts(name):
    """The format's bits, read from the format: total, exponent, mantissa; the largest
    finite number, the smallest normal and subnormal numbers, and epsilon (1's gap)."""
    dtype = dtype_of(name)
    info = np.finfo(dtype) if name in ("fp32", "fp16") else ml_dtypes.finfo(dtype)
    return dict(format=name, bits=dtype.itemsize * 8, exponent_bits=int(info.nexp),
                mantissa_bits=int(info.nmant), max=float(info.max),
                smallest_normal=float(info.smallest_normal),
                smallest_subnormal=float(info.smallest_subnormal), eps=float(info.eps))


class LossScaler:
    """The dynamic loss scale (the rules of the module docstring). :meth:`update` takes the
    job-wide overflow answer of a step and returns whether to take that step's update."""

    def __init__(self, init_scale=2.0 ** 16, growth_interval=1000, growth_factor=2.0,
                 backoff_factor=0.5, hysteresis=2, min_scale=1.0):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"the initial loss scale must be positive and finite, got "
                             f"{init_scale}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and hysteresis >= 1 and 0 <= min_scale <= init_scale):
            raise ValueError("a loss scale needs growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval and hysteresis >= 1, 0 <= min_scale <= "
                             "init_scale")
        self.scale, self.growth_interval = float(init_scale), growth_interval
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.finite_steps, self.overflows_left = 0, hysteresis  # the two trackers
        self.skipped = 0

    def update(self, overflow):
        """Rules 2 and 3 for one step; True when the step's update is to be taken."""
        if overflow:
            self.finite_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.skipped += 1
            return False
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.finite_steps, self.overflows_left = 0, self.hysteresis
            self.scale *= self.growth_factor
        return True

    def state(self):
        """What a checkpoint keeps, to resume with the same scale and trackers."""
        return dict(scale=self.scale, finite_steps=self.finite_steps,
                    overflows_left=self.overflows_left, skipped=self.skipped)

    def load(self, state):
        self.scale, self.finite_steps = float(state["scale"]), int(state["finite_steps"])
        self.overflows_left, self.skipped = int(state["overflows_left"]), int(state["skipped"])


def bf16_problem():
    """Why bf16 cannot be stored here (ml_dtypes missing), or None."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return "--precision bf16 needs the ml_dtypes package for NumPy's bf16: pip install " \
            "ml_dtypes"
    return None


def scaler_for(args):
    """The run's loss scaler: fp16's, from ``--loss-scale`` and ``--loss-scale-interval``;
    None in any other precision (nothing to scale)."""
    if getattr(args, "precision", "fp32") != "fp16":
        return None
    return LossScaler(args.loss_scale, args.loss_scale_interval)


def scale_of(scaler):
    """The factor the backward starts from: fp16's loss scale, or 1 without a scaler."""
    return 1.0 if scaler is None else scaler.scale


def take_step(opt, scaler, agree=None):
    """The update of one step: ``opt.step()``; with a loss ``scaler`` (fp16), only if every
    gradient is finite, the gradients divided by the scale first (``opt.unscale``) and the
    scale then adjusted (:meth:`LossScaler.update`). ``agree(overflow)`` turns this rank's
    answer into the job's (every rank must skip the same steps). Returns whether it updated."""
    if scaler is None:
        opt.step()
        return True
    opt.unscale = 1.0 / scaler.scale
    overflow = not all(bool(np.isfinite(np.asarray(p.grad, dtype=np.float32)).all())
                       for p in opt.params)
    if agree is not None:
        overflow = agree(overflow)
    taken = scaler.update(overflow)
    if taken:
        opt.step()
    return taken


class Guarded:
    """An optimizer whose ``step()`` is :func:`take_step` with ``scaler`` and ``agree``: what
    a pipeline schedule's optimizer instruction calls in fp16 (skipped on any overflow)."""

    def __init__(self, opt, scaler, agree):
        self.opt, self.scaler, self.agree = opt, scaler, agree

    def step(self):
        return take_step(self.opt, self.scaler, self.agree)


def main():
    rows = [facts(name) for name in FORMATS]
    print(f"{'format':<9} {'bits':>4} {'exp':>4} {'mant':>4} {'largest':>12} "
          f"{'smallest normal':>16} {'smallest subnormal':>19} {'epsilon':>10}")
    for r in rows:
        print(f"{r['format']:<9} {r['bits']:>4} {r['exponent_bits']:>4} {r['mantissa_bits']:>4} "
              f"{r['max']:>12.6g} {r['smallest_normal']:>16.6g} {r['smallest_subnormal']:>19.6g} "
              f"{r['eps']:>10.6g}")


if __name__ == "__main__":
    main()
