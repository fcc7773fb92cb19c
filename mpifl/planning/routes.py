"""Which way a round's bytes go, worked out once per round from its assignment and the transport settings: the
global model's broadcast tree (``transport.dispatch_fanout``), the chain of reduction groups
(``transport.reduce: chain``), and the update streams the server receives. Pure: the server's headers, its
dispatch, its reduction and its record all read the same ``RoundRoutes``."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpifl.config import TransportConfig
from mpifl.planning.federation import RoundAssignment
from mpifl.units import range_list
from mpifl.wire import protocol

Tree = dict[int, tuple[int | None, tuple[int, ...]]]  # rank -> (parent, children)


@dataclass(frozen=True)
class RoundRoutes:
    """A round's routes; ``tree`` and ``chain`` are None when the round has none."""

    tree: Tree | None  # the global model's broadcast tree over the server and the ranks that train
    chain: dict[int, tuple[protocol.ChainHop, ...]] | None  # each sending rank's hops of the chain reduction
    streams: dict[int, list[int]]  # what the server receives: rank -> its streams, in fold order
    model_dests: list[int]  # the ranks the server itself sends the model to
    header_clients: int  # the most logical clients one update header lists
    labels: dict[int, str] | None  # what a deadline message calls a stream, where more than its id says

    @classmethod
    def of(cls, plan: RoundAssignment, transport: TransportConfig, grouped: bool) -> RoundRoutes:
        """The routes of ``plan`` (``grouped``: ranks send their reduction groups' sums, ``clients.groups``)."""
        fanout = transport.dispatch_fanout
        tree = broadcast_tree([protocol.SERVER, *sorted(plan.train)], fanout) if fanout and plan.train else None
        chain = protocol.chain_hops(plan.streams) if transport.reduce == "chain" and plan.streams else None
        streams = chain_streams(plan.streams, chain) if chain else plan.streams
        return cls(tree, chain, streams, list(tree[protocol.SERVER][1]) if tree else sorted(plan.train),
                   header_clients(plan, grouped, chain is not None), chain_labels(streams, chain) if chain else None)

    def header_of(self, rank: int) -> tuple[int, tuple[int, ...], tuple[protocol.ChainHop, ...], int | None]:
        """What ``rank``'s round header says of the routes: its parent and children in the broadcast tree, its hops
        of the chain, and the chain's one stream if it is on the chain."""
        parent, children = self.tree[rank] if self.tree and rank in self.tree else (protocol.SERVER, ())
        assert parent is not None  # only the tree's root, the server, has none; headers go to ranks 1..
        hops = (self.chain or {}).get(rank, ())
        stream = next(iter(self.streams.values()))[0] if self.chain and rank in self.chain else None
        return parent, children, hops, stream


def broadcast_tree(ranks: Sequence[int], fanout: int) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """Each rank's (parent, children) in a ``fanout``-ary tree over ``ranks`` in this order (the first is the
    root): the i-th rank's children are the (i*fanout+1)-th .. (i*fanout+fanout)-th. Depth about
    log_fanout(n), and no rank sends the stream more than ``fanout`` times."""
    ranks = list(ranks)
    return {rank: (ranks[(i - 1) // fanout] if i else None, tuple(ranks[i * fanout + 1:(i + 1) * fanout + 1]))
            for i, rank in enumerate(ranks)}


def chain_streams(streams: dict[int, list[int]],
                  chain: dict[int, tuple[protocol.ChainHop, ...]]) -> dict[int, list[int]]:
    """Under the chain reduction the server receives one stream, from the rank of the chain's last hop, named by
    the round's first group."""
    last = next(rank for rank, hops in chain.items() if hops[-1].dest == protocol.SERVER)
    return {last: [min(min(s) for s in streams.values())]}


def header_clients(plan: RoundAssignment, grouped: bool, chained: bool) -> int:
    """The most logical clients one update header lists this round: a reduction group's members, who all train on
    one rank (under the chain reduction, the last hop's header lists every group's)."""
    if not grouped:
        return 1
    if chained:
        return len(plan.participants)
    return max((len(clients) for clients in plan.train.values()), default=1)


def chain_labels(streams: dict[int, list[int]], chain: dict[int, tuple[protocol.ChainHop, ...]]) -> dict[int, str]:
    """What a deadline message calls the round's one stream under the chain reduction: every rank of the chain
    feeds it, so the rank the server names may be waiting on another."""
    (stream,) = next(iter(streams.values()))
    groups = sorted(g for hops in chain.values() for hop in hops for g in hop.groups)
    return {stream: f"the last hop of the chain over reduction groups {range_list(groups)} on ranks "
                    f"{range_list(chain)}, which waits on each of them"}
