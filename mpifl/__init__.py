"""mpifl: MPI federated-learning simulation with chunked zero-copy transport and streamed aggregation."""
__version__ = "0.1.0"
