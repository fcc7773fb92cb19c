"""A client rank's logical clients trained K at a time (``train.batched_clients``), handed out one at a time.

The rank serves its clients as it always does, one after another: reset the model to the global one, train,
encode, send (or fold into its reduction group's sum). Only the training is batched. When the rank reaches a
client not trained yet, it trains that client and the next K - 1 untrained ones of its round together
(mpifl.learning.batched) from the global model, and keeps their trained weights; each client's turn then loads
its own into the model instead of training. So the exchange, the group sums, checkpoints, privacy, compression
and the per-client rules that run after training see exactly what they see for a client trained on its own.

Which clients share a batch depends on the rank's order, and so on the number of ranks; a client's result does
not, because a lane's arithmetic never reads another lane's values and every batch is padded to K lanes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from mpifl.config import TrainConfig
from mpifl.learning.batched import Lane, LaneWeights, train_lanes
from mpifl.learning.datasets import ClientData
from mpifl.learning.trainers import TrainResult, make_loss
from mpifl.planning.seeds import client_seed


class BatchedClients:
    """The trained weights of the clients of this round's current batch, until each one's turn."""

    def __init__(self, cfg: TrainConfig, seed: int,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]],
                 correction: Callable[[int], torch.Tensor] | None = None):
        self.cfg, self.width, self.seed, self.local_data = cfg, cfg.batched_clients, seed, local_data
        self.correction = correction  # SCAFFOLD: a client's c - c_i (LaneCorrections)
        self.loss = make_loss(cfg.loss)
        self.round = 0
        self.order: list[int] = []
        self.trained: dict[int, tuple[LaneWeights, TrainResult]] = {}
        self.served: set[int] = set()
        self.params: tuple[nn.Module, dict[str, torch.Tensor]] | None = None

    def begin_round(self, round_: int, order: Sequence[int]) -> None:
        """A new round whose clients the rank serves in ``order``."""
        self.round, self.order = round_, list(order)
        self.trained.clear()
        self.served.clear()

    def train(self, model: nn.Module, client: int) -> TrainResult:
        """Put ``client``'s trained weights into ``model`` (which holds the global model), training its batch
        first if it has not trained yet; its ``TrainResult`` as the one-at-a-time trainer reports it."""
        if client not in self.trained:
            self._train_batch(model, client)
        weights, result = self.trained.pop(client)
        self.served.add(client)
        if self.params is None or self.params[0] is not model:  # the rank's one model: its names looked up once
            self.params = model, dict(model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                self.params[1][name].copy_(value)
        return result

    def _train_batch(self, model: nn.Module, first: int) -> None:
        """Train ``first`` and the next untrained clients of the round's order, up to the batch's width."""
        if not self._has_data(first):
            raise ValueError(f"logical client {first} has no local data; the batched trainer needs some")
        later = self.order[self.order.index(first) + 1:] if first in self.order else []
        mates = [c for c in later if c not in self.served and c not in self.trained and self._has_data(c)]
        batch = [first] + mates[:self.width - 1]  # a mate without data fails on its own turn, as it would alone
        lanes = []
        for client in batch:
            data = self.local_data[client][0]
            assert data is not None  # _has_data
            k = self.correction(client) if self.correction is not None else None
            lanes.append(Lane(data, client_seed(self.seed, self.round, client), k))
        for client, trained in zip(batch, train_lanes(model, lanes, self.cfg, self.width, self.loss)):
            self.trained[client] = trained

    def _has_data(self, client: int) -> bool:
        data = self.local_data.get(client, (None, None))[0]
        return data is not None and len(data) > 0
