"""The roles of a run: rank 0 serves, ranks 1..N host logical clients.

- ``runner``: builds each role from its own config sections (the one place that reads them all).
- ``server``: the round loop: sample, dispatch, reduce, evaluate, record.
- ``client``: a rank that trains its logical clients in turn in one model and streams updates.
- ``encoding``: what a client sends: the encoded update, a group's partial sum, a compressed update.
- ``records``: a round's time split and derived metrics, memory-growth warnings, and the run's closing line.
- ``federation``: sampling, placement and seeds, pure functions of the config.
- ``launch``: every exit path aborts the job with a message; SIGTERM; setup agreement; GPU and core binding.
"""
