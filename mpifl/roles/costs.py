"""What a client rank spent, reported with each update's header: CPU-seconds and bytes written since its last
header (receiving the model and the previous update's send included) and, on a GPU, the training's seconds and
the energy NVML's counter saw (roles.records sums them per rank and round)."""
from __future__ import annotations

from mpifl.learning.device import DeviceReplica, GpuEnergy
from mpifl.logs import log
from mpifl.metrics import CostMeter


class UpdateCosts:
    """The cost fields of one rank's update headers.

    Why the energy once a round: the records keep only each rank's sum over the round, which is the same, and
    an NVML query can cost milliseconds where the driver sits behind a virtualised device. On one H200 VM the
    LEAF CNN fell from 109 to 72 client updates/s (about 4.8 ms more per update) once every update read the
    counter; that cost was inferred from the two checks, not timed on its own."""

    def __init__(self, replica: DeviceReplica | None, rank: int):
        self.meter = CostMeter()
        self.on_gpu = replica is not None and replica.on_gpu
        self.energy = GpuEnergy(replica.flat.buffer.device) if replica is not None and replica.on_gpu else None
        self.joules = self.energy.joules() if self.energy is not None else None
        self.left = 0  # this round's headers still to send: the last one reads the energy counter
        if self.energy is not None and self.joules is None:
            log(f"GPU energy is not recorded: {self.energy.why}", rank=rank)

    def begin_round(self, headers: int) -> None:
        """The round's headers this rank will send (its last one reads the energy counter)."""
        self.left = headers

    def of_update(self, seconds: float) -> dict[str, float]:
        """The rank's spend since its last header; ``seconds``, the update's own time, counts as GPU-seconds on a
        GPU."""
        cost = {f"rank_{key}": value for key, value in self.meter.since_last().items()}
        if self.on_gpu:
            cost["rank_gpu_seconds"] = seconds
        self.left -= 1
        if self.energy is not None and self.joules is not None and self.left <= 0:
            joules = self.energy.joules()
            assert joules is not None  # a counter that answered once keeps answering
            cost["rank_gpu_energy_joules"], self.joules = joules - self.joules, joules
        return cost
