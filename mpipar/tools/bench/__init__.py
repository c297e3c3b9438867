"""Benchmarks: ``python -m mpipar.tools.bench {engine,flops,net,dp,pp,tp,hybrid}``.

Each compares against a baseline measured in the same run (ratios, not absolute times: these
machines are shared and noisy) and writes rows, each with its environment, to a CSV, and its
pictures. Timed runs use one BLAS thread per rank, warm up first, take the slowest rank and
report the median of repeats.

Where the results go: ``--out DIR``. From the command line the default is a scratch folder
(``mpipar-plots`` in the system's temporary folder, or ``$MPIPAR_PLOTS`` where that is set),
so trying a benchmark never overwrites the committed CSVs in ``plots/`` that the lessons and
``plots/REPORT.md`` quote. ``--out plots`` replaces them on purpose, and ``make report``
(:mod:`mpipar.tools.report`) runs every benchmark with ``--out`` set to ``plots/``.

``--quick`` picks shorter defaults (fewer sizes, steps, repeats); a flag given beside it wins:
``python -m mpipar.tools.bench pp --quick --steps 20`` times 20 steps.
"""
