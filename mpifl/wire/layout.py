"""The exchange plan: the model's layout on the wire, worked out once and handed to both roles."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from mpifl.config import CompressionConfig, TransportConfig
from mpifl.wire.codecs import Codec, codec_for
from mpifl.wire.spec import Chunk, ModelSpec, element_offsets, fp32_chunks, wire_chunks


@dataclass(frozen=True)
class ExchangeLayout:
    """What travels each round: the model's chunks out, the update's (possibly narrowed) chunks back.

    ``chunks`` address the flat buffer; ``wire`` is the same chunks as clients send them
    (``wire is chunks`` when updates go straight from the flat buffer, unnarrowed; fp32 chunks
    of a separate buffer when ranks send their groups' partial sums).
    """

    spec: ModelSpec
    chunks: list[Chunk]
    wire: list[Chunk]
    inflight: int  # chunks in flight per peer
    chunk_bytes: int  # transport.chunk_mb in bytes: what laid the chunks out
    grouped: bool = False  # clients.groups: what travels back are fp32 partial sums
    codec: Codec | None = None  # compression.method: updates travel quantized or sparsified

    @classmethod
    def build(cls, spec: ModelSpec, transport: TransportConfig, compression: CompressionConfig,
              wire_dtype: str | None, grouped: bool) -> ExchangeLayout:
        """Chunk the spec by ``transport.chunk_mb``; narrow updates to ``wire_dtype`` (``strategy.wire_dtype``),
        send fp32 partial sums when ``grouped`` (``clients.groups``), or compress them (``compression``)."""
        chunks = spec.chunks(transport.chunk_bytes)
        codec = codec_for(compression.method, compression.block, compression.fraction)
        if codec is not None:
            wire = codec.wire_chunks(chunks)
        else:
            wire = fp32_chunks(chunks) if grouped else wire_chunks(chunks, wire_dtype)
        return cls(spec, chunks, wire, transport.inflight, transport.chunk_bytes, grouped, codec)

    @property
    def narrowed(self) -> bool:
        """Whether updates travel from a separate wire buffer as values: a narrower dtype, or fp32 group sums
        (compressed updates have their own encoder)."""
        return self.wire is not self.chunks and self.codec is None

    @cached_property
    def first_elements(self) -> list[int]:
        """Each chunk's first element in the whole model, then the model's element count (where DP's noise,
        secure aggregation's masks and the server-state vectors' slices of a chunk begin)."""
        return element_offsets(self.chunks)

    @property
    def model_bytes(self) -> int:
        """Bytes of the model sent to one client rank."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def update_bytes(self) -> int:
        """Bytes of one update stream: a logical client's update, or a group's fp32 partial sum."""
        return sum(w.nbytes for w in self.wire)

    @property
    def wire_buffer_bytes(self) -> int:
        """Size of a client's separate wire buffer (chunks 64-byte aligned); 0 when updates leave from the model."""
        return self.wire[-1].offset + self.wire[-1].nbytes if self.wire is not self.chunks else 0

    def chunk_slices(self, buffer: np.ndarray) -> list[np.ndarray]:
        """Each model chunk as a ``uint8`` slice of a flat buffer (MPI buffers, no copy)."""
        return [buffer[c.offset:c.offset + c.nbytes] for c in self.chunks]
