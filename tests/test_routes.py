"""A round's routes (mpifl.planning.routes), without MPI: the model's broadcast tree, the chain reduction's one
stream, and what each rank's header says of them."""
from __future__ import annotations

from mpifl.config import TransportConfig
from mpifl.planning.federation import RoundAssignment
from mpifl.planning.routes import RoundRoutes
from mpifl.wire import protocol

# ranks 1..4 train two clients each; with clients.groups each rank sends its groups' sums
POINT_TO_POINT = RoundAssignment(3, tuple(range(8)), {1: [0, 4], 2: [1, 5], 3: [2, 6], 4: [3, 7]},
                                 {1: [0, 4], 2: [1, 5], 3: [2, 6], 4: [3, 7]})
GROUPED = RoundAssignment(3, tuple(range(8)), POINT_TO_POINT.train, {1: [0], 2: [1], 3: [2], 4: [3]})


def test_without_a_tree_or_a_chain_the_server_sends_to_every_training_rank_and_hears_every_stream():
    routes = RoundRoutes.of(POINT_TO_POINT, TransportConfig(), grouped=False)
    assert routes.tree is None and routes.chain is None and routes.labels is None
    assert routes.model_dests == [1, 2, 3, 4] and routes.streams == POINT_TO_POINT.streams
    assert routes.header_clients == 1
    assert routes.header_of(2) == (protocol.SERVER, (), (), None)


def test_a_fanout_of_two_sends_to_two_ranks_which_pass_the_model_on():
    routes = RoundRoutes.of(POINT_TO_POINT, TransportConfig(dispatch_fanout=2), grouped=False)
    assert routes.model_dests == [1, 2]
    assert routes.header_of(1)[:2] == (protocol.SERVER, (3, 4)) and routes.header_of(4)[:2] == (1, ())
    assert routes.streams == POINT_TO_POINT.streams  # updates still come straight back


def test_the_chain_over_reduction_groups_ends_in_one_stream_from_its_last_hop_named_by_the_first_group():
    routes = RoundRoutes.of(GROUPED, TransportConfig(reduce="chain"), grouped=True)
    assert routes.streams == {4: [0]}  # groups 0..3 in ascending id: ranks 1 -> 2 -> 3 -> 4 -> server
    assert routes.header_clients == 8  # the last hop's header lists every group's members
    assert routes.labels is not None and "reduction groups 0-3 on ranks 1-4" in routes.labels[0]
    parent, children, hops, stream = routes.header_of(2)
    assert (parent, children, stream) == (protocol.SERVER, (), 0)
    assert hops == (protocol.ChainHop((1,), 1, 3),)


def test_grouped_point_to_point_headers_list_the_largest_rank_s_members():
    routes = RoundRoutes.of(GROUPED, TransportConfig(), grouped=True)
    assert routes.header_clients == 2 and routes.streams == GROUPED.streams
