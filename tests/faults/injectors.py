"""User code that misbehaves on purpose, loaded by import path (``faults.injectors:Injected``) on every rank.

The environment picks the fault, so one config serves every test:

- ``FAULT``: ``hang``, ``exit0`` (``sys.exit(0)``), ``os_exit`` (``os._exit(3)``), ``c_exit0`` (C's
  ``_exit(0)``), ``interrupt`` (``KeyboardInterrupt``) or ``raise``; ``stalling_mlp`` also reads
  ``hang_build`` and ``hang_forward``;
- ``FAULT_RANK`` (default 2): the rank that misbehaves;
- ``FAULT_CALL`` (default 1): on its N-th logical client's training;
- ``FAULT_STAGE``: ``train`` (default: inside training, before the update header), ``send`` (after
  the first chunk of the update) or ``receive`` (the next global model is never taken up);
- ``FAULT_MARK``: a file to write the time of the fault to (``time.time()``), for deadline checks.
- ``FAULT_FLOOR`` (``stalling_mlp`` only): seconds, the floor of the derived deadline its hang meets.
"""
from __future__ import annotations

import os
import sys
import time

from fl_helpers import NoiseTrainer
from torch import nn

from mpifl.learning.trainers import TrainResult


def misbehave(fault: str) -> None:
    """Do the fault now."""
    if os.environ.get("FAULT_MARK"):
        with open(os.environ["FAULT_MARK"], "w") as f:
            f.write(repr(time.time()))
    if fault == "hang":
        while True:
            time.sleep(3600)
    if fault == "exit0":
        sys.exit(0)
    if fault == "os_exit":
        os._exit(3)
    if fault == "c_exit0":  # C's _exit(0): no Python cleanup, no atexit, nothing mpifl can intercept
        import ctypes

        ctypes.CDLL(None)._exit(0)
    if fault == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError("deliberate fault")


class Injected(NoiseTrainer):
    """NoiseTrainer that misbehaves as the environment says (see the module docstring)."""

    calls = 0

    def train(self, model: nn.Module, data, seed: int) -> TrainResult:
        from mpi4py import MPI

        fault = os.environ.get("FAULT")
        Injected.calls += 1
        if fault and MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FAULT_RANK", "2")) \
                and Injected.calls == int(os.environ.get("FAULT_CALL", "1")):
            stage = os.environ.get("FAULT_STAGE", "train")
            if stage == "train":
                misbehave(fault)
            _arm(stage, fault)
        return super().train(model, data, seed)


def _arm(stage: str, fault: str) -> None:
    """Make the client rank's next send (or receive) misbehave, after its first chunk (or before any)."""
    from mpifl.roles import client

    if stage == "send":
        real = client.send_chunks

        def first_chunk_then_fault(comm, dests, tag, chunks, inflight, *rest):
            real(comm, dests, tag, list(chunks)[:1], inflight, *rest)
            misbehave(fault)

        client.send_chunks = first_chunk_then_fault
    elif stage == "receive":
        client.relay_chunks = lambda *args, **kwargs: misbehave(fault)  # how a client rank receives the model


def file_size_limited_mlp() -> nn.Module:
    """fl_helpers.tiny_mlp; with FAULT_FSIZE=N, rank 0 (the server, MPI already started) may write files of at
    most N bytes: a full disk."""
    import resource

    from fl_helpers import tiny_mlp
    from mpi4py import MPI

    limit = int(os.environ.get("FAULT_FSIZE", "0"))
    if limit and MPI.COMM_WORLD.Get_rank() == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return tiny_mlp()


class _StallingForward(nn.Module):
    """Wraps a model; with FAULT=hang_forward, its forward pass on FAULT_RANK never returns (a stuck first step)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from mpi4py import MPI

        if os.environ.get("FAULT") == "hang_forward" and MPI.COMM_WORLD.Get_rank() == int(
                os.environ.get("FAULT_RANK", "2")):
            misbehave("hang")
        return self.inner(x)


def stalling_mlp(input_shape, num_classes: int) -> nn.Module:
    """A plug-in model for start-up and first-step hangs: FAULT=hang_build hangs its construction on FAULT_RANK,
    FAULT=hang_forward its first forward pass there (see ``misbehave``). With FAULT_FLOOR=S, the floor of the
    deadline the hang meets, derived from the other ranks (30 s in mpifl), is S s on every rank (each builds this
    model before that deadline is computed): a test sees a default job end without waiting the floor out."""
    import math

    from mpi4py import MPI

    if os.environ.get("FAULT_FLOOR"):
        _lower_the_floor(os.environ.get("FAULT", ""), float(os.environ["FAULT_FLOOR"]))
    if os.environ.get("FAULT") == "hang_build" and MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FAULT_RANK", "2")):
        misbehave("hang")
    inner = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes))
    return _StallingForward(inner)


def _lower_the_floor(fault: str, seconds: float) -> None:
    """Set the floor of the derived deadline that ``fault`` meets: the start-up stage's, or the first update's."""
    from mpifl.roles import launch
    from mpifl.wire import watchdog

    if fault == "hang_build":
        launch.STARTUP_FLOOR_SECONDS = seconds
    elif fault == "hang_forward":
        watchdog.STALL_FLOOR_SECONDS = seconds
