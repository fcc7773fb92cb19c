"""The wire protocol, on one screen.

Start-up (once):
    c -> 0  STARTUP  (pickled, small) each client rank's model spec, any local problem and the
                     seconds its build took; rank 0 waits for a rank only as long as the build
                     took the others (mpifl.roles.launch.gather_within), names any model that
                     differs from its own, then bcasts the verdict.
    1 -> 0  DATASET (pickled, small) the data rank 1 read, less its tensors, or the error reading it;
                    then (pickled, small) the shapes and dtypes of its training labels and held-out set,
                    then each one's raw bytes (wire.shared.send_tensors). Rank 1 shares the whole with the
                    other client ranks in a communicator of their own: the server never holds the inputs.
    1 -> 0  INIT    out-of-core server, fresh start only: rank 1 streams its freshly
                    built model (chunk order), which the server writes as round 0.
Every round r:
    0 -> c  HEADER  (pickled, small) a RoundOrder: the round and the logical clients this rank
                    serves this round (ascending ids); a Stop ends the run (saying whether
                    on request, before the last round). Every header names
                    the rank's clients dropped since its last one.
    0 -> c  MODEL   the global model, chunk by chunk (Isend/Irecv of raw bytes, chunk
                    order), only to ranks that serve at least one client this round.
    c -> 0  META    UpdateMeta (pickled, small) for each logical client, ascending id,
                    sent just before that client's chunks; ``error`` set means the
                    client failed (accept_failures) and the server skips its chunks.
    c -> 0  UPDATE  that client's weights or delta, chunk by chunk (raw bytes, chunk
                    order), float32 tensors optionally narrowed to strategy.wire_dtype.
With clients.groups, a rank sends per reduction group (ascending id) one GroupMeta (its
members' UpdateMetas) on META, then the group's fp32 partial sum on UPDATE. A client's group is
c mod G, or (clients.group_by: cost) the header's ``groups`` entry for it.
Asynchronous FL (a HoldOrder): the listed clients train from MODEL and their updates stay on
the rank; then the rank sends META + UPDATE for the held updates in its ``send``, in that order
(the virtual-arrival order), which may include some trained this very step.
Error feedback, before rank 0 publishes a checkpoint of round r (two phases):
    0 -> c  HEADER     PersistOrder(r, folder=...): every client rank publishes its clients'
                       residuals as folder/rank<rank>.h5,
    c -> 0  RESIDUALS  the file's name (pickled, small): only then is the checkpoint published.
Per-client state under clients.placement: per_round (a client trains on any rank, its state stays on its
home rank, 1 + c mod N): after the header, before MODEL, and again once the rank has sent its round's updates,
    home -> c  STATE  the state vector of each client in the trainer's header ``borrow`` (fp32, one message per
                      state chunk, ascending client id), lent for the round;
    c -> home  STATE_BACK  the same vectors back, updated, once the borrower has sent its round.
transport.dispatch_fanout (a broadcast tree): a rank receives MODEL from its header's parent and
passes each chunk on to its header's children as it lands.
transport.reduce: chain (with clients.groups): the round's reduction groups form a chain in
ascending group id, the server's fold order (``chain_hops``). A hop is a run of consecutive groups
on one rank; a rank with several groups may hold several hops. Each hop receives the running
partial sum from the hop before it (REDUCE_META: a GroupMeta of every member so far; REDUCE: fp32
chunks), adds its groups' sums one after another chunk by chunk, and passes it on; the last sends
it to rank 0 as META + UPDATE, one stream for the whole round. A rank runs its hops' GroupMetas
first, then their chunks in (chunk, hop) order, so no hop waits on a later one.
While a client rank trains:
    c -> 0  PROGRESS  (pickled, tiny) the round, at most once a second, sent from a forward pass
                      of the rank's model: a rank stuck in user code cannot send it.
clients.ranks_per_client R > 1: client ranks form groups of R consecutive ranks; the first of each (the
leader) alone speaks the protocol above, on a communicator of rank 0 and the leaders. In its group's
own communicator, before each logical client trains:
    leader -> member  GROUP  TrainOrder (pickled, small): the client, its seed and local steps (stop=True
                      at the end); the first carries the leader's address for the process group's
                      rendezvous. Then the leader's weights reach the group by a torch.distributed
                      broadcast, and the group trains the client in DDP (mpifl.learning.parallel).
MPI's non-overtaking rule keeps each (source, tag) stream in order, so chunks carry
no per-chunk header: both sides derive the layout from the same ModelSpec.
Round tags: MODEL, META, UPDATE, REDUCE_META and REDUCE travel on ``round_tag(kind, round)``, so a
late sender's chunks (a rank dropped from round r under clients.accept_failures, whose stream rank 0
drains in the background: wire.late) can never match round r+1's receives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SERVER = 0

HEADER = 11
MODEL = 12
META = 13
UPDATE = 14
INIT = 15
RESIDUALS = 16
REDUCE_META = 17
REDUCE = 18
STARTUP = 19
PROGRESS = 20
GROUP = 21  # in a client group's own communicator (clients.ranks_per_client)
DATASET = 22
FLOOR_DOWN = 23  # the raw-MPI floor probe before round 1 (mpifl.aggregation.floor)
FLOOR_UP = 24
STATE = 25  # round-scoped: per-client state lent to the rank that trains the client (per_round placement)
STATE_BACK = 26  # round-scoped: that state handed back, updated
GROUP_COST = 27  # in a client group's communicator: what a member spent on an order, to its leader

ROUND_TAG_STRIDE = 32  # every fixed tag above is below it
ROUND_TAG_CYCLE = 1000  # rounds before a tag repeats: 20 + 32 * 999 stays within 32767, MPI's least TAG_UB


def round_tag(kind: int, round_: int) -> int:
    """The tag of a round-scoped stream (MODEL, META, UPDATE, REDUCE_META, REDUCE, STATE,
    STATE_BACK) in round ``round_``.

    A tag repeats only every ROUND_TAG_CYCLE rounds, and a dropped rank's stream is drained long before.
    """
    return kind + ROUND_TAG_STRIDE * (round_ % ROUND_TAG_CYCLE)


@dataclass(frozen=True)
class ChainHop:
    """One hop of the chain reduction: add ``groups``' partial sums, in this order, to the running sum from
    rank ``source`` (None: this hop starts it) and send the result to rank ``dest`` (SERVER: the last hop)."""

    groups: tuple[int, ...]
    source: int | None
    dest: int


def chain_hops(streams: dict[int, list[int]]) -> dict[int, tuple[ChainHop, ...]]:
    """Each sending rank's hops of the chain over a round's reduction groups (``streams``: rank -> its groups).

    The running sum visits the groups in ascending id, the order in which the server folds them point to point,
    so the chain adds exactly the same terms in exactly the same order: the same bits on any number of ranks. A
    hop is a run of consecutive groups on one rank (a rank's groups are summed one after another there, never
    into one sum first, which would round differently from one layout to another)."""
    order = sorted((group, rank) for rank, groups in streams.items() for group in groups)
    runs: list[tuple[int, list[int]]] = []
    for group, rank in order:
        if runs and runs[-1][0] == rank:
            runs[-1][1].append(group)
        else:
            runs.append((rank, [group]))
    hops: dict[int, list[ChainHop]] = {}
    for i, (rank, groups) in enumerate(runs):
        source = runs[i - 1][0] if i else None
        dest = runs[i + 1][0] if i + 1 < len(runs) else SERVER
        hops.setdefault(rank, []).append(ChainHop(tuple(groups), source, dest))
    return {rank: tuple(h) for rank, h in hops.items()}


@dataclass(frozen=True)
class Header:
    """What every message on HEADER carries: its round, and this rank's logical clients that the server dropped past
    their deadline since the rank's last header (clients.accept_failures: their updates were never folded, so
    their per-client state goes back)."""

    round: int
    dropped: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stop(Header):
    """The run is over: leave the round loop."""

    interrupted: bool = False  # a stop on request (SIGTERM) before the last round: note 'interrupted', as rank 0 does


@dataclass(frozen=True)
class PersistOrder(Header):
    """Publish this rank's per-client state of round ``round`` in ``folder`` (one file per rank), then acknowledge on
    RESIDUALS: rank 0 publishes a checkpoint only once every client rank has."""

    folder: str = ""


@dataclass(frozen=True)
class RoundOrder(Header):
    """What a client rank does this round: train ``clients`` from the model sent now and send their updates."""

    clients: tuple[int, ...] = ()  # train from the model sent now (ascending)
    participants: int = 0  # the logical clients sampled this round on every rank together (a trainer's context)
    # the run's last round, which privacy.epsilon_budget ends early: federated evaluation is due in it whatever
    # eval.federated_every says, as it is in the configured last round
    last: bool = False
    clip: float | None = None  # DP: the L2 bound of this round's updates
    cohort: tuple[int, ...] = ()  # secure aggregation: every participant of the round (pairwise masks)
    steps: tuple[int, ...] = ()  # fedcompass: each listed client's own local steps (aligned with ``clients``)
    groups: tuple[int, ...] = ()  # clients.group_by 'cost': each listed client's reduction group (else c mod G)
    parent: int = 0  # the rank the global model comes from (transport.dispatch_fanout: a broadcast tree)
    children: tuple[int, ...] = ()  # the ranks this rank passes each model chunk on to
    chain: tuple[ChainHop, ...] = ()  # transport.reduce=chain: this rank's hops, in the chain's order
    reduce_stream: int | None = None  # chain: the stream id rank 0 receives the round's sum as (None: no chain)
    # per_round placement with per-client state: (client, home rank) of each listed client whose state lives
    # elsewhere, borrowed for the round; and (client, trainer rank) of each client homed here that trains elsewhere
    borrow: tuple[tuple[int, int], ...] = ()
    lend: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HoldOrder(RoundOrder):
    """Asynchronous FL: train ``clients`` and keep their updates on the rank; send the held updates in ``send`` now,
    in this order (the virtual-arrival order), some of them perhaps trained this very step."""

    send: tuple[int, ...] = ()


PICKLED_RECEIVE_BYTES = 32 * 1024  # mpi4py's buffer for a pickled ``irecv`` posted without one (rc.irecv_bufsz)
MEMBER_HEADER_BYTES = 4 * 1024  # a bound on one member's pickled UpdateMeta inside a reduction group's header


def header_bytes(clients: int) -> int:
    """The buffer to post an update header's receive with, for a header that lists ``clients`` logical clients.

    Why: a pickled nonblocking receive lands in a buffer of fixed size, posted before the message's size is known
    (mpi4py/mpi4py#591), and mpi4py's default of 32 KiB truncates a reduction group's header once the group has a
    few hundred members (MPI_ERR_TRUNCATE at 1,000 clients a round on one rank)."""
    return PICKLED_RECEIVE_BYTES + MEMBER_HEADER_BYTES * max(clients - 1, 0)


@dataclass(frozen=True)
class UpdateMeta:
    """Sent before a logical client's update chunks."""

    client: int
    num_samples: int
    train_seconds: float
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why this client's update must not be used (it still sends its chunks)
    local_steps: int | None = None  # optimizer steps the trainer took (None: the trainer did not say)
    # mpifl's own scores of the client's validation split (roles.evaluation: accuracy, loss, samples, personal_*),
    # kept apart from ``metrics`` so that nothing a trainer reports can stand in for them
    evaluation: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GroupMeta:
    """Sent before a reduction group's partial sum: its members' headers (failed ones left out of the sum)."""

    group: int
    members: tuple[UpdateMeta, ...]

    @property
    def usable(self) -> bool:
        """Whether the partial sum holds at least one update."""
        return any(m.error is None for m in self.members)


@dataclass(frozen=True)
class TrainOrder:
    """A client group's leader to its other ranks: train this logical client with me now (or stop)."""

    client: int = -1
    seed: int = 0
    steps: int | None = None  # the client's own local steps (fedcompass), else the config's
    address: tuple[str, int] | None = None  # the first order: where the group's rendezvous store listens
    stop: bool = False
    interrupted: bool = False  # with stop: the run stopped on request before its last round (protocol.Stop)
    personal: bool = False  # Ditto: train the client's personal model (sent with the global one), not the global
    round: int = 0  # the round it trains for, which the members note in the run directory (mpifl status)
