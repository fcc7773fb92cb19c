"""Under mpiexec, clients.placement: per_round: each round's participants (or their groups) go to the ranks by
estimated cost, and the overhead in that cost is fitted to the ranks' measured training times. Where a client
trains never changes a result: the model is bitwise the single-process reference's, and every round's
participants are trained exactly once. With clients.group_by: cost the groups themselves are formed anew
each round, from the participants' work alone, so the model is the reference's on any number of ranks."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import one_thread, reference_run
from results import assert_bitwise, final_model

from mpifl.config import load_config

CONFIG = """
seed: 5
rounds: 4
clients: {num_clients: 12, per_round: 7, placement: per_round}
data: {dataset: digits, partition: unbalanced, size_sigma: 1.5}
model: {name: mlp, kwargs: {hidden: [9]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
eval: {every: 0}
output: {progress: false}
"""


def reference(*overrides: str):
    with one_thread():
        return reference_run(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)))


@pytest.mark.parametrize("ranks,overrides", [
    (4, ()),  # 3 client ranks, every update travels and is folded in participant order
    (3, ("clients.groups=3", "transport.chunk_mb=0.00001")),  # whole groups move; their sums fold in group order
    # clients.group_by cost: each round's groups formed by work; the same model on 2 and 3 client ranks
    (3, ("clients.groups=3", "clients.group_by=cost", "transport.chunk_mb=0.00001")),
    (4, ("clients.groups=3", "clients.group_by=cost", "transport.chunk_mb=0.00001")),
], ids=["every-update-travels", "reduction-groups", "cost-groups-2-client-ranks", "cost-groups-3-client-ranks"])
def test_clients_placed_anew_every_round_give_the_reference_model_bitwise(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise(final_model(tmp_path / "run"), reference(*overrides))
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert sum(work["clients"] for work in record["ranks"].values()) == len(record["participants"]) == 7
        assert set(record["ranks"]) <= {str(r) for r in range(1, ranks)}


def test_a_dataset_read_per_rank_cannot_move_its_clients_and_is_refused_before_mpi_naming_the_key(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import numpy as np
    import pyarrow.parquet as pq

    rows = np.random.default_rng(0).random((60, 4)).astype("float32")
    table = {"client_id": np.repeat(np.arange(6), 10), "label": np.arange(60) % 3,
             **{f"f{i}": rows[:, i] for i in range(4)}}
    pq.write_table(pa.table(table), tmp_path / "train.parquet")
    cfg = write_config(tmp_path / "c.yaml", f"""
clients: {{num_clients: 6, per_round: 4, placement: per_round}}
data: {{dataset: table, kwargs: {{path: {tmp_path / 'train.parquet'}, test_path: {tmp_path / 'train.parquet'}}},
       partition: natural}}
model: {{name: mlp, kwargs: {{hidden: [4]}}}}
rounds: 1
eval: {{every: 0}}
""")
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert ("clients.placement: 'per_round' lets any rank train any client, but data.dataset 'table' split "
            "naturally is read per rank") in result.stderr
    assert not (tmp_path / "run").exists()  # refused before MPI work: nothing written
