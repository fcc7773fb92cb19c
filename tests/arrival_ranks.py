"""Run under mpiexec by tests/test_arrive_together.py: the last rank arrives ``LATE`` seconds after the others, which
wait for it in ``arrive_together``; each early rank prints the CPU-seconds and the seconds its wait took."""
from __future__ import annotations

import time

from mpi4py import MPI

from mpifl.wire.transport import arrive_together

LATE = 2.0  # seconds


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    comm.Barrier()  # everyone started: the late rank's delay is all the early ones wait
    if rank == last:
        time.sleep(LATE)  # asleep: it takes no core from the others
    cpu, began = time.process_time(), time.perf_counter()
    arrive_together(comm)
    if rank != last:
        print(f"rank {rank} waited {time.perf_counter() - began:.3f} s using {time.process_time() - cpu:.3f} CPU-s",
              flush=True)


if __name__ == "__main__":
    main()
