"""Storage: where the global model and a run's checkpoints live.

- ``hdf5``: the checkpoint file (one dataset per tensor, atomic publish), read and written.
- ``ranges``: flat byte ranges to and from per-tensor datasets (the out-of-core window).
- ``integrity``: a CRC32 per chunk piece, recorded on write and verified on resume.
- ``stores``: the global model in RAM or out of core, behind one ``GlobalStore`` protocol.
- ``residuals``: error-feedback residuals per logical client, in RAM or in a per-rank HDF5 file.
- ``checkpointer``: when to save, saving, resuming, pruning, ``model.h5`` and ``metrics.jsonl``.
"""
