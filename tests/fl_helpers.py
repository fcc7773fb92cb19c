"""User code for the tests, loaded by import path (``fl_helpers:...``) on every rank."""
from __future__ import annotations

import math

import torch
from torch import nn

from mpifl.config import TrainConfig
from mpifl.learning.trainers import TrainResult


class NoiseTrainer:
    """Deterministic stand-in for training: adds seeded noise to every exchanged tensor."""

    modifies_weights = True

    def __init__(self, cfg: TrainConfig):
        self.scale = cfg.lr

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        _test_hooks()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.add_((torch.randn(t.shape, generator=g) * self.scale).to(t.dtype))
        return TrainResult(len(data) if data is not None else 1, {"loss": float(seed % 97)})


def _test_hooks() -> None:
    """Slow training down (FL_HELPERS_SLEEP seconds) and record this rank's pid (FL_HELPERS_PID_DIR)."""
    import os
    import time

    from mpi4py import MPI

    if os.environ.get("FL_HELPERS_PID_DIR"):
        path = os.path.join(os.environ["FL_HELPERS_PID_DIR"], f"rank{MPI.COMM_WORLD.Get_rank()}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # a reader never sees an empty file
    time.sleep(float(os.environ.get("FL_HELPERS_SLEEP", "0")))


class FailingOnRank2:
    """Trains nothing, except on MPI rank 2, where it raises."""

    modifies_weights = False

    def __init__(self, cfg: TrainConfig):
        pass

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 2:
            raise RuntimeError("deliberate failure inside a client's training step")
        return TrainResult(len(data), {})


def tiny_mlp(width: int = 7) -> nn.Module:
    """A model with odd-sized tensors and a BatchNorm (floating and integer buffers)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, 10))


def bn_mlp(input_shape, num_classes: int, width: int = 8) -> nn.Module:
    """An MLP sized from the data with a BatchNorm (running mean and variance: statistics)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, num_classes))


def wider_mlp() -> nn.Module:
    """Differs from tiny_mlp in its second layer's width."""
    return tiny_mlp(width=9)


def rank_dependent_mlp() -> nn.Module:
    """tiny_mlp everywhere except on MPI rank 2 (to test the spec check)."""
    from mpi4py import MPI

    return wider_mlp() if MPI.COMM_WORLD.Get_rank() == 2 else tiny_mlp()


