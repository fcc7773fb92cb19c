"""The exchange plan: the model's layout on the wire, worked out once and handed to both roles."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpifl.config import Config
from mpifl.wire.flat import Chunk, ModelSpec, wire_chunks


@dataclass(frozen=True)
class ExchangePlan:
    """What travels each round: the model's chunks out, the update's (possibly narrowed) chunks back.

    ``chunks`` address the flat buffer; ``wire`` is the same chunks as clients send them
    (``wire is chunks`` when updates go straight from the flat buffer, unnarrowed).
    """

    spec: ModelSpec
    chunks: list[Chunk]
    wire: list[Chunk]
    inflight: int  # chunks in flight per peer
    chunk_bytes: int  # transport.chunk_mb in bytes: what laid the chunks out

    @classmethod
    def from_config(cls, spec: ModelSpec, cfg: Config) -> "ExchangePlan":
        """Chunk the spec by ``transport.chunk_mb``; narrow updates to ``strategy.wire_dtype``."""
        chunks = spec.chunks(cfg.transport.chunk_bytes)
        return cls(spec, chunks, wire_chunks(chunks, cfg.strategy.wire_dtype), cfg.transport.inflight,
                   cfg.transport.chunk_bytes)

    @property
    def narrowed(self) -> bool:
        """Whether updates travel in a narrower dtype than the model's (through a separate wire buffer)."""
        return self.wire is not self.chunks

    @property
    def model_bytes(self) -> int:
        """Bytes of the model sent to one client rank."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def update_bytes(self) -> int:
        """Bytes of one logical client's update."""
        return sum(w.nbytes for w in self.wire)

    @property
    def wire_buffer_bytes(self) -> int:
        """Size of a client's separate wire buffer (chunks 64-byte aligned); 0 when not narrowed."""
        return self.wire[-1].offset + self.wire[-1].nbytes if self.narrowed else 0

    def chunk_slices(self, buffer: np.ndarray) -> list[np.ndarray]:
        """Each model chunk as a ``uint8`` slice of a flat buffer (MPI buffers, no copy)."""
        return [buffer[c.offset:c.offset + c.nbytes] for c in self.chunks]
