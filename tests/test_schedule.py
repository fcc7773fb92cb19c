"""The fold schedule: which update chunks the server may fold, in which order (in-process, no MPI)."""
from __future__ import annotations

import random
from collections import defaultdict

import pytest

from mpifl.aggregation.schedule import ChunkTicket, Finish, Fold, FoldSchedule, MetaTicket


def land_all(schedule: FoldSchedule, rank: int, failed: frozenset = frozenset()) -> list:
    """Headers and chunks of every participant on ``rank`` land in stream order; return the steps."""
    for client in sorted(c for c, r in schedule.rank_of.items() if r == rank):
        schedule.meta_landed(client, client not in failed)
    slot = 0
    while (ticket := schedule.chunk_ticket(rank, slot)) is not None:
        schedule.chunk_landed(ticket)
        slot += 1
    return schedule.steps()


def folds(steps: list) -> list[tuple[int, int, int | None]]:
    """(chunk, client, row) of each Fold among ``steps``."""
    return [(s.chunk, s.client, s.row) for s in steps if isinstance(s, Fold)]


# -- examples -----------------------------------------------------------------------------------

def test_each_rank_streams_its_participants_in_ascending_id_each_ones_chunks_in_order():
    schedule = FoldSchedule({1: [7, 2], 2: [4]}, num_chunks=2, window=2)
    assert schedule.order == [2, 4, 7]
    assert schedule.stream(1) == [(2, 0), (2, 1), (7, 0), (7, 1)]
    tickets = [schedule.chunk_ticket(1, slot) for slot in range(5)]
    assert tickets[:4] == [ChunkTicket(1, 0, 2, 0), ChunkTicket(1, 1, 2, 1), ChunkTicket(1, 2, 7, 0),
                           ChunkTicket(1, 3, 7, 1)]
    assert tickets[4] is None  # the stream is all claimed: the slot stays free


def test_header_receives_are_posted_until_every_header_from_the_rank_is_in():
    schedule = FoldSchedule({1: [0, 2]}, num_chunks=1, window=1)
    assert schedule.meta_ticket(1) == MetaTicket(1)
    schedule.meta_landed(0, usable=True)
    assert schedule.meta_ticket(1) == MetaTicket(1)
    schedule.meta_landed(2, usable=True)
    assert schedule.meta_ticket(1) is None


def test_a_late_first_participant_holds_back_folding_of_chunk_0():
    schedule = FoldSchedule({1: [3], 2: [5]}, num_chunks=1, window=1)
    assert land_all(schedule, rank=2) == []
    assert land_all(schedule, rank=1) == [Fold(0, 3, 0, 1, 0, 0), Fold(0, 5, 1, 2, 0, 1), Finish(0, 2)]
    assert schedule.done


def test_a_dropped_rank_loses_only_its_headerless_participants_and_the_others_fold_without_them():
    schedule = FoldSchedule({1: [1, 4], 2: [2, 5]}, num_chunks=2, window=2)
    schedule.meta_landed(1, usable=True)  # rank 1 sent client 1's header, then fell behind training client 4
    for slot in range(2):
        schedule.chunk_landed(schedule.chunk_ticket(1, slot))
    assert schedule.headerless(1) == [4]
    assert schedule.drop(1) == [4]
    assert schedule.meta_ticket(1) is None and schedule.chunk_ticket(1, slot=9) is None  # nothing more awaited
    steps = schedule.steps() + land_all(schedule, rank=2)
    assert sorted(folds(steps)) == [(0, 1, 0), (0, 2, 1), (0, 4, None), (0, 5, 2),
                                    (1, 1, 0), (1, 2, 1), (1, 4, None), (1, 5, 2)]
    assert [s.slot for s in steps if isinstance(s, Fold) and s.client == 4] == [None, None]  # never received
    assert [s for s in steps if isinstance(s, Finish)] == [Finish(0, 3), Finish(1, 3)]
    assert schedule.done


def test_a_chunk_waits_for_its_participants_header():
    schedule = FoldSchedule({1: [3]}, num_chunks=1, window=1)
    schedule.chunk_landed(schedule.chunk_ticket(1, slot=4))
    assert schedule.steps() == []
    schedule.meta_landed(3, usable=True)
    assert schedule.steps() == [Fold(0, 3, 0, 1, 4, 0), Finish(0, 1)]


def test_a_failed_participant_keeps_its_place_but_is_skipped_and_not_counted():
    schedule = FoldSchedule({1: [1], 2: [2], 3: [3]}, num_chunks=1, window=1)
    land_all(schedule, rank=2, failed=frozenset({2}))
    land_all(schedule, rank=3)
    steps = land_all(schedule, rank=1)
    assert folds(steps) == [(0, 1, 0), (0, 2, None), (0, 3, 1)]
    assert steps[-1] == Finish(0, count=2)


