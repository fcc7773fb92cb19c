"""Pure planning: what a run will do and what it will cost, computed from the config alone (no MPI).

- ``seeds``: every random stream's key, in one table, and ``derive_seed``.
- ``federation``: who takes part each round, which rank hosts which client, the round's assignment.
- ``pools``: the server's receive slots and accumulator window, sized from a memory budget.
- ``memory``: the memory model, per rank and per node, from the same sizing functions the run uses.
- ``scale``: the scale model of a round's time from per-byte costs.
- ``binding``: which GPU and CPU cores each rank takes, from the launcher's variables and the node's affinity sets.
"""
