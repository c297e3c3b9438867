"""The engine: one process, no MPI. Arrays (backend), parameters, layers with their backward
beside their forward (nn), optimizers and data."""
