"""What the clients learn and from what.

- ``models``: built-in models, import-path models, the allocate-once flat build.
- ``hf``: Hugging Face causal LMs, offline, parameters on ``meta`` then bound into the flat buffer.
- ``trainers``: local training (plain loop, causal LM, none) and evaluation.
- ``datasets``: built-in datasets; ``idx``: MNIST-layout IDX files (Fashion-MNIST); ``partitions``: how
  samples are split across clients; ``sources``: datasets stored by client, read per rank; ``leaf``: LEAF
  JSON files; ``tables``: Parquet, npz and saved Hugging Face tables with a client column; ``text``: token
  blocks for causal LMs.
- ``device``: training on a device through a replica beside the host exchange buffer.
"""