def test_chunks_beyond_the_window_wait_for_the_lowest_unfinished_chunk():
    schedule = FoldSchedule({1: [0]}, num_chunks=3, window=1)
    schedule.meta_landed(0, usable=True)
    tickets = [schedule.chunk_ticket(1, slot) for slot in range(3)]
    schedule.chunk_landed(tickets[1])
    schedule.chunk_landed(tickets[2])
    assert schedule.steps() == []
    schedule.chunk_landed(tickets[0])
    assert [type(s).__name__ + str(s.chunk) for s in schedule.steps()] == \
        ["Fold0", "Finish0", "Fold1", "Finish1", "Fold2", "Finish2"]
    assert schedule.low == 3 and schedule.done


def test_ready_chunks_fold_in_arrival_order_across_chunks():
    schedule = FoldSchedule({1: [0]}, num_chunks=3, window=3)
    tickets = [schedule.chunk_ticket(1, slot) for slot in range(3)]
    for j in (2, 0, 1):
        schedule.chunk_landed(tickets[j])
    schedule.meta_landed(0, usable=True)
    assert [s.chunk for s in schedule.steps() if isinstance(s, Fold)] == [2, 0, 1]


def test_accumulators_cycle_through_the_window():
    schedule = FoldSchedule({1: [0]}, num_chunks=5, window=2)
    assert [schedule.accumulator(j) for j in range(5)] == [0, 1, 0, 1, 0]


def test_a_window_narrower_than_the_model_is_refused_when_a_rank_hosts_several_participants():
    with pytest.raises(ValueError, match="must span all 4 chunks"):
        FoldSchedule({1: [0, 1]}, num_chunks=4, window=2)
    FoldSchedule({1: [0], 2: [1]}, num_chunks=4, window=2)


def test_a_round_without_participants_is_done_once_it_has_no_chunks_left():
    assert FoldSchedule({}, num_chunks=0, window=0).done
    assert not FoldSchedule({}, num_chunks=1, window=1).steps()


# -- property: any arrival order a receiver can observe ------------------------------------------

class Receiver:
    """What StreamedReduction does, with MPI replaced by a random choice of which posted receives land.

    Each rank's header stream and chunk stream keep their order (the k-th posted receive on a rank
    gets its k-th message); the two may interleave. With ``headers_first`` a client's header lands
    before its chunks (what MPICH delivers: the header is sent first); otherwise it may lag behind.
    With ``held`` (robust strategies, one participant per rank) an included participant's slot stays
    full until its chunk finishes, as a row of the stack the sorting network reads.
    """

    def __init__(self, rng: random.Random, by_rank: dict[int, list[int]], num_chunks: int, window: int,
                 slots_per_rank: int, failed: set[int], headers_first: bool, held: bool = False):
        self.rng, self.failed, self.headers_first, self.held = rng, failed, headers_first, held
        self.rows: dict[int, list[Fold]] = defaultdict(list)  # held: chunk -> the folds whose slots it keeps
        self.schedule = FoldSchedule(by_rank, num_chunks, window)
        self.free_slots = list(range(slots_per_rank * len(by_rank)))
        self.pending: list = []  # posted, not landed
        self.in_slot: dict[int, ChunkTicket] = {}  # posted or landed, not yet folded
        self.headers_in: dict[int, list[int]] = {r: [] for r in by_rank}
        self.steps: list = []
        for rank in self.schedule.ranks:
            self.post_meta(rank)
            for _ in range(slots_per_rank):
                self.post_chunk(rank, self.free_slots.pop())

    def post_meta(self, rank: int) -> None:
        ticket = self.schedule.meta_ticket(rank)
        if ticket is not None:
            self.pending.append(ticket)

    def post_chunk(self, rank: int, slot: int) -> None:
        ticket = self.schedule.chunk_ticket(rank, slot)
        if ticket is None:
            self.free_slots.append(slot)
            return
        assert slot not in self.in_slot, f"slot {slot} reposted while it holds {self.in_slot[slot]}"
        self.in_slot[slot] = ticket
        self.pending.append(ticket)

    def landable(self, ticket) -> bool:
        if isinstance(ticket, MetaTicket) or not self.headers_first:
            return True
        return ticket.client in self.headers_in[ticket.rank]

    def land(self, ticket) -> None:
        self.pending.remove(ticket)
        if isinstance(ticket, ChunkTicket):
            self.schedule.chunk_landed(ticket)
            return
        hosted = sorted(c for c, r in self.schedule.rank_of.items() if r == ticket.rank)
        client = hosted[len(self.headers_in[ticket.rank])]  # the rank's headers come in id order
        self.headers_in[ticket.rank].append(client)
        self.schedule.meta_landed(client, client not in self.failed)
        self.post_meta(ticket.rank)

    def run(self) -> None:
        while not self.schedule.done:
            ready = [t for t in self.pending if self.landable(t)]
            assert ready, f"deadlock: chunks {self.schedule.low}.. unfinished, nothing can land"
            count = 1 if self.rng.random() < 0.5 else self.rng.randint(1, len(ready))
            for ticket in self.rng.sample(ready, count):  # one Testsome: some of what completed
                self.land(ticket)
            for step in self.schedule.steps():
                self.steps.append(step)
                if isinstance(step, Fold):
                    held = self.in_slot[step.slot]
                    assert (held.client, held.chunk, held.rank) == (step.client, step.chunk, step.rank)
                    if self.held and step.row is not None:
                        self.rows[step.chunk].append(step)
                        continue
                    self.release(step)
                else:
                    for fold in self.rows.pop(step.chunk, []):
                        self.release(fold)
        assert not self.pending and not self.in_slot, "receives left posted after the round"

    def release(self, fold: Fold) -> None:
        del self.in_slot[fold.slot]
        self.post_chunk(fold.rank, fold.slot)


