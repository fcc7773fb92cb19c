"""The memory model's node arithmetic: nodes filled in rank order as the launchers do, and advice that fits."""
from __future__ import annotations

from mpifl.cli.plan import node_warning
from mpifl.config import load_config
from mpifl.planning.memory import MemoryEstimate, fullest_node

GIB = 2**30


def test_the_fullest_node_counts_only_the_ranks_the_launcher_puts_there():
    # 70B out of core: a server of ~1 GiB and 4 clients of 132 GiB, 4 ranks per node: the server and three
    # clients share node 1, the fourth client is alone on node 2 (not 4 x 132 GiB)
    assert fullest_node(1 * GIB, 132 * GIB, nranks=5, ranks_per_node=4, server_alone=False) == 397 * GIB
    assert fullest_node(1 * GIB, 132 * GIB, nranks=5, ranks_per_node=4, server_alone=True) == 4 * 132 * GIB
    assert fullest_node(9 * GIB, 1 * GIB, nranks=3, ranks_per_node=4, server_alone=False) == 11 * GIB
    assert fullest_node(2 * GIB, 3 * GIB, nranks=9, ranks_per_node=4, server_alone=False) == 12 * GIB


def test_the_node_warning_gives_only_advice_the_config_does_not_already_follow():
    plan = MemoryEstimate(model_bytes=GIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB,
                          node_bytes=600 * GIB)
    on_disk = node_warning(load_config(None, ["server.state=disk", "eval.every=0"]), plan, 512, server_alone=True)
    assert on_disk is not None and "server.state=disk" not in on_disk and "--server-alone" not in on_disk
    in_memory = node_warning(load_config(None), plan, 512, server_alone=False)
    assert in_memory is not None and "server.state=disk" in in_memory and "--server-alone" in in_memory
    assert node_warning(load_config(None), plan, 1024, server_alone=False) is None
    assert node_warning(load_config(None), plan, None, server_alone=False) is None
