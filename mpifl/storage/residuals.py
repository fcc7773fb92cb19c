"""Error-feedback residuals: what each logical client has not sent yet, kept on the rank that hosts it.

A residual is one fp32 vector per logical client with one element per model element, in
chunk order; a client never sampled has none (zero). A client rank keeps its clients'
residuals in RAM (``RamResiduals``) while (hosted clients x model fp32 bytes) fits in
``compression.residual_ram_mb``, else in one HDF5 file per rank in the run directory
(``DiskResiduals``), read and written chunk by chunk: the rank's memory is then one
chunk whatever the number of clients it hosts. Both give bitwise the same residuals.

Layout of a residual file (the per-rank working file and a checkpoint's snapshot alike)::

    /                  attrs: format ("mpifl-residuals"), elements, round (snapshots)
    /clients/<id>      fp32 (elements,), chunked, unwritten parts read as 0

A checkpoint's snapshot is the directory ``ckpt-r<round>.residuals/`` beside it, one
``rank<rank:05d>.h5`` per client rank, each published by temp file, fsync and rename. Files
are keyed by client id, so a resume on another number of ranks reads each client from
whichever file holds it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import h5py
import numpy as np
import torch

FORMAT = "mpifl-residuals"
RANK_FILE = "rank{rank:05d}.h5"  # the one template for per-rank residual files
HDF5_CHUNK = 1 << 18  # elements per HDF5 chunk (1 MiB): reads and writes touch only the chunks they need


class ResidualStore(Protocol):
    """A rank's residuals, one model chunk at a time."""

    firsts: list[int]  # each chunk's first element; the last entry is the element count

    def read(self, client: int, index: int) -> torch.Tensor:
        """Chunk ``index`` of ``client``'s residual (zeros for a client without one); valid until the next read."""

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Store chunk ``index`` of ``client``'s residual (``values`` as returned by ``read``)."""

    def clients(self) -> list[int]:
        """The clients that have a residual, ascending."""

    def has(self, client: int) -> bool:
        """Whether ``client`` has a vector of its own (written, or reloaded), rather than the zeros of none."""


class RamResiduals:
    """Whole residuals in RAM, allocated when a client is first sampled."""

    where = "RAM"

    def __init__(self, firsts: list[int]):
        self.firsts = firsts  # each chunk's first element; the last entry is the element count
        self.vectors: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"<residuals in RAM: {len(self.vectors)} clients x {self.firsts[-1]} fp32>"

    def read(self, client: int, index: int) -> torch.Tensor:
        """A view of the client's residual (allocated as zeros on first use)."""
        vector = self.vectors.get(client)
        if vector is None:
            vector = self.vectors[client] = torch.zeros(self.firsts[-1])
        return vector[self.firsts[index]:self.firsts[index + 1]]

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Copy ``values`` in, unless they are the view ``read`` gave."""
        _copy_into(self.read(client, index), values)

    def clients(self) -> list[int]:
        """The clients sampled so far (each has a residual, maybe zeros), ascending."""
        return sorted(self.vectors)

    def has(self, client: int) -> bool:
        """Whether ``client`` has a vector (read or written at least once)."""
        return client in self.vectors


class DiskResiduals:
    """Residuals in one HDF5 file per rank, read and written chunk by chunk through one reused buffer."""

    where = "HDF5"

    def __init__(self, firsts: list[int], path: Path):
        self.firsts, self.path = firsts, Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = h5py.File(self.path, "w")  # a fresh run, or a resume that reloads from its checkpoint
        self.file.attrs.update({"format": FORMAT, "elements": firsts[-1]})
        self.group = self.file.create_group("clients")
        most = max(b - a for a, b in zip(firsts, firsts[1:]))
        self.scratch = torch.zeros(most)

    def __repr__(self) -> str:
        return f"<residuals in {self.path}: {len(self.group)} clients x {self.firsts[-1]} fp32>"

    def read(self, client: int, index: int) -> torch.Tensor:
        """The chunk, read into the rank's one scratch buffer."""
        out = self.scratch[:self.firsts[index + 1] - self.firsts[index]]
        dataset = self.group.get(str(client))
        if dataset is None:
            return out.zero_()
        dataset.read_direct(out.numpy(), source_sel=np.s_[self.firsts[index]:self.firsts[index + 1]])
        return out

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Write the chunk into the client's dataset (created, zero-filled, on its first write)."""
        dataset = self.group.get(str(client))
        if dataset is None:
            dataset = _create(self.group, client, self.firsts[-1])
        dataset.write_direct(values.numpy(), dest_sel=np.s_[self.firsts[index]:self.firsts[index + 1]])

    def clients(self) -> list[int]:
        """The clients with a dataset in the file (written at least once), ascending."""
        return sorted(int(c) for c in self.group)

    def has(self, client: int) -> bool:
        """Whether ``client`` has a dataset in the file (written at least once)."""
        return str(client) in self.group

    def close(self) -> None:
        """Close the rank's residual file."""
        self.file.close()


