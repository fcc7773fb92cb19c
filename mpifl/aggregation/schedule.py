"""The fold schedule: in which order the server folds a round's update chunks (no MPI, no tensors).

Every participant's update arrives as a stream of chunks from its rank; each rank sends its
participants in the fold order (ascending id, or an explicit ``order``: asynchronous FL folds in
virtual-arrival order), each one's header (``UpdateMeta``) just before its chunks, the chunks in
order. An arrived chunk (participant p, chunk j) is folded as soon as it is next in the fixed
order for chunk j and p's header is in; early arrivals wait in their receive slots. So the sum
for every element is taken in the same order whatever order chunks land in, and the result is
bitwise reproducible.

At most ``window`` chunks are in progress at once: chunk j folds only while j < low + window,
``low`` being the lowest unfinished chunk, and uses accumulator ``j % window``. When a rank hosts
several participants it sends them one after another, so chunk j of its second participant comes
only after every chunk of its first: the window must then span the whole model. Deadlock-free:
each rank sends in the fold order, so the earliest participant with chunks outstanding can always fold.

A participant whose header carries an error keeps its place in the order: its chunks are still
received and "folded" (skipped, ``row`` None), so the participants after it can go on. A participant
dropped before its header arrived (``drop``: its rank is past its deadline) is skipped the same way,
without its chunks: nothing of it has been folded, since a participant folds only once its header is in.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MetaTicket:
    """A posted receive for the next update header from ``rank``."""

    rank: int


@dataclass(frozen=True)
class ChunkTicket:
    """A posted receive into ``slot`` for chunk ``chunk`` of ``client``'s update, sent by ``rank`` (slot None:
    the participant was dropped and the chunk will not come)."""

    rank: int
    slot: int | None
    client: int
    chunk: int


@dataclass(frozen=True)
class Fold:
    """Fold ``client``'s chunk ``chunk`` from ``slot`` as included participant ``row`` (None: failed, skip it).

    Afterwards the slot is free for ``rank``'s next receive (None: a dropped participant's, never received).
    """

    chunk: int
    client: int
    position: int
    rank: int
    slot: int | None
    row: int | None


@dataclass(frozen=True)
class Finish:
    """Every participant's chunk ``chunk`` is folded; ``count`` of them were included."""

    chunk: int
    count: int


Ticket = MetaTicket | ChunkTicket  # evaluated at import: needs Python >= 3.10, as the config schema does
Step = Fold | Finish


