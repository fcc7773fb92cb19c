"""Server-side aggregation, chunk by chunk.

- kernels: pure fp32 math over one chunk (fused weighted sums, median, trimmed mean, server optimizer steps).
- native: the fused median / trimmed-mean kernel, C generated per (participants, window), compiled on first use.
- combiners: first stage, how participants' chunks combine (weighted mean, median, trimmed mean).
- updates: second stage, how the combined chunk becomes the global one (replace, momentum, FedAdam/Yogi/Adagrad).
- registry: torch-free table of built-in strategy names -> (combiner, server update).
- strategies: the composed Strategy the reduction calls, and make_strategy (built-in names or import paths).
- compatibility: whether a strategy (a plug-in too) can take the configured run modes, by its Capabilities
  (summable, needs_every_row, server_state; mpifl.config.capabilities), never by its name.
- schedule: the fold schedule, in which order a round's update chunks are folded (no MPI, no tensors).
- reduction: the streamed MPI receiver that folds and finishes every chunk of a round.
"""
