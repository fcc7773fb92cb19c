"""Differential privacy of client updates.

- ``noise``: Gaussian noise addressed by model element (the same element gets the same value
  whatever the chunking or the number of ranks), keyed by seed, round and purpose.
- ``clipping``: an update's L2 norm over the whole flat buffer, and the clip factor.
- ``accounting``: epsilon at delta from Google's dp-accounting (the ``dp`` extra).
- ``dp``: the server's side of DP-FedAvg (noise per chunk, adaptive clipping, epsilon per round,
  the budget) and the client's (clip, and local noise).
- ``secagg``: secure aggregation, simulated (masked fixed-point updates, the server's ring sum);
  ``ring``: the range of values its fixed point holds, torch-free.
"""
