"""Run under mpiexec by tests/test_doorbells.py: every rank of the node opens its doorbells, the pipes' names are
gone once they are open, a napping rank wakes when a peer rings and sleeps its time out when nobody does, and a
ring on another communicator, or to a rank with no pipe, wakes nobody."""
from __future__ import annotations

import time

from mpi4py import MPI

from mpifl.wire.doorbell import Doorbells, pipe_directory

LONG_NAP = 30.0  # seconds: a wake by ring comes far sooner


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    bells = Doorbells.open(comm)
    assert bells is not None, f"rank {rank}: no doorbells on this node"
    assert sorted(bells.peers) == [r for r in range(size) if r != rank], bells.peers
    assert bells.everyone  # one node: every rank can ring every other
    comm.Barrier()
    left = sorted(p.name for p in pipe_directory().glob(f"mpifl-bell-{bells.token}-*"))
    assert not left, f"rank {rank}: pipes left on disk: {left}"

    comm.Barrier()  # rank 0 rings rank 1, which naps
    if rank == 0:
        time.sleep(0.2)
        bells.ring(comm, 1)
    elif rank == 1:
        began = time.perf_counter()
        rung = bells.nap(LONG_NAP)
        assert rung and time.perf_counter() - began < LONG_NAP / 2, (rung, time.perf_counter() - began)

    comm.Barrier()  # nobody rings: the nap lasts its time and says so
    began = time.perf_counter()
    assert not bells.nap(0.05) and time.perf_counter() - began >= 0.05

    comm.Barrier()  # a ring on another communicator (a group's, say) is not this one's, and a stranger has no pipe
    if rank == 0:
        bells.ring(MPI.COMM_SELF, 0)
        bells.ring(comm, size + 5)
    comm.Barrier()
    assert not bells.nap(0.01), f"rank {rank} was woken by a ring meant for nobody here"
    on_node = len(bells.peers) + 1
    bells.close()
    print(f"rank {rank}: ok, {on_node} ranks on the node", flush=True)


if __name__ == "__main__":
    main()
