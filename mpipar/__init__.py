"""mpipar: data, tensor and pipeline parallel training, written step by step in explicit MPI.

Modules, in reading order:
    backend   the array module (NumPy, or CuPy on a GPU) and the default dtype
    nn        Parameter, Module and layers with hand-written forward/backward
    optim     SGD and Adam/AdamW
    data      digits, a text corpus and synthetic data, batched from the seed
    comm      the only place arrays meet MPI: checked, counted and traced
    grid      the DP x TP x PP process grid
    serial    the reference trainer every scheme must reproduce
    data_parallel, tensor_parallel, pipeline, hybrid   the schemes
"""

__version__ = "0.1.0"
