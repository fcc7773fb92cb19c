"""Error feedback's half of a checkpoint: every client rank publishes its clients' residuals, rank 0 waits.

The checkpointer is given ``ResidualPublisher.publish`` when it is built (its ``persist``):
before it publishes round r's model, it calls it, which messages every client rank
(``PersistOrder``) and waits for each rank's list of files. Only then is the
model published, naming those files, so a checkpoint never points at residuals that are not
on disk (storage.checkpointer's two-phase save).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from mpi4py import MPI

from mpifl.storage.checkpointer import StateWithheld
from mpifl.wire import protocol
from mpifl.wire.late import DroppedClients
from mpifl.wire.transport import Backoff, wait_all
from mpifl.wire.watchdog import FIRST_UPDATE, RankStalled, RunDeadlines, Watchdog


class ResidualPublisher:
    """Asks every client rank to publish its error-feedback residuals of a round, and collects the files."""

    def __init__(self, comm: MPI.Comm, deadlines: RunDeadlines, dropped: DroppedClients | None = None):
        """``dropped``: the server's note of clients dropped past their deadline, which each rank's persist header
        names (as a round's header would), so a rank puts their state back before publishing it."""
        self.comm, self.deadlines, self.dropped = comm, deadlines, dropped or DroppedClients()
        self.heard: Callable[[], Iterable[int]] | None = None

    def listen(self, heard: Callable[[], Iterable[int]]) -> None:
        """Take up, while waiting, what the client ranks send besides their files (the server's ``heard``): a rank
        dropped from a round may still be sending that round's update, and reads the persist order only once the
        server has taken it (above MPI's eager limit its send waits for the receive); its progress reports and
        late chunks count as progress."""
        self.heard = heard

    def publish(self, round_: int, folder: Path) -> list[str]:
        """Have every client rank publish its residuals of ``round_`` in ``folder``; the files, once all are
        acknowledged. Ranks silent past the training deadline (timeouts.first_update) end the job, named
        (``StateWithheld``, with the files the other ranks published: the checkpointer decides what is kept)."""
        ranks = list(range(1, self.comm.Get_size()))
        wait_all([self.comm.isend(protocol.PersistOrder(round_, self.dropped.take(r), str(folder)),
                                  dest=r, tag=protocol.HEADER) for r in ranks])
        # a SIGTERM save must finish: no stop_requested here
        watchdog = Watchdog(self.deadlines.current(), round_, {r: [] for r in ranks})
        files: list[str] = []
        silent: list[RankStalled] = []
        for rank in ranks:
            try:
                self._await(rank, round_, watchdog)
            except RankStalled as stalled:  # the others' files are still taken: they are published by now
                silent.append(stalled)
                continue
            files.extend(self._files_of(rank))
        if silent:
            raise StateWithheld(str(silent[0]), files, [stalled.rank for stalled in silent])
        return files

    def _await(self, rank: int, round_: int, watchdog: Watchdog) -> None:
        """Wait for ``rank``'s files, taking up meanwhile what the ranks send besides (``listen``); a rank silent
        past timeouts.first_update raises RankStalled."""
        owed: dict[int, tuple[str, str | None]] = {
            rank: (FIRST_UPDATE, f"its per-client state for the checkpoint of round {round_}")}
        backoff = Backoff()
        while not self.comm.Iprobe(source=rank, tag=protocol.RESIDUALS):
            heard = list(self.heard()) if self.heard is not None else []
            for sender in heard:
                watchdog.progress(sender)
            watchdog.check(lambda: owed)
            if heard:
                backoff.reset()
            else:
                backoff.pause()

    def _files_of(self, rank: int) -> list[str]:
        """``rank``'s answer: the names of the files it published (a sharded group's: one per rank of it)."""
        names = self.comm.recv(source=rank, tag=protocol.RESIDUALS)
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RuntimeError(f"rank {rank} sent {names!r} where its residual files' names belong")
        return names
