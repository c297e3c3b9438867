"""The picture of where the 16-bit formats lose a real step's gradients: the magnitudes of
every parameter gradient of the serial GPT's first step (computed in float64), binned by power
of two, against the range each format holds (:func:`mpipar.engine.precision.facts`), without
a loss scale and with fp16's default 65536, which moves every gradient 16 powers of two up."""

import numpy as np

from mpipar.tools.figures.draw import pyplot, rounded, save

SCALE = 2.0 ** 16  # fp16's default loss scale (mpipar.engine.precision.LossScaler)


def gradients_run(seed=0):
    """|g| of every gradient entry of one real step, by floor(log2 |g|), and the shares of the
    entries that each format would round to zero or overflow, with and without the scale."""
    from mpipar import serial
    from mpipar.engine import backend as B
    from mpipar.engine.precision import facts
    from mpipar.runner.cli import parse_args

    a = parse_args("serial", ["--model", "gpt", "--dtype", "float64", "--seed", str(seed)], 1)
    task = serial.Task(a)
    model = task.build_model().init(seed)
    x, y = task.to_device(*task.batch(0))
    task.loss_fn.forward(model.forward(x), y, normalizer=y.size)
    model.backward(task.loss_fn.backward())
    g = np.abs(np.concatenate([B.to_numpy(p.grad).ravel() for p in model.parameters()]))
    B.set_dtype("float32")  # as the runner leaves it for the rest of the process
    g = g[g > 0]
    powers = np.floor(np.log2(g)).astype(int)
    lo, hi = int(powers.min()), int(powers.max())
    counts = [int((powers == k).sum()) for k in range(lo, hi + 1)]
    shares = {}
    for name in ("fp16", "bf16"):
        f = facts(name)
        for label, scale in (("unscaled", 1.0), ("scaled", SCALE)):
            v = g * scale
            shares[f"{name} {label}"] = dict(
                zero=rounded((v < f["smallest_subnormal"] / 2).mean()),
                subnormal=rounded(((v >= f["smallest_subnormal"] / 2)
                                   & (v < f["smallest_normal"])).mean()),
                overflow=rounded((v > f["max"]).mean()))
    limits = {name: {k: rounded(np.log2(facts(name)[k])) for k in
                     ("smallest_subnormal", "smallest_normal", "max")} for name in ("fp16", "bf16")}
    return dict(lo=lo, hi=hi, counts=counts, entries=int(g.size), shares=shares, limits=limits)


def precision_figure(path):
    data = gradients_run()
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    edges = list(range(data["lo"], data["hi"] + 1))
    fp16 = data["limits"]["fp16"]
    for ax, (label, shift) in zip(axes, (("no loss scale", 0), ("loss scale 2^16", 16))):
        ax.bar([e + shift for e in edges], data["counts"], width=0.9, color="#4C72B0")
        ax.axvspan(data["lo"] - 1, fp16["smallest_subnormal"] - 1, color="#C44E52", alpha=0.15)
        ax.axvspan(fp16["smallest_subnormal"] - 1, fp16["smallest_normal"], color="#DD8452",
                   alpha=0.15)
        ax.axvline(fp16["max"], color="#C44E52", lw=1)
        s = data["shares"][f"fp16 {'unscaled' if shift == 0 else 'scaled'}"]
        reach = data["limits"]["bf16"]["smallest_subnormal"]
        ax.set_title(f"{label}: fp16 rounds {s['zero']:.2%} of the gradients to zero, keeps "
                     f"{s['subnormal']:.2%} as subnormals, overflows {s['overflow']:.2%} "
                     f"(bf16 holds them all: its range reaches 2^{reach:.0f})", fontsize=9)
        ax.set_ylabel("gradient entries")
    axes[1].set_xlabel("log2 |gradient| (bins of one power of two)")
    axes[0].text(fp16["smallest_subnormal"] - 1.5, max(data["counts"]) * 0.9, "fp16: 0",
                 ha="right", fontsize=8, color="#C44E52")
    axes[0].text(fp16["smallest_normal"] - 0.3, max(data["counts"]) * 0.9, "subnormal",
                 ha="right", fontsize=8, color="#DD8452")
    axes[1].text(fp16["max"] + 0.3, max(data["counts"]) * 0.9, "fp16 max", fontsize=8,
                 color="#C44E52")
    axes[1].set_xlim(data["lo"] - 1, data["hi"] + 19)
    fig.suptitle(f"the {data['entries']:,} gradient entries of the serial GPT's first step, "
                 "against fp16's range (red: rounded to zero; orange: subnormal)", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return data