class Section:
    """Chunk ``index`` of another store, as the one chunk of a store of its own: one part of each client's vector
    (SCAFFOLD's c_i, FedDyn's g_i, a client's ``model.local`` tensors), laid out with the others by
    mpifl.config.client_state, so that a rank keeps one file of them and a checkpoint one snapshot per rank."""

    def __init__(self, store: ResidualStore, index: int):
        self.store, self.index = store, index
        self.firsts = [0, store.firsts[index + 1] - store.firsts[index]]

    def read(self, client: int, index: int) -> torch.Tensor:
        """The client's section (zeros for a client without one); valid until the next read of the store."""
        assert index == 0, "a section is one chunk"
        return self.store.read(client, self.index)

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Store the client's section."""
        assert index == 0, "a section is one chunk"
        self.store.write(client, self.index, values)

    def clients(self) -> list[int]:
        """The clients with a vector in the whole store (this section of it may still be zeros)."""
        return self.store.clients()

    def has(self, client: int) -> bool:
        """Whether ``client`` has a vector in the whole store (this section of it may still be zeros)."""
        return self.store.has(client)


class MarkedChunks:
    """Chunks ``first`` .. ``first + count - 1`` of another store as a store of their own, and the one element after
    them as their mark: a Ditto personal model or a plug-in trainer's declared vector in each client's one vector,
    beside other kinds of state. The other kinds write a client's vector too, so a vector alone does not say that
    the client has this part: the mark, 1 once the whole model was written, does, in RAM, on disk and in a
    checkpoint's snapshot alike (a client whose personal training diverged keeps none, and starts from the global
    model next time, as with a store of its own)."""

    def __init__(self, store: ResidualStore, first: int, count: int):
        self.store, self.first, self.mark = store, first, first + count
        base = store.firsts[first]
        self.firsts = [f - base for f in store.firsts[first:first + count + 1]]
        if store.firsts[self.mark + 1] - store.firsts[self.mark] != 1:
            raise ValueError("MarkedChunks: the chunk after the section must be its one-element mark")

    def read(self, client: int, index: int) -> torch.Tensor:
        """Chunk ``index`` of the client's section; valid until the next read of the store."""
        return self.store.read(client, self.first + index)

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Store chunk ``index``; writing the last chunk marks the section as the client's own."""
        self.store.write(client, self.first + index, values)
        if self.first + index == self.mark - 1:
            mark = self.store.read(client, self.mark)
            mark.fill_(1.0)
            self.store.write(client, self.mark, mark)

    def clients(self) -> list[int]:
        """The clients with a vector in the whole store (not all of them need have this section)."""
        return self.store.clients()

    def has(self, client: int) -> bool:
        """Whether ``client`` has written this section (its mark is set)."""
        return bool(self.store.read(client, self.mark)[0] == 1.0)


