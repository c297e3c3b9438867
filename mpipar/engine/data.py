"""Data sets, all available offline, and batches that depend only on the seed and the step.

- digits: scikit-learn's 1,797 handwritten digits (8x8 images, 64 features, 10 classes),
  which ship inside the scikit-learn package.
- text: English prose from the Python documentation's topic pages (``pydoc_data.topics``,
  part of every CPython install), as characters, for the character-level GPT.
- synthetic classes (:class:`Synthetic`): rows of any width labelled by a fixed random teacher,
  so that an MLP of any size (``--data synthetic --sizes 784,...``) can be trained and compared.
- synthetic: random arrays of any shape, for benchmarks (:func:`synthetic`).

Every rank calls ``batch(step)`` and gets the same global batch; each scheme then decides
which part of it a rank uses. That is what makes a parallel run comparable to the serial one.
"""

import numpy as np


def _rng(seed, step, salt):
    return np.random.default_rng([seed, step, salt])


class Rows:
    """A classification data set held as rows: a fixed 80/20 train/test split, and batches
    drawn without replacement from (seed, step) alone."""

    def split(self, x, y, seed):
        order = np.random.default_rng(12345).permutation(len(y))  # one split for every seed
        n_test = len(y) // 5
        self.x_test, self.y_test = x[order[:n_test]], y[order[:n_test]]
        self.x_train, self.y_train = x[order[n_test:]], y[order[n_test:]]
        self.seed = seed

    def batch(self, step, batch_size):
        """The global batch of a step: batch_size training rows drawn without replacement."""
        idx = _rng(self.seed, step, 1).choice(len(self.y_train), batch_size, replace=False)
        return self.x_train[idx], self.y_train[idx]  # (B, n_in), (B,)


class Synthetic(Rows):
    """n_samples rows of n_in features that lie near a random 16-dimensional subspace, each
    labelled by the largest of n_out scores a fixed random teacher gives its 16 coordinates:
    learnable from a few thousand rows at any width, and the same data for every scheme and
    run of the same shape (its values depend on the shape alone, not on --seed)."""

    def __init__(self, n_in, n_out, n_samples=4096, seed=0):
        rng = np.random.default_rng([7, n_in, n_out, n_samples])
        d = min(n_in, 16)
        z = rng.standard_normal((n_samples, d))  # (N, d) the rows' hidden coordinates
        x = z @ rng.standard_normal((d, n_in)) / np.sqrt(d) \
            + 0.1 * rng.standard_normal((n_samples, n_in))  # (N, n_in)
        scores = z @ rng.standard_normal((d, n_out))  # (N, n_out) the teacher's
        y = np.argmax(scores + 0.3 * rng.standard_normal((n_samples, n_out)), axis=1)
        self.n_in, self.n_out = n_in, n_out
        self.split(x, y.astype(np.int64), seed)


class Digits(Rows):
    """Images as float rows in [0, 1], labels 0-9."""

    n_in, n_out = 64, 10

    def __init__(self, seed=0):
        data = digits_table()
        x = data[:, :-1] / 16.0  # pixel values are 0..16
        self.split(x, data[:, -1].astype(np.int64), seed)


def digits_table():
    """scikit-learn's digits file (a row per image: 64 pixels, then the label), read as its
    load_digits reads it, without importing scikit-learn: that import costs about 0.9 s in
    every process, the whole of a short run's start-up on each rank."""
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


class Text:
    """Characters of the Python documentation's topic pages, as integer ids."""

    def __init__(self, seed=0, n_chars=300_000):
        from pydoc_data.topics import topics

        raw = "\n".join(topics[k] for k in sorted(topics))
        raw = "".join(c for c in raw if c == "\n" or 32 <= ord(c) < 127)[:n_chars]
        self.chars = sorted(set(raw))
        self.vocab = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([index[c] for c in raw], dtype=np.int64)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]
        self.seed = seed

    def batch(self, step, batch_size, seq_len, split="train"):
        """batch_size windows of seq_len characters; the target is the next character."""
        data = self.train if split == "train" else self.val
        salt = 2 if split == "train" else 3
        start = _rng(self.seed, step, salt).integers(0, len(data) - seq_len - 1, batch_size)
        x = np.stack([data[s:s + seq_len] for s in start])  # (B, T)
        y = np.stack([data[s + 1:s + seq_len + 1] for s in start])  # (B, T)
        return x, y

    def unigram_loss(self):
        """Cross-entropy (nats/char) of predicting every character by its frequency alone."""
        counts = np.bincount(self.train, minlength=self.vocab).astype(np.float64)
        p = counts / counts.sum()
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def synthetic(step, shape, n_classes=None, seed=0):
    """Random inputs of ``shape`` and, with n_classes, integer targets of shape[:-1]."""
    rng = _rng(seed, step, 4)
    x = rng.standard_normal(shape)
    if n_classes is None:
        return x
    return x, rng.integers(0, n_classes, shape[:-1])
