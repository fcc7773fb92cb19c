"""A batch of fewer token blocks (or samples) than a client group has ranks: the last batch of a pass over the data,
or every batch when train.batch_size < clients.ranks_per_client. A rank whose share of it is empty still joins the
group's collectives (FSDP's gathers and reduce-scatters, DDP's all-reduce): the causal-LM trainer runs it on a
stand-in block weighed 0, the plain trainer on its 0 rows. Its gradient is exact zeros, so the group's step is the
weighted mean over the real samples alone: with one block a batch, a group of two trains bitwise the model one rank
does, sharded (fsdp) or replicated, and the last short batch of a pass keeps a group within rounding of one rank.
Such a batch size is warned about, naming both keys."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_mpi, write_config
from results import assert_bitwise, final_model, relative_l2

from mpifl.config import config_warnings, load_config
from mpifl.learning.trainers import stand_in

GPT2 = """
seed: 5
rounds: 1
clients: {num_clients: 2, ranks_per_client: 2, sharding: fsdp}
data: {dataset: text, kwargs: {files: [CORPUS], vocab_size: 300, seq_len: 32, test_fraction: 0.05}}
model:
  name: transformers
  dtype: float32
  transformers:
    architecture: gpt2
    config: {n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 384, n_positions: 32,
             resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}
train: {trainer: causal_lm, optimizer: adamw, lr: 0.002, batch_size: 1, local_steps: 2}
eval: {every: 0}
output: {progress: false}
"""
TEXT = "".join(f"def f{i}(a, b):\n    \"\"\"Return {i} times the sum of a and b.\"\"\"\n    return {i} * (a + b)\n"
               for i in range(300))  # 156 and 157 blocks for the two clients
MLP = """
seed: 3
rounds: 1
clients: {num_clients: 6, per_round: 2, ranks_per_client: 2}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 1, local_steps: 3, device: cpu}
eval: {every: 0}
output: {progress: false}
"""
ONE_RANK = ("clients.ranks_per_client=1", "clients.sharding=replicate")
# batch_size 155 over 156 blocks: a second batch of 1 block leaves rank 1 of the group an empty share
LAST_SHORT = ("train.batch_size=155",)


def run(tmp_path: Path, name: str, text: str, ranks: int, *overrides: str) -> dict:
    """The final model of a run of ``text`` (a config with its corpus beside it) on ``ranks`` ranks."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = write_config(tmp_path / f"{name}.yaml", text.replace("CORPUS", str(corpus)))
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_model(tmp_path / name)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, dict]:
    """One rank per client, GPT-2 with one block a batch and with a last batch of one block, and the MLP."""
    tmp = tmp_path_factory.mktemp("one_rank")
    return {"one block": run(tmp, "one", GPT2, 2, *ONE_RANK),
            "last short": run(tmp, "last", GPT2, 2, *ONE_RANK, *LAST_SHORT),
            "mlp": run(tmp, "mlp", MLP, 2, *ONE_RANK)}


def test_an_empty_share_runs_on_the_batchs_first_sample_and_a_share_on_itself():
    batch = torch.tensor([7, 3, 5])
    assert stand_in(batch[3:], batch).tolist() == [7]
    assert stand_in(batch[1:], batch).tolist() == [3, 5]


@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_one_block_batches_train_a_group_of_two_bitwise_as_one_rank(tmp_path, one_rank, sharding):
    """Rank 1's share is empty at every step: its weight-0 stand-in adds exact zeros to the group's gradient."""
    assert_bitwise(run(tmp_path, "group", GPT2, 3, f"clients.sharding={sharding}"), one_rank["one block"])


def test_the_last_short_batch_of_a_pass_keeps_a_sharded_group_within_rounding_of_one_rank(tmp_path, one_rank):
    grouped = run(tmp_path, "group", GPT2, 3, *LAST_SHORT)
    assert relative_l2(grouped, one_rank["last short"]) < 1e-5


def test_the_plain_trainer_runs_an_empty_share_on_its_zero_rows_bitwise_as_one_rank(tmp_path, one_rank):
    """Not on a stand-in: a group BatchNorm would count the stand-in's sample in the batch's statistics."""
    assert_bitwise(run(tmp_path, "group", MLP, 3), one_rank["mlp"])


def test_a_batch_smaller_than_the_group_is_warned_about_naming_both_keys():
    def warned(**train) -> list[str]:
        cfg = load_config(None, data={"clients": {"ranks_per_client": 4}, "train": train})
        return [w for w in config_warnings(cfg) if w.startswith("train.batch_size")]

    warning, = warned(batch_size=3)
    assert "clients.ranks_per_client=4" in warning
    assert warned(batch_size=4) == []
