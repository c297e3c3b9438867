"""Tools around the library: benchmarks, the report, the cost model, the course's figures, the
emulated cluster and the student track."""