def random_round(rng: random.Random) -> dict:
    """1-5 ranks hosting 1-4 participants each, 1-12 chunks, 1-4 slots per rank, ~20% failed participants;
    with one participant per rank, half the rounds hold their slots as the stack (PoolLayout.held_stacks)."""
    ranks = rng.randint(1, 5)
    most = 1 if rng.random() < 0.3 else 4  # a third of the rounds: one participant per rank
    hosted = [rng.randint(1, most) for _ in range(ranks)]
    clients = rng.sample(range(40), sum(hosted))  # ids interleave across ranks in any way
    by_rank, start = {}, 0
    for rank in rng.sample(range(1, ranks + 1), ranks):  # the caller's rank order varies too
        by_rank[rank] = clients[start:start + hosted[rank - 1]]
        start += hosted[rank - 1]
    num_chunks = rng.randint(1, 12)
    sequential = any(n > 1 for n in hosted)
    held = not sequential and rng.random() < 0.5
    return {"by_rank": by_rank, "num_chunks": num_chunks, "held": held,
            "window": num_chunks if sequential or held else rng.randint(1, num_chunks),
            "slots_per_rank": rng.randint(1, 4), "failed": {c for c in clients if rng.random() < 0.2}}


def check_round(receiver: Receiver, failed: set[int], num_chunks: int, window: int) -> None:
    """Every chunk finished once, folded once per participant in ascending id, within the window."""
    schedule = receiver.schedule
    per_chunk: dict[int, list[Fold]] = defaultdict(list)
    finished: list[int] = []
    live: dict[int, int] = {}  # chunk -> accumulator, from its first included fold to its finish
    for i, step in enumerate(receiver.steps):
        if isinstance(step, Finish):
            assert isinstance(receiver.steps[i - 1], Fold) and receiver.steps[i - 1].chunk == step.chunk
            assert len(per_chunk[step.chunk]) == len(schedule.order), "finished before every participant"
            assert step.count == len(schedule.order) - len(failed)
            finished.append(step.chunk)
            live.pop(step.chunk, None)
            continue
        per_chunk[step.chunk].append(step)
        if step.row == 0:
            live[step.chunk] = schedule.accumulator(step.chunk)
            assert len(live) <= window, f"{len(live)} accumulators live, window {window}"
            assert len(set(live.values())) == len(live), "two live chunks share an accumulator"
    assert sorted(finished) == list(range(num_chunks)), "every chunk finishes exactly once"
    usable = [c for c in schedule.order if c not in failed]
    for j in range(num_chunks):
        assert [f.client for f in per_chunk[j]] == schedule.order, f"chunk {j}: not folded in ascending id"
        assert [f.position for f in per_chunk[j]] == list(range(len(schedule.order)))
        assert [f.row for f in per_chunk[j] if f.row is not None] == list(range(len(usable)))
        assert {f.client for f in per_chunk[j] if f.row is None} == failed, f"chunk {j}: failed not skipped"


@pytest.mark.parametrize("headers_first", [True, False], ids=["headers-before-chunks", "headers-may-lag"])
def test_any_observable_arrival_order_folds_every_chunk_once_in_ascending_id_within_the_window(headers_first):
    """Also with slots held as the stack: never a deadlock, and every held slot is freed once."""
    rng = random.Random(20240611 + headers_first)
    held_rounds = 0
    for trial in range(2500):  # 5,000 rounds over both parametrisations
        case = random_round(rng)
        receiver = Receiver(rng, headers_first=headers_first, **case)
        held_rounds += case["held"]
        try:
            receiver.run()
            check_round(receiver, case["failed"], case["num_chunks"], case["window"])
        except AssertionError as e:
            raise AssertionError(f"trial {trial}: {case}: {e}") from e
    assert held_rounds > 200, "rounds whose slots are the stack were drawn too rarely to test them"
