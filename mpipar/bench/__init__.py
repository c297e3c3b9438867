"""Benchmarks: ``python -m mpipar.bench {engine,dp,pp,tp,hybrid,net}``.

Each compares against a baseline measured in the same run (ratios, not absolute times: these
machines are shared and noisy) and appends rows, each with its environment, to a CSV under
``plots/``. Timed runs use one BLAS thread per rank, warm up first, take the slowest rank and
report the median of repeats.
"""
