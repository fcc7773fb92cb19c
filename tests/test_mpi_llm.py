"""Federated causal-LM fine-tuning under mpiexec: perplexity, trainable-only exchange, LoRA."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from conftest import mpifl_here, run_mpi, write_config
from fl_helpers import frozen_digest

from mpifl.config import load_config
from mpifl.learning.models import build_flat_model
from mpifl.storage.hdf5 import Checkpoint

CONFIG = """
name: tiny-lm
rounds: 3
clients: {{num_clients: 4}}
data:
  dataset: text
  kwargs: {{files: [{corpus}], vocab_size: 300, seq_len: 16, test_fraction: 0.1}}
model:
  name: transformers
  dtype: bfloat16
  transformers:
    architecture: gpt2
    config: {{n_layer: 2, n_embd: 32, n_head: 4, vocab_size: 320, n_positions: 32}}
train: {{trainer: "fl_helpers:FrozenWatchTrainer", optimizer: adamw, lr: 0.003, batch_size: 8, local_steps: 3}}
eval: {{every: 1, batch_size: 64}}
"""


def lm_run(tmp_path, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n" * 150)
    cfg = write_config(tmp_path / "lm.yaml", CONFIG.format(corpus=corpus))
    digests = tmp_path / "digests"
    digests.mkdir()
    result = run_mpi(3, "run", str(cfg), *overrides, "--run-dir", str(tmp_path / "run"), timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lines = [line.split() for f in sorted(digests.glob("rank*.txt")) for line in f.read_text().splitlines()]
    return load_config(cfg, list(overrides)), records, lines


def test_frozen_layers_stay_bitwise_and_only_trainable_tensors_travel(tmp_path):
    cfg, records, digests = lm_run(tmp_path, 'model.trainable=["transformer.h.1.*", "transformer.ln_f.*"]')
    expected = build_flat_model(cfg.model, cfg.seed)
    trainable = {e.name for e in expected.spec.entries}
    assert trainable and all(n.startswith(("transformer.h.1.", "transformer.ln_f.")) for n in trainable)
    with Checkpoint(tmp_path / "run" / "model.h5") as final:
        assert {name for name, *_ in final.entries()} == trainable
    for r in records:  # 4 participants on 2 ranks: the model goes out twice, four updates come back
        assert r["bytes_sent"] == 2 * expected.spec.total_bytes
        assert r["bytes_received"] == 4 * expected.spec.total_bytes
    assert len(digests) == 3 * 4  # every client's training, every round
    assert {d for pair in digests for d in pair} == {frozen_digest(expected.module)}
    perplexities = [r["eval"]["perplexity"] for r in records]
    assert perplexities[-1] < perplexities[0]


def test_full_exchange_moves_every_tensor(tmp_path):
    cfg, records, _ = lm_run(tmp_path, 'model.trainable=["transformer.h.1.*"]', "model.exchange=all", "rounds=1")
    flat = build_flat_model(cfg.model, cfg.seed)
    assert not flat.frozen_spec.entries
    assert records[0]["bytes_received"] == 4 * flat.spec.total_bytes


def test_a_lora_run_aggregates_only_adapter_weights(tmp_path):
    pytest.importorskip("peft")
    cfg, records, digests = lm_run(tmp_path, "model.lora.r=4", "model.lora.target_modules=[c_attn]")
    flat = build_flat_model(cfg.model, cfg.seed)
    names = [e.name for e in flat.spec.entries]
    assert names and all(".lora_" in n for n in names)
    assert records[-1]["bytes_received"] == 4 * flat.spec.total_bytes < flat.frozen_spec.total_bytes
    assert {d for pair in digests for d in pair} == {frozen_digest(flat.module)}


def test_an_exported_final_model_is_a_folder_that_loads_as_pretrained(tmp_path):

    import torch

    cfg, _, _ = lm_run(tmp_path, "rounds=1", "output.save_model=true")
    folder = tmp_path / "export"
    folder.mkdir()
    done = mpifl_here("export", str(tmp_path / "run" / "model.h5"), str(folder / "model.safetensors"))
    assert done.returncode == 0 and (folder / "config.json").is_file(), done.stderr
    cfg.model.transformers.path, cfg.model.transformers.pretrained = str(folder), True
    loaded = build_flat_model(cfg.model, seed=123)  # another seed: every weight must come from the folder
    with Checkpoint(tmp_path / "run" / "model.h5") as final:
        saved = final.tensors()
    assert all(torch.equal(t, saved[name]) for name, t in loaded.tensors())
    # the tokenizer trained at start-up is kept in the run directory and exported beside the weights: transformers
    # loads it from the folder and gives the token ids the model was trained on
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from mpifl.learning.text import text

    trained = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    exported = AutoTokenizer.from_pretrained(str(folder))
    sample = "def add(a, b):\n    return a + b\n"
    assert exported(sample)["input_ids"] == trained.encode(sample).ids
    assert exported.eos_token == "<|endoftext|>" and exported.decode(exported(sample)["input_ids"]) == sample
    config = json.loads((folder / "config.json").read_text())  # generate() stops at the end of text it learned
    assert config["eos_token_id"] == config["bos_token_id"] == trained.token_to_id("<|endoftext|>") == 0
    blocks = text(files=[str(tmp_path / "corpus.txt")], vocab_size=300, seq_len=16)
    assert Tokenizer.from_str(blocks.tokenizer).to_str() == trained.to_str()  # the one every rank trained


def test_a_wrong_transformers_config_key_stops_every_rank_before_mpi_work(tmp_path):
    cfg = write_config(tmp_path / "lm.yaml", CONFIG.format(corpus=tmp_path / "unused.txt"))
    result = run_mpi(3, "run", str(cfg), "model.transformers.config.n_layers=2", timeout=60)
    assert result.returncode == 2
    assert "model.transformers.config.n_layers: not a gpt2 config key; did you mean 'n_layer'?" in result.stderr
    assert "Traceback" not in result.stderr
