"""The MPI layer: comm, the only place arrays meet MPI, and what surrounds a call (how a rank
waits, how a job fails, the --explain narration, the trace, the process grid)."""
