"""The wire: how a model's bytes travel between ranks.

- ``flat``: a model's tensors as views of one contiguous buffer; its ``ModelSpec`` and chunks.
- ``protocol``: tags and messages, the whole protocol on one screen.
- ``transport``: chunked ``Isend``/``Irecv`` of raw bytes, bounded in flight, polite waits.
- ``plan``: the ``ExchangeLayout`` (chunks out, wire chunks back), worked out once for both roles.
- ``watchdog``: progress-aware deadlines per stage of a round.
"""
