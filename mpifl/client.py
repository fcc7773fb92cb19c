"""Ranks 1..N: host logical clients, receive the global model, train, stream updates back."""
from __future__ import annotations

import time

from mpi4py import MPI

from . import protocol
from .config import Config
from .data import ClientData
from .federation import client_seed
from .flat import FlatModel
from .metrics import peak_rss_bytes
from .trainers import make_trainer
from .transport import recv_chunks, recv_object, send_chunks, send_object


class ClientRank:
    """One model in memory; its logical clients train one after another in it."""

    def __init__(self, comm: MPI.Comm, cfg: Config, flat: FlatModel, local_data: dict[int, ClientData | None]):
        self.comm, self.cfg, self.flat, self.local_data = comm, cfg, flat, local_data
        self.trainer = make_trainer(cfg.train)
        self.chunk_buffers = [flat.chunk_bytes(c) for c in flat.spec.chunks(cfg.transport.chunk_bytes)]

    def run(self) -> None:
        """Serve rounds until the server says stop."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if header.stop:
                return
            if header.clients:
                self.serve_round(header)

    def serve_round(self, header: protocol.RoundHeader) -> None:
        """Receive the global model once, then train and send each logical client in id order."""
        inflight = self.cfg.transport.inflight
        recv_chunks(self.comm, protocol.SERVER, protocol.MODEL, self.chunk_buffers, inflight)
        # Training overwrites the model: keep the global for the next logical client.
        keep = self.flat.buffer.clone() if len(header.clients) > 1 and self.trainer.modifies_weights else None
        for i, client in enumerate(header.clients):
            if i and keep is not None:
                self.flat.buffer.copy_(keep)
            self.flat.reset_local_state()
            start = time.perf_counter()
            result = self.trainer.train(self.flat.module, self.local_data.get(client),
                                        client_seed(self.cfg.seed, header.round, client))
            metrics = {**result.metrics, "rank_peak_rss_bytes": peak_rss_bytes()}
            meta = protocol.UpdateMeta(client, result.num_samples, time.perf_counter() - start, metrics)
            send_object(self.comm, meta, protocol.SERVER, protocol.META)
            send_chunks(self.comm, [protocol.SERVER], protocol.UPDATE, self.chunk_buffers, inflight)