class FoldSchedule:
    """What may be folded now, given which headers and chunks have arrived."""

    def __init__(self, by_rank: Mapping[int, Sequence[int]], num_chunks: int, window: int,
                 order: Sequence[int] | None = None):
        if num_chunks and window < 1:
            raise ValueError(f"the accumulator window must hold at least one chunk, not {window}")
        if window < num_chunks and any(len(clients) > 1 for clients in by_rank.values()):
            raise ValueError(f"a rank hosts several participants: the window ({window}) must span "
                             f"all {num_chunks} chunks")
        self.num_chunks, self.window = num_chunks, window
        self.ranks = list(by_rank)  # in the caller's order: receives are first posted in it
        everyone = sorted(c for clients in by_rank.values() for c in clients)
        if order is not None and sorted(order) != everyone:
            raise ValueError(f"the fold order {list(order)} must list every stream {everyone} once")
        self.order: list[int] = list(order) if order is not None else everyone
        self.position = {c: i for i, c in enumerate(self.order)}
        self.rank_of = {c: r for r, clients in by_rank.items() for c in clients}
        self._clients = {r: sorted(clients, key=self.position.__getitem__) for r, clients in by_rank.items()}
        self._streams = {r: [(c, j) for c in self._clients[r] for j in range(num_chunks)] for r in by_rank}
        self.low = 0  # the lowest unfinished chunk
        self.finished = [False] * num_chunks
        self._posted = {r: 0 for r in by_rank}  # entries of each rank's stream with a receive posted
        self._headers_owed = {r: len(clients) for r, clients in by_rank.items()}
        self._usable: dict[int, bool] = {}  # client -> header in, without an error
        self._waiting: dict[tuple[int, int], ChunkTicket] = {}  # (chunk, position) -> landed, not folded
        self._candidates: deque[tuple[int, int]] = deque()  # (chunk, position) an event may have made foldable, FIFO
        self._next_position = [0] * num_chunks
        self._included = [0] * num_chunks

    @property
    def done(self) -> bool:
        """Whether every chunk is finished."""
        return self.low >= self.num_chunks

    def stream(self, rank: int) -> list[tuple[int, int]]:
        """What ``rank`` sends, in order: (client, chunk), its clients in fold order, each one's chunks in order."""
        return self._streams[rank]

    def meta_ticket(self, rank: int) -> MetaTicket | None:
        """The header receive to post on ``rank``; None once every header from it is in."""
        return MetaTicket(rank) if self._headers_owed[rank] > 0 else None

    def chunk_ticket(self, rank: int, slot: int) -> ChunkTicket | None:
        """Claim the next entry of ``rank``'s stream for a receive into ``slot``; None when all are claimed."""
        stream, index = self._streams[rank], self._posted[rank]
        if index >= len(stream):
            return None
        self._posted[rank] += 1
        client, chunk = stream[index]
        return ChunkTicket(rank, slot, client, chunk)

    def headerless(self, rank: int) -> list[int]:
        """``rank``'s streams whose header has not arrived, in fold order (headers arrive in that order)."""
        clients = self._clients[rank]
        return clients[len(clients) - self._headers_owed[rank]:]

    def drop(self, rank: int) -> list[int]:
        """Give up on ``rank``'s streams whose header has not arrived: each is skipped in every chunk as a failed
        participant is, without waiting for its chunks. Returns them; the caller cancels its receives."""
        dropped = self.headerless(rank)
        for client in dropped:
            self.meta_landed(client, usable=False)
            position = self.position[client]
            for j in range(self.num_chunks):
                self._waiting[(j, position)] = ChunkTicket(rank, None, client, j)
                self._candidates.append((j, position))
        self._posted[rank] = len(self._streams[rank])
        return dropped

    def meta_landed(self, client: int, usable: bool) -> None:
        """``client``'s header arrived; ``usable`` is False when it reports an error."""
        self._usable[client] = usable
        self._headers_owed[self.rank_of[client]] -= 1
        position = self.position[client]
        self._candidates.extend(key for key in self._waiting if key[1] == position)

    def chunk_landed(self, ticket: ChunkTicket) -> None:
        """The chunk that ``ticket`` was posted for is in its slot."""
        key = (ticket.chunk, self.position[ticket.client])
        self._waiting[key] = ticket
        self._candidates.append(key)

    def accumulator(self, chunk: int) -> int:
        """Which of the ``window`` accumulators ``chunk`` uses."""
        return chunk % self.window

    def steps(self) -> list[Step]:
        """Every fold possible now, in arrival order; a chunk's Finish comes right after its last Fold.

        Only what an event can have made ready is looked at (a landed chunk, a header, the
        fold before it in the same chunk, the window moving on), so the work per chunk does
        not grow with the participants or the chunks in flight.
        """
        steps: list[Step] = []
        while self._candidates:
            key = self._candidates.popleft()
            ticket = self._waiting.get(key)
            if ticket is not None and self._ready(*key):
                del self._waiting[key]
                steps.extend(self._fold(ticket, *key))
        return steps

    def _ready(self, j: int, pos: int) -> bool:
        return j < self.low + self.window and self._next_position[j] == pos and self.order[pos] in self._usable

    def _fold(self, ticket: ChunkTicket, j: int, pos: int) -> list[Step]:
        row = None
        if self._usable[ticket.client]:
            row = self._included[j]
            self._included[j] += 1
        self._next_position[j] += 1
        steps: list[Step] = [Fold(j, ticket.client, pos, ticket.rank, ticket.slot, row)]
        if self._next_position[j] < len(self.order):
            self._candidates.append((j, pos + 1))
            return steps
        self.finished[j] = True
        old_end = self.low + self.window
        while self.low < self.num_chunks and self.finished[self.low]:
            self.low += 1
        # chunks the window has just reached: their next participant may be waiting already
        self._candidates.extend((k, self._next_position[k]) for k in range(old_end, min(self.low + self.window,
                                                                                          self.num_chunks)))
        steps.append(Finish(j, self._included[j]))
        return steps
