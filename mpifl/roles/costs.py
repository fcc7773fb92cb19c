"""What a client rank spent, reported with its updates' headers: CPU-seconds and bytes written since its last
reading (receiving the model and the previous update's send included), its peak RSS and, on a GPU, the training's
seconds and the energy NVML's counter saw (roles.records sums them per rank and round)."""
from __future__ import annotations

from collections.abc import Callable

from mpifl.learning.device import DeviceReplica, GpuEnergy
from mpifl.logs import log
from mpifl.metrics import CostMeter, peak_rss_bytes


def with_members(cost: dict[str, float], members: dict[str, float]) -> dict[str, float]:
    """A leader's reading (``rank_*`` keys) with its group members' (``members``: ``summed_costs``) added: CPU and
    bytes written summed (bytes only where both counted them), the larger peak RSS."""
    if not members:
        return cost
    out = {**cost, "rank_cpu_seconds": cost["rank_cpu_seconds"] + members["cpu_seconds"],
           "rank_peak_rss_bytes": max(cost["rank_peak_rss_bytes"], members["peak_rss_bytes"])}
    if "rank_bytes_written" in cost and "bytes_written" in members:
        out["rank_bytes_written"] = cost["rank_bytes_written"] + members["bytes_written"]
    else:
        out.pop("rank_bytes_written", None)
    return out


class UpdateCosts:
    """The cost fields of one rank's update headers.

    Why the energy once a round: the records keep only each rank's sum over the round, which is the same, and
    an NVML query can cost milliseconds where the driver sits behind a virtualised device. On one H200 VM the
    LEAF CNN fell from 109 to 72 client updates/s (about 4.8 ms more per update) once every update read the
    counter; that cost was inferred from the two checks, not timed on its own."""

    def __init__(self, replica: DeviceReplica | None, rank: int,
                 members: Callable[[], dict[str, float]] | None = None):
        self.meter = CostMeter()
        self.members = members  # a replicated client group's other ranks' spending (GroupLeader.members_spent)
        gpu = replica.flat.buffer.device if replica is not None and replica.on_gpu else None
        self.on_gpu = gpu is not None
        self.energy = GpuEnergy(gpu) if gpu is not None else None
        self.joules = self.energy.joules() if self.energy is not None else None
        self.left = 0  # this round's headers still to send: the last one reads the counters
        self.holding = False  # an asynchronous step: headers are read as they are sent, not as they train
        if self.energy is not None and self.joules is None:
            log(f"GPU energy is not recorded: {self.energy.why}", rank=rank)

    def begin_round(self, headers: int) -> None:
        """The round's headers this rank will send (its last one reads the counters)."""
        self.left, self.holding = headers, False

    def begin_step(self, sends: int) -> None:
        """Asynchronous FL: the step's held updates this rank will send. Its training reads nothing; the last header
        sent (``at_send``) reads the counters, after the step's training, so that the step's record counts what the
        rank spent up to then, whichever step trained the update that carries it."""
        self.left, self.holding = sends, True

    def of_update(self, seconds: float) -> dict[str, float]:
        """The cost fields of the header of an update that took ``seconds``: its GPU-seconds on a GPU and, with the
        round's last header, the rank's CPU-seconds and bytes written since its last reading, its peak RSS and the
        GPU's energy. Why only the last: the records keep each rank's sum of the costs and the largest peak, which
        that one reading gives exactly (the sums telescope and the peak is a high-water mark), so the other headers
        need no /proc reads (no change in round time was measurable on a CPU: CHANGELOG, 2026-11-30)."""
        cost = {"rank_gpu_seconds": seconds} if self.on_gpu else {}
        if self.holding:
            return cost
        self.left -= 1
        if self.left > 0:
            return cost
        return {**cost, **self.reading()}

    def at_send(self) -> dict[str, float]:
        """Asynchronous FL: the reading for a held update's header as it is sent, with the step's last one only."""
        self.left -= 1
        return self.reading() if self.holding and self.left == 0 else {}

    def reading(self) -> dict[str, float]:
        """The rank's CPU-seconds and bytes written since its last reading, its peak RSS and the GPU's energy."""
        cost = {f"rank_{key}": value for key, value in self.meter.since_last().items()}
        cost["rank_peak_rss_bytes"] = peak_rss_bytes()
        if self.members is not None:  # the group's ranks count as one: their sums, their largest peak
            cost = with_members(cost, self.members())
        if self.energy is not None and self.joules is not None:
            joules = self.energy.joules()
            assert joules is not None  # a counter that answered once keeps answering
            cost["rank_gpu_energy_joules"], self.joules = joules - self.joules, joules
        return cost
