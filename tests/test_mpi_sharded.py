"""clients.sharding: fsdp: a logical client's model sharded over the R ranks of its group with FSDP, no rank holding
the whole model or the whole update. Its result is bitwise the replicated (DDP) group's of the same R, whatever the
number of groups, and after a kill -9 and a resume on another number of groups; within float rounding of one rank
per client; the frozen base of LoRA is initialised as an unsharded build initialises it, tied embeddings too; the
out-of-core server's round 0 is gathered from the shards; and what the sharded path does not carry yet is refused,
naming the key."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MPI_TIMEOUT, rounds_logged, run_mpi, spawn_mpi, wait_for, write_config
from results import assert_bitwise, final_model, relative_l2

from mpifl.config import ConfigError, load_config

LLAMA = """
seed: 5
rounds: 2
clients: {num_clients: 4, ranks_per_client: 2, sharding: fsdp}
data: {dataset: text, kwargs: {files: [CORPUS], vocab_size: 300, seq_len: 32, test_fraction: 0.05}}
model:
  name: transformers
  dtype: float32
  transformers:
    architecture: llama
    config: {num_hidden_layers: 2, hidden_size: 64, intermediate_size: 96, num_attention_heads: 4,
             num_key_value_heads: 2, vocab_size: 384, max_position_embeddings: 64, tie_word_embeddings: false}
train: {trainer: causal_lm, optimizer: adamw, lr: 0.002, batch_size: 6, local_steps: 2}
eval: {every: 0}
output: {progress: false}
"""
GPT2 = {"model.transformers.architecture": "gpt2",
        "model.transformers.config": "{n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 384, n_positions: 64}"}
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]",
        "model.exchange=trainable", "model.dtype=bfloat16")
TOLERANCE = 1e-3  # relative L2 of a sharded run's model to one rank per client's
TEXT = "".join(f"def f{i}(a, b):\n    \"\"\"Return {i} times the sum of a and b.\"\"\"\n    return {i} * (a + b)\n"
               for i in range(300))  # a small corpus: the tokenizer trains in a moment


def config(folder: Path) -> Path:
    """The test's config, with its corpus written beside it."""
    corpus = folder / "corpus.txt"
    corpus.write_text(TEXT)
    return write_config(folder / "c.yaml", LLAMA.replace("CORPUS", str(corpus)))


def run(tmp_path: Path, name: str, ranks: int, *overrides: str) -> Path:
    cfg = config(tmp_path)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Sharded over 2 ranks on one group and on two; replicated (DDP) over 2 ranks; one rank per client."""
    tmp = tmp_path_factory.mktemp("sharded")
    return {"sharded, one group": run(tmp, "s1", 3), "sharded, two groups": run(tmp, "s2", 5),
            "replicated": run(tmp, "ddp", 5, "clients.sharding=replicate"),
            "one rank": run(tmp, "one", 3, "clients.sharding=replicate", "clients.ranks_per_client=1")}


def test_a_sharded_client_gives_the_same_model_bitwise_on_one_or_two_groups(runs):
    assert_bitwise(final_model(runs["sharded, two groups"]), final_model(runs["sharded, one group"]))


def test_sharding_a_client_gives_bitwise_the_model_a_replicated_group_of_the_same_size_trains(runs):
    """Same shares of each batch, same averaged gradients: FSDP's reduce-scatter and DDP's all-reduce agree to the
    bit here, and the sharded client starts from the weights an unsharded build initialises."""
    assert_bitwise(final_model(runs["sharded, one group"]), final_model(runs["replicated"]))


def test_a_sharded_client_trains_the_model_one_rank_would_up_to_float_rounding(runs):
    assert relative_l2(final_model(runs["sharded, one group"]), final_model(runs["one rank"])) < TOLERANCE


def test_a_client_sharded_over_four_ranks_is_within_rounding_of_one_rank(tmp_path, runs):
    four = final_model(run(tmp_path, "four", 5, "clients.ranks_per_client=4"))
    assert relative_l2(four, final_model(runs["one rank"])) < TOLERANCE


def test_the_sharded_record_reports_the_groups_cost_and_the_client_metrics(runs):
    import json

    record = json.loads((runs["sharded, two groups"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["client_group"]["train"] > 0 and record["client_peak_rss_bytes"] > 0
    assert record["cost"]["cpu_seconds"] > 0 and np.isfinite(record["train_loss"])


def test_tied_embeddings_shard_and_start_from_the_unsharded_initialisation(tmp_path):
    gpt2 = tuple(f"{k}={v}" for k, v in GPT2.items())
    sharded = final_model(run(tmp_path, "gpt2-fsdp", 3, *gpt2))
    assert_bitwise(sharded, final_model(run(tmp_path, "gpt2-ddp", 3, *gpt2, "clients.sharding=replicate")))


def test_lora_adapters_train_on_a_sharded_frozen_base_in_bf16(tmp_path):
    """Only the adapters travel; the base never does, and each rank initialises its rows of it as an unsharded
    build would: the result is within rounding of one rank per client's."""
    sharded = final_model(run(tmp_path, "lora-fsdp", 3, *LORA))
    assert sharded and all(".lora_" in name for name in sharded)
    single = final_model(run(tmp_path, "lora-one", 2, *LORA, "clients.sharding=replicate",
                             "clients.ranks_per_client=1"))
    assert relative_l2(sharded, single) < TOLERANCE


