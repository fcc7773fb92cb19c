"""A finished run's results read back in tests: its final tensors, each client's kept vectors, and the bitwise
comparison every reference test makes."""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from mpifl.storage.hdf5 import load_tensors


def final_model(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's final exchanged tensors (``model.h5``), as fp32 arrays."""
    return {n: t.float().numpy() for n, t in load_tensors(run_dir / "model.h5").items()}


def client_vectors(run_dir: Path) -> dict[int, np.ndarray]:
    """Every client's per-client vector (local tensors, personal model, ...) in the last checkpoint's per-rank
    files, by client id."""
    vectors = {}
    for path in sorted((run_dir / "checkpoints").glob("ckpt-r*.residuals"))[-1].glob("rank*.h5"):
        with h5py.File(path, "r") as f:
            vectors.update({int(c): f["clients"][c][()] for c in f["clients"]})
    return vectors


def sharded_client_vectors(run_dir: Path, shapes: list[tuple[int, ...]]) -> dict[int, np.ndarray]:
    """Every client's per-client vector from the last checkpoint of a sharded run (``clients.sharding: fsdp``), made
    whole: each rank's file holds its rows (torch.chunk's split) of each tensor of ``shapes``, in order; the whole
    vector is the tensors one after another, as an unsharded rank keeps it."""
    pieces: dict[int, dict[int, np.ndarray]] = {}  # client -> shard index -> its rows, back to back
    parts = 1
    for path in sorted((run_dir / "checkpoints").glob("ckpt-r*.residuals"))[-1].glob("rank*.h5"):
        with h5py.File(path, "r") as f:
            shard, parts = int(f.attrs["shard"]), int(f.attrs["shards"])
            for c in f["clients"]:
                pieces.setdefault(int(c), {})[shard] = f["clients"][c][()]
    whole = {}
    for client, by_shard in pieces.items():
        starts, out = dict.fromkeys(range(parts), 0), []
        for shape in shapes:
            rows, per_row = shape[0], int(np.prod(shape[1:]))
            per = -(-rows // parts)
            for shard in range(parts):
                mine = max(0, min(rows, (shard + 1) * per) - min(rows, shard * per)) * per_row
                out.append(by_shard[shard][starts[shard]:starts[shard] + mine])
                starts[shard] += mine
        whole[client] = np.concatenate(out)
    return whole


def run_result(run_dir: Path) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """The final shared tensors, and every client's vector from the last checkpoint."""
    return final_model(run_dir), client_vectors(run_dir)


def numbered_controls(tensors: dict[str, np.ndarray], controls: list[str]) -> dict[str, np.ndarray]:
    """``tensors`` with SCAFFOLD's control-section tensors ``controls`` renamed ``control.<k>``, k in that order:
    a run and a reference name them differently, and only their order is the same."""
    out = {n: t for n, t in tensors.items() if n not in controls}
    out.update({f"control.{k}": tensors[n] for k, n in enumerate(controls)})
    return out


def run_controls_numbered(run_dir: Path, with_clients: bool = False) -> dict[str, np.ndarray]:
    """The run's final tensors, its control section (``scaffold_control.*``, in name order) as ``control.<k>``;
    ``with_clients``: every client's kept vector too, as ``client.<id>``."""
    from mpifl.wire.spec import CONTROL

    tensors = final_model(run_dir)
    out = numbered_controls(tensors, sorted(n for n in tensors if n.startswith(CONTROL + ".")))
    if with_clients:
        out.update({f"client.{c}": v for c, v in client_vectors(run_dir).items()})
    return out


def reference_controls_numbered(want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A reference's tensors (tests/reference.py), its ``control.<parameter>`` entries, in the order it lists
    them (the parameters'), as ``control.<k>``."""
    return numbered_controls(want, [n for n in want if n.startswith("control.")])


def relative_l2(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over every array of two runs' tensors (the same keys), in fp64."""
    assert got.keys() == want.keys()
    num = sum(float(((got[k].astype(np.float64) - want[k]) ** 2).sum()) for k in want)
    return (num / sum(float((want[k].astype(np.float64) ** 2).sum()) for k in want)) ** 0.5


def assert_bitwise(got: dict, want: dict) -> None:
    """The same keys, and every array equal to the bit."""
    assert got.keys() == want.keys()
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{key}: max |diff| {np.abs(got[key] - want[key]).max()}"


# What a round's record measures of the machine (wall times, memory, the exchange against the floor): the only
# keys in which two identical runs' metrics.jsonl may differ.
MEASURED = ("time", "exchange", "client_train_seconds", "client_peak_rss_bytes", "client_peak_device_bytes",
            "server_rss_bytes", "server_peak_rss_bytes", "cost", "cost_to_date", "timing", "client_group")
RANK_MEASURED = ("train_seconds", "cpu_seconds", "bytes_written", "gpu_seconds", "gpu_energy_joules")


def recorded(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl less what it measured of the machine (``MEASURED``, and each rank's times and costs:
    ``RANK_MEASURED``): what two identical runs must write alike."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if k not in MEASURED}
        record["ranks"] = {rank: {k: v for k, v in work.items() if k not in RANK_MEASURED}
                           for rank, work in record.get("ranks", {}).items()}
        out.append(record)
    return out


# What the same run writes differently on another number of client ranks (docs/reference/run-directory.md): what
# the ranks did rather than what they computed. Whole keys, and the rank named inside each entry of a list.
RANK_COUNT = ("bytes_sent", "bytes_received", "ranks", "server_pool_bytes", "state_loans")
RANK_COUNT_IN_ENTRIES = {"dropped": ("rank",), "faults": ("rank", "rank_clients_dropped")}


def recorded_on_any_rank_count(run_dir: Path) -> list[dict]:
    """``recorded`` less what depends on the number of client ranks (``RANK_COUNT``, and the rank of each
    ``dropped`` and ``faults`` entry: ``RANK_COUNT_IN_ENTRIES``): what the same run must write alike on 2 or 4
    client ranks."""
    out = []
    for record in recorded(run_dir):
        record = {k: v for k, v in record.items() if k not in RANK_COUNT}
        for key, inner in RANK_COUNT_IN_ENTRIES.items():
            if key in record:
                record[key] = [{k: v for k, v in entry.items() if k not in inner} for entry in record[key]]
        out.append(record)
    return out
