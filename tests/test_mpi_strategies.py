"""Under mpiexec: every strategy, streamed chunk by chunk, equals its whole-model numpy reference."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import reference_run
from results import assert_bitwise

from mpifl.config import load_config
from mpifl.storage.hdf5 import Checkpoint, load_tensors

CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.02}
eval: {every: 0}
output: {progress: false}
"""


def run(tmp_path, name: str, ranks: int, *overrides: str, extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Run the config with overrides; the final model's tensors as fp32 arrays."""
    cfg_path = write_config(tmp_path / "config.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(tmp_path / name), *overrides, *extra,
                     timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return {n: t.float().numpy() for n, t in load_tensors(tmp_path / name / "model.h5").items()}


def expected(*overrides: str) -> dict[str, np.ndarray]:
    return reference_run(load_config(None, overrides, data=yaml.safe_load(CONFIG)))




def assert_close(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("ranks,overrides", [
    # 5 client ranks for 6 participants: one rank's two participants arrive one after the other
    (6, ("strategy.name=median", "transport.chunk_mb=0.00095")),
    # bf16 model, one participant per rank, 5-element chunks, k = floor(0.2 * 6) = 1 trimmed each end
    (7, ("strategy.name=trimmed_mean", "strategy.trim_fraction=0.2", "model.dtype=bfloat16",
         "transport.chunk_mb=0.0000095")),
    # an even count of participants, one per rank, deltas: the median of the receive slots themselves
    # (no stacking copy), the mean of the middle two, as the pseudo-gradient
    (5, ("strategy.name=median", "clients.num_clients=4", "clients.per_round=4", "strategy.update=delta")),
    # deltas cast to bf16 on the wire, accumulated in fp32
    (4, ("strategy.update=delta", "strategy.wire_dtype=bfloat16", "transport.chunk_mb=0.00006")),
])
def test_fedavg_median_and_trimmed_mean_match_the_reference_bitwise(tmp_path, ranks, overrides):
    assert_bitwise(run(tmp_path, "run", ranks, *overrides), expected(*overrides))


@pytest.mark.parametrize("ranks,overrides", [
    (4, ("strategy.name=fedavgm", "strategy.server_lr=0.7", "transport.chunk_mb=0.00095")),
    (3, ("strategy.name=fedadam", "strategy.update=delta", "strategy.server_lr=0.05")),
    (5, ("strategy.name=fedyogi", "strategy.wire_dtype=bfloat16", "transport.chunk_mb=0.00006")),
    (4, ("strategy.name=fedadagrad", "strategy.update=delta", "model.dtype=bfloat16", "strategy.server_lr=0.03")),
])
def test_server_optimizers_match_the_reference(tmp_path, ranks, overrides):
    got, want = run(tmp_path, "run", ranks, *overrides), expected(*overrides)
    bf16 = "model.dtype=bfloat16" in overrides
    assert_close(got, want, rtol=2**-7 if bf16 else 1e-5)  # bf16: one rounding step may flip
    start = expected(*overrides, "rounds=1")
    assert any(not np.allclose(got[n], start[n]) for n in got), "the server optimizer made no progress"


def test_a_bf16_wire_halves_the_update_bytes(tmp_path):
    run(tmp_path, "fp32", 3, "rounds=1")
    run(tmp_path, "bf16", 3, "rounds=1", "strategy.wire_dtype=bfloat16")
    sent = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["bytes_received"]
            for name in ("fp32", "bf16")}
    assert sent["bf16"] * 2 == pytest.approx(sent["fp32"], rel=0.02)


def test_adaptive_state_lives_in_checkpoints_and_on_disk_equals_in_memory(tmp_path):
    common = ("strategy.name=fedadam", "strategy.server_lr=0.05", "rounds=4")
    memory = run(tmp_path, "memory", 3, *common)  # 2 client ranks; the out-of-core server needs one per participant
    disk = run(tmp_path, "disk", 7, *common, "server.state=disk")
    assert_bitwise(disk, memory)
    with Checkpoint(tmp_path / "memory" / "model.h5") as ckpt:
        assert set(ckpt.file["server_state"]) == {"m", "v"}
        v = np.asarray(ckpt.file["server_state"]["v"])
        assert v.dtype == np.float32 and v.size == sum(t.size for t in memory.values())
        assert (v > 1e-6 + 1e-12).any()  # grew from tau^2 = 1e-6
    # Stop after round 2, then resume to round 4: the moments must come back from the checkpoint.
    run(tmp_path, "resumed", 4, *common[:-1], "rounds=2")
    resumed = run(tmp_path, "resumed", 3, *common, extra=("--resume",))
    assert_bitwise(resumed, memory)


def test_rank_count_does_not_change_a_trained_model(tmp_path):
    """Real local training (torch, one thread per rank), 8 logical clients on 2 or 5 client ranks.

    (SGD, not Adam, for the comparison with the in-process reference: Adam's first step is
    ~lr*sign(g), which turns last-bit noise in the near-zero gradient of a bias feeding a
    BatchNorm into lr-sized differences.)
    """
    common = ("train.trainer=torch", "train.optimizer=sgd", "train.momentum=0.9", "train.lr=0.05",
              "train.local_steps=3", "strategy.name=fedavgm", "clients.per_round=8", "rounds=2")
    models = [run(tmp_path, f"ranks{r}", r + 1, *common) for r in (2, 5)]
    assert_bitwise(models[1], models[0])
    torch_model = expected(*common)
    assert_close(models[0], torch_model, rtol=1e-4)