def test_pretrained_weights_are_read_row_by_row_into_the_shards(tmp_path):
    """Each rank reads only its rows of each tensor from the safetensors shards (``get_slice``); the result is
    bitwise the replicated group's, which reads whole tensors, and not the seeded model's."""
    import transformers
    import yaml

    settings = yaml.safe_load(LLAMA)["model"]["transformers"]["config"]
    with torch.random.fork_rng():
        torch.manual_seed(11)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    model.save_pretrained(tmp_path / "weights", max_shard_size="100KB")
    assert len(list((tmp_path / "weights").glob("*.safetensors"))) > 1
    read = (f"model.transformers.path={tmp_path / 'weights'}", "model.transformers.pretrained=true")
    sharded = final_model(run(tmp_path, "pretrained-fsdp", 3, *read))
    assert_bitwise(sharded, final_model(run(tmp_path, "pretrained-ddp", 3, *read, "clients.sharding=replicate")))
    seeded = final_model(run(tmp_path, "seeded", 3))
    assert relative_l2(sharded, seeded) > 0.1


def test_the_out_of_core_servers_round_0_is_gathered_from_the_shards(tmp_path):
    disk = ("server.state=disk", "clients.per_round=2")
    assert_bitwise(final_model(run(tmp_path, "disk", 5, *disk)),
                   final_model(run(tmp_path, "memory", 5, "clients.per_round=2")))


def test_killed_with_sigkill_and_resumed_on_another_number_of_groups_it_ends_bitwise_as_run_whole(tmp_path, runs):
    cfg = config(tmp_path)
    run_dir = tmp_path / "killed"
    longer = ("rounds=6", "checkpoint.every=1")
    proc = spawn_mpi(5, "run", str(cfg), "--run-dir", str(run_dir), *longer)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(rounds_logged(run_dir)) >= 2, proc, "round 2")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert len(rounds_logged(run_dir)) < 6  # killed mid-run
    resumed = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", *longer, timeout=MPI_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = run(tmp_path, "whole", 3, *longer)
    assert_bitwise(final_model(run_dir), final_model(whole))


@pytest.mark.parametrize(("override", "key"), [
    ("clients.ranks_per_client=1", "clients.ranks_per_client"),
    ("model.local=[model.norm.weight]", "per-client state"),
    ("clients.groups=2", "clients.groups"),
    ("compression.method=int8", "compression.method"),
    ("clock.mode=fedasync", "clock.mode"),
    ("privacy.mode=local", "privacy.mode"),
    ("transport.dispatch_fanout=2", "transport.dispatch_fanout"),
])
def test_what_the_sharded_path_does_not_carry_yet_is_refused_naming_its_key(tmp_path, override, key):
    cfg = config(tmp_path)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(cfg, override.split())


def test_sharding_is_for_transformers_models(tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(ConfigError, match="model.name"):
        load_config(cfg, ["model.name=mlp", "data.dataset=digits", "train.trainer=torch",
                          "model.transformers.config={}"])