class FailsOnOneRank(nn.Module):
    """A small MLP whose training forward raises on MPI rank FL_HELPERS_FAIL_RANK, from its
    FL_HELPERS_FAIL_AFTER-th training batch on (default 0: the first): a failure inside a client group."""

    def __init__(self, input_shape, num_classes: int) -> None:
        import os

        from mpi4py import MPI

        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.ReLU(),
                                 nn.Linear(8, num_classes))
        self.failing = MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FL_HELPERS_FAIL_RANK", "-1"))
        self.batches_left = int(os.environ.get("FL_HELPERS_FAIL_AFTER", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.failing:
            if self.batches_left == 0:
                raise RuntimeError("deliberate failure inside a client group")
            self.batches_left -= 1
        return self.net(x)


class FailingClients(NoiseTrainer):
    """NoiseTrainer, except for chosen logical clients (from a chosen round on), which raise or
    return NaN. Set by the environment: FL_HELPERS_RAISE and FL_HELPERS_NAN (comma-separated
    client ids), FL_HELPERS_FROM_ROUND (default 1), FL_HELPERS_SEED (the config's root seed)."""

    def __init__(self, cfg: TrainConfig):
        import os

        from mpifl.planning.seeds import client_seed

        super().__init__(cfg)
        seed, first = int(os.environ.get("FL_HELPERS_SEED", "0")), int(os.environ.get("FL_HELPERS_FROM_ROUND", "1"))

        def seeds(var: str) -> dict[int, int]:
            ids = [int(c) for c in os.environ.get(var, "").split(",") if c]
            return {client_seed(seed, r, c): c for c in ids for r in range(first, 200)}

        self.raising, self.poisoned = seeds("FL_HELPERS_RAISE"), seeds("FL_HELPERS_NAN")

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        if seed in self.raising:
            raise RuntimeError(f"deliberate failure of logical client {self.raising[seed]}")
        result = super().train(model, data, seed)
        if seed in self.poisoned:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        return result


def frozen_digest(model: nn.Module) -> str:
    """A hash of every frozen parameter's bytes, in name order."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class FrozenWatchTrainer:
    """The causal-LM trainer, recording the frozen tensors' digest before and after each client's
    training in ``digests/rank<r>.txt`` under the job's working directory (so that the job, having no
    environment of its own, can run in the suite's job pool)."""

    modifies_weights = True

    def __init__(self, cfg: TrainConfig):
        from mpifl.learning.trainers import CausalLMTrainer

        self.inner = CausalLMTrainer(cfg)

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        import os

        from mpi4py import MPI

        before = frozen_digest(model)
        result = self.inner.train(model, data, seed)
        path = os.path.join(os.getcwd(), "digests", f"rank{MPI.COMM_WORLD.Get_rank()}.txt")
        with open(path, "a") as f:
            f.write(f"{before} {frozen_digest(model)}\n")
        return result


class Straggling(NoiseTrainer):
    """NoiseTrainer that takes FL_HELPERS_CLIENT_SECONDS per logical client, and FL_HELPERS_SLOW_FACTOR (10) times as
    long on rank FL_HELPERS_SLOW_RANK for its FL_HELPERS_SLOW_CALLS-th trainings (comma-separated, from 1). It runs a
    forward pass every 0.1 s meanwhile, so the rank keeps reporting progress: slow, not silent. Trainings are
    counted per trainer, which a run builds once per rank, so a job in the suite's pool counts its own."""

    calls = 0

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        import os
        import time

        from mpi4py import MPI

        self.calls += 1
        slow = MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FL_HELPERS_SLOW_RANK", "-1")) and \
            str(self.calls) in os.environ.get("FL_HELPERS_SLOW_CALLS", "").split(",")
        factor = float(os.environ.get("FL_HELPERS_SLOW_FACTOR", "10")) if slow else 1.0
        until = time.monotonic() + float(os.environ.get("FL_HELPERS_CLIENT_SECONDS", "0")) * factor
        training = model.training
        model.eval()  # the forward passes report progress and change nothing (BatchNorm's statistics included)
        with torch.no_grad():
            while time.monotonic() < until:
                model(torch.zeros(2, 64))
                time.sleep(0.1)
        model.train(training)
        return super().train(model, data, seed)


class SlowOnOneRank(nn.Sequential):
    """``bn_mlp`` without its BatchNorm, which trains slowly on one rank for chosen clients, under the built-in torch
    trainer (which SCAFFOLD and FedDyn require, so a slow trainer plug-in cannot be used): on rank
    FL_HELPERS_SLOW_RANK, the FL_HELPERS_SLOW_CALLS-th times it is put in training mode (once per logical client's
    training; comma-separated, counted from 1), each forward pass first sleeps FL_HELPERS_SLOW_FORWARD seconds.
    Each pass still reports progress, so the rank is slow, not silent."""

    def __init__(self, input_shape, num_classes: int, width: int = 9):
        super().__init__(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))
        self.trainings, self.slow = 0, False

    def train(self, mode: bool = True):
        import os

        from mpi4py import MPI

        if mode:
            self.trainings += 1
            self.slow = MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FL_HELPERS_SLOW_RANK", "-1")) and \
                str(self.trainings) in os.environ.get("FL_HELPERS_SLOW_CALLS", "").split(",")
        return super().train(mode)

    def forward(self, x):
        if self.slow and self.training:
            import os
            import time

            time.sleep(float(os.environ.get("FL_HELPERS_SLOW_FORWARD", "0")))
        return super().forward(x)


class SteppingNoiseTrainer(NoiseTrainer):
    """NoiseTrainer that reports local steps as the built-in trainer counts them (local_epochs x minibatches of
    batch_size), so clients with more data take more steps: what FedNova normalises by."""

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.cfg = cfg

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        import math

        result = super().train(model, data, seed)
        samples = len(data) if data is not None else 1
        result.local_steps = self.cfg.local_epochs * math.ceil(samples / self.cfg.batch_size)
        return result


class ExplodingBeforeNorm(nn.Sequential):
    """``bn_mlp`` whose inputs blow up, for chosen clients, before its BatchNorm: on rank FL_HELPERS_EXPLODE_RANK, the
    FL_HELPERS_EXPLODE_CALLS-th times it is put in training mode (once per logical client's training, as
    ``SlowOnOneRank`` counts them), each forward pass scales its inputs by 1e30. The BatchNorm's running variance
    overflows to Inf while the normalised activations, and so the gradients and the parameters, stay finite: a
    training that diverged in its statistics only."""

    def __init__(self, input_shape, num_classes: int, width: int = 8):
        super().__init__(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, num_classes))
        self.trainings, self.exploding = 0, False

    def train(self, mode: bool = True):
        import os

        from mpi4py import MPI

        if mode:
            self.trainings += 1
            self.exploding = MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FL_HELPERS_EXPLODE_RANK", "-1")) and \
                str(self.trainings) in os.environ.get("FL_HELPERS_EXPLODE_CALLS", "").split(",")
        return super().train(mode)

    def forward(self, x):
        return super().forward(x * 1e30 if self.exploding and self.training else x)