class Borrowing:
    """A rank's store, plus the vectors of clients it trains this round whose home is another rank
    (``clients.placement: per_round``): reads and writes of a borrowed client go to its borrowed vector, every
    other client's to the store. What checkpoints publish (``clients``) is the home clients' alone: a
    borrowed vector goes back to its home before the round ends (``mpifl.roles.lending``)."""

    def __init__(self, store: RamResiduals | DiskResiduals):
        self.store, self.firsts = store, store.firsts
        self.borrowed: dict[int, torch.Tensor] = {}  # client -> its whole vector, for this round
        self.owned: dict[int, bool] = {}  # borrowed client -> whether it has a vector of its own (has())

    def __repr__(self) -> str:
        return f"<{self.store!r}, {len(self.borrowed)} borrowed>"

    def read(self, client: int, index: int) -> torch.Tensor:
        """Chunk ``index`` of the client's vector: its borrowed one, or the store's."""
        vector = self.borrowed.get(client)
        if vector is None:
            return self.store.read(client, index)
        return vector[self.firsts[index]:self.firsts[index + 1]]

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Store chunk ``index``: into the borrowed vector, or the store."""
        vector = self.borrowed.get(client)
        if vector is None:
            self.store.write(client, index, values)
            return
        _copy_into(vector[self.firsts[index]:self.firsts[index + 1]], values)
        self.owned[client] = True

    def clients(self) -> list[int]:
        """The home clients with a vector (a borrowed one is its home's to publish)."""
        return self.store.clients()

    def has(self, client: int) -> bool:
        """Whether ``client`` has a vector of its own: as its home said when lending it, or written since."""
        return self.owned[client] if client in self.borrowed else self.store.has(client)

    def end_loans(self) -> None:
        """The round's loans are over: forget the borrowed vectors."""
        self.borrowed.clear()
        self.owned.clear()


class UndoJournal:
    """A store whose writes of the latest round to some of its chunks can be taken back, client by client: SCAFFOLD's
    c_i, FedDyn's g_i and a plug-in trainer's declared vectors under ``clients.accept_failures`` with straggler
    drops (``ClientStateLayout.journaled_chunks``). A rank dropped past its deadline does not know it was dropped
    while it trains; it learns which of its clients the server dropped from its next header
    (``Header.dropped``). Those clients' journaled chunks go back to what they were before the round, as if
    they had never trained, since the server never summed their deltas into c or h; every other write stands.

    Under ``clients.placement: per_round`` a client's vector belongs to its home rank, which puts it back: a
    rank that trains a borrowed client journals nothing of it (``journaled``), and the home keeps a copy of each
    vector it lends (``remember``), put back once the loan has come home.

    Memory: one copy of the journaled chunks of each client read or lent since the last header, in RAM (about
    per_round / client ranks of them, more where a fixed placement draws several of one rank's clients; ``mpifl plan``
    counts them, ``planning.memory.undo_vectors``)."""

    def __init__(self, store: ResidualStore, chunks: Iterable[int] = (0,),
                 journaled: Callable[[int], bool] = lambda client: True):
        self.store, self.chunks, self.journaled = store, tuple(chunks), journaled
        self.firsts = store.firsts
        self.before: dict[int, dict[int, torch.Tensor]] = {}  # client -> its journaled chunks before the round

    def read(self, client: int, index: int) -> torch.Tensor:
        """Chunk ``index`` of the client's vector, as the store has it. The first read of a journaled chunk since the
        last ``settle`` keeps a copy of them all first: a RAM store's read is a view of the vector itself, which the
        rules update in place before writing it back."""
        if index in self.chunks:
            self._keep(client)
        return self.store.read(client, index)

    def write(self, client: int, index: int, values: torch.Tensor) -> None:
        """Store chunk ``index`` (the journaled chunks it replaces were kept when first read, or are kept now)."""
        if index in self.chunks and client not in self.before and self.journaled(client):
            values = values.clone()  # a file store's read is its scratch, which keeping the others reads over
            self._keep(client)
        self.store.write(client, index, values)

    def _keep(self, client: int) -> None:
        """Copy ``client``'s journaled chunks as its before-round values, once per round, for a client this rank
        journals."""
        if client not in self.before and self.journaled(client):
            self.remember(client)

    def remember(self, client: int) -> None:
        """Keep a copy of ``client``'s journaled chunks as they are now: one this home rank lends, before its loan
        comes home."""
        self.before[client] = {index: self.store.read(client, index).clone() for index in self.chunks}

    def clients(self) -> list[int]:
        """The clients with a vector in the store."""
        return self.store.clients()

    def has(self, client: int) -> bool:
        """Whether ``client`` has a vector in the store."""
        return self.store.has(client)

    def settle(self, dropped: Iterable[int]) -> list[int]:
        """A new header arrived: put back the journaled chunks of the ``dropped`` clients as they were before the last
        one, keep the rest, and start journaling afresh. The clients put back, ascending."""
        undone = sorted(c for c in set(dropped) if c in self.before)
        for client in undone:
            for index, values in self.before[client].items():
                self.store.write(client, index, values)
        self.before.clear()
        return undone


def _copy_into(view: torch.Tensor, values: torch.Tensor) -> None:
    """Copy ``values`` into ``view``, unless they are that very view (a store's read handed back)."""
    if values.data_ptr() != view.data_ptr():
        view.copy_(values)


def whole_vector(store: RamResiduals | DiskResiduals, client: int) -> torch.Tensor:
    """``client``'s whole vector, to send: a RAM store's own (no copy), zeros for a client without one, or a copy
    read chunk by chunk from the file."""
    if isinstance(store, RamResiduals):
        return store.vectors[client] if store.has(client) else torch.zeros(store.firsts[-1])
    out = torch.empty(store.firsts[-1])
    for index, (a, b) in enumerate(zip(store.firsts, store.firsts[1:])):
        out[a:b] = store.read(client, index)
    return out


def landing_vector(store: RamResiduals | DiskResiduals, client: int) -> torch.Tensor:
    """Where ``client``'s whole vector can be received: in place in a RAM store that holds one, else a fresh buffer
    for ``keep_whole``."""
    if isinstance(store, RamResiduals) and store.has(client):
        return store.vectors[client]
    return torch.empty(store.firsts[-1])


def keep_whole(store: RamResiduals | DiskResiduals, client: int, vector: torch.Tensor) -> None:
    """Make ``vector`` ``client``'s whole vector: adopted by a RAM store (no copy), written chunk by chunk to a
    file."""
    if isinstance(store, RamResiduals):
        store.vectors[client] = vector
        return
    for index, (a, b) in enumerate(zip(store.firsts, store.firsts[1:])):
        store.write(client, index, vector[a:b])


def _create(group: h5py.Group, client: int, elements: int) -> h5py.Dataset:
    return group.create_dataset(str(client), shape=(elements,), dtype=np.float32,
                                chunks=(min(elements, HDF5_CHUNK),), fillvalue=np.float32(0))


def residual_bytes(hosted: int, elements: int) -> int:
    """RAM for ``hosted`` clients' whole residuals."""
    return 4 * hosted * elements


def open_residuals(firsts: list[int], hosted: int, ram_bytes: int, path: Path | None,
                   ram_key: str = "compression.residual_ram_mb") -> RamResiduals | DiskResiduals:
    """In RAM while every hosted client's vector fits in ``ram_bytes`` (the config key ``ram_key``), else in the
    HDF5 file ``path``."""
    if residual_bytes(hosted, firsts[-1]) <= ram_bytes:
        return RamResiduals(firsts)
    if path is None:
        raise ValueError(f"{ram_key}: {hosted} clients' vectors "
                         f"({residual_bytes(hosted, firsts[-1]) / 2**20:.1f} MiB) do not fit, and this run has no "
                         f"run directory to keep them on disk; raise {ram_key} or give --run-dir")
    return DiskResiduals(firsts, path)


def save_snapshot(store: ResidualStore, firsts: list[int], folder: Path, rank: int, round_: int,
                  shard: tuple[int, int] = (0, 1)) -> str:
    """Publish the rank's residuals as ``folder/rank<rank>.h5`` (temp file, fsync, rename); return its name.
    ``shard``: (index, count) of the rows a rank of a sharded client group keeps its clients' vectors over
    (``clients.sharding: fsdp``), recorded so a resume reads each rank's rows from the files of the same index."""
    name = RANK_FILE.format(rank=rank)
    tmp = folder / (name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"format": FORMAT, "elements": firsts[-1], "round": round_, "shard": shard[0],
                        "shards": shard[1]})
        group = f.create_group("clients")
        for client in store.clients():
            dataset = _create(group, client, firsts[-1])
            for index in range(len(firsts) - 1):
                dataset.write_direct(store.read(client, index).numpy(), dest_sel=np.s_[firsts[index]:firsts[index + 1]])
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)
    return name


