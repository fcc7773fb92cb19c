"""Virtual time: heterogeneous clients, deadlines, availability and asynchronous FL.

- ``devices``: each logical client's compute speed and bandwidth (seeded, or a FedScale trace)
  and the cost model that turns a task into virtual seconds.
- ``availability``: who is online when (always, diurnal, or a trace).
- ``staleness``: FedAsync's staleness functions.
- ``schedule``: the whole schedule, planned from the config and the seed alone: synchronous
  rounds with deadlines and over-selection, and FedAsync / FedBuff steps in virtual-arrival order;
  ``compass``: FedCompass's arrival groups; ``planners``: the samplers that turn them into round plans.
"""