def load_snapshot(store: ResidualStore, firsts: list[int], files: Iterable[Path], hosted: Iterable[int],
                  shard: tuple[int, int] = (0, 1)) -> int:
    """Read the ``hosted`` clients' residuals from a checkpoint's files (whichever holds each); how many were found.
    ``shard``: a rank of a sharded client group reads only the files of its own rows (``save_snapshot``), whichever
    group wrote them; a checkpoint sharded over another number of ranks is refused, naming both."""
    hosted, found = set(hosted), 0
    for path in files:
        with h5py.File(path, "r") as f:
            kept = (int(f.attrs.get("shard", 0)), int(f.attrs.get("shards", 1)))
            if kept[1] != shard[1]:
                raise ValueError(f"{path}: per-client state kept over {kept[1]} shard(s) of each client's rows; this "
                                 f"run keeps it over {shard[1]} (clients.ranks_per_client with clients.sharding: "
                                 f"fsdp): resume with the checkpoint's number")
            if kept[0] != shard[0]:
                continue
            if f.attrs.get("format") != FORMAT or int(f.attrs["elements"]) != firsts[-1]:
                raise ValueError(f"{path}: not residuals of this model ({firsts[-1]} elements)")
            for name in sorted(f["clients"], key=int):
                client = int(name)
                if client not in hosted:
                    continue
                found += 1
                for index in range(len(firsts) - 1):
                    out = store.read(client, index)
                    f["clients"][name].read_direct(out.numpy(), source_sel=np.s_[firsts[index]:firsts[index + 1]])
                    store.write(client, index, out)
    return found
