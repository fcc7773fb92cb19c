"""Transformers models: allocated once through the meta device, configured offline, loaded from
local folders, trained as causal LMs, and exchanged trainable-only."""
from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mpifl.config import ConfigError, load_config  # noqa: E402
from mpifl.learning import hf  # noqa: E402
from mpifl.learning.datasets import ClientData  # noqa: E402
from mpifl.learning.models import build_flat_model, model_spec  # noqa: E402
from mpifl.learning.text import stdlib_docstrings, text  # noqa: E402
from mpifl.learning.trainers import CausalLMTrainer, evaluate_language_model  # noqa: E402

TINY = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "n_positions": 64},
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64},
}


def model_cfg(architecture: str = "gpt2", dtype: str = "float32", **model):
    transformers_section = model.pop("transformers", {"architecture": architecture, "config": TINY[architecture]})
    return load_config(None, data={"model": {"name": "transformers", "dtype": dtype,
                                             "transformers": transformers_section, **model},
                                   "train": {"trainer": "none"}, "eval": {"every": 0}}).model


def normal_build(cfg, seed: int):
    """transformers' own from_config on CPU (torch allocates every tensor), then the same seeded init."""
    model = transformers.AutoModelForCausalLM.from_config(hf.transformers_config(cfg), dtype=torch.float32)
    hf.initialize(model, seed)
    return model


def same_storage(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_meta_built_parameters_are_views_of_the_flat_buffer_and_forward_equals_a_normal_build(architecture):
    cfg = model_cfg(architecture)
    flat = build_flat_model(cfg, seed=3)
    params = list(flat.module.named_parameters())
    assert params and all(same_storage(p, flat.buffer) for _, p in params)
    assert sum(p.numel() * p.element_size() for _, p in params) <= flat.buffer.numel()
    reference = normal_build(cfg, seed=3)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    flat.module.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(flat.module(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_tied_embeddings_stay_one_tensor_in_the_buffer():
    flat = build_flat_model(model_cfg("gpt2"), seed=0)
    model = flat.module
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [e.name for e in flat.spec.entries].count("transformer.wte.weight") == 1
    assert not any(e.name == "lm_head.weight" for e in flat.spec.entries)


def test_bf16_model_is_bf16_in_the_buffer_and_on_the_wire():
    flat = build_flat_model(model_cfg("llama", dtype="bfloat16"), seed=0)
    assert {e.dtype for e in flat.spec.entries} == {"bfloat16"}
    assert all(p.dtype == torch.bfloat16 for p in flat.module.parameters())
    assert flat.module.model.rotary_emb.inv_freq.dtype == torch.float32  # computed buffers keep their dtype


def test_the_seed_decides_the_weights():
    a, b, c = (build_flat_model(model_cfg(), seed=s) for s in (1, 1, 2))
    assert torch.equal(a.buffer, b.buffer) and not torch.equal(a.buffer, c.buffer)


def test_pretrained_folder_is_read_shard_by_shard_into_the_buffer(tmp_path):
    source = normal_build(model_cfg("llama"), seed=5)
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    flat = build_flat_model(model_cfg(transformers={"path": str(tmp_path), "pretrained": True}), seed=0)
    loaded = flat.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in source.state_dict().items())


def test_a_pretrained_folder_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import save_file

    source = normal_build(model_cfg("gpt2"), seed=5)
    source.config.save_pretrained(tmp_path)
    state = {k: v for k, v in source.state_dict().items() if k != "transformer.ln_f.bias" and k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="transformer.ln_f.bias"):
        build_flat_model(model_cfg(transformers={"path": str(tmp_path), "pretrained": True}), seed=0)


def test_config_mistakes_are_named_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match="n_layers.*did you mean 'n_layer'"):
        hf.transformers_config(model_cfg(transformers={"architecture": "gpt2", "config": {"n_layers": 2}}))
    with pytest.raises(ConfigError, match="'lama' is not a transformers model_type; did you mean.*llama"):
        hf.transformers_config(model_cfg(transformers={"architecture": "lama"}))
    with pytest.raises(ConfigError, match="not a local folder.*nothing is downloaded"):
        model_cfg(transformers={"path": "openai-community/gpt2"})
    with pytest.raises(ConfigError, match="pretrained: no \\*.safetensors"):
        model_cfg(transformers={"path": str(tmp_path), "architecture": "gpt2", "pretrained": True})


def test_trainable_patterns_put_frozen_tensors_in_a_buffer_that_never_travels():
    cfg = model_cfg(trainable=["transformer.h.1.*", "transformer.ln_f.*"])
    flat = build_flat_model(cfg, seed=0)
    exchanged = [e.name for e in flat.spec.entries]
    frozen = [e.name for e in flat.frozen_spec.entries]
    assert exchanged and all(n.startswith(("transformer.h.1.", "transformer.ln_f.")) for n in exchanged)
    assert "transformer.wte.weight" in frozen and not set(exchanged) & set(frozen)
    for name, p in flat.module.named_parameters():
        assert same_storage(p, flat.buffer if p.requires_grad else flat.frozen), name
    assert model_spec(cfg, 0) == (flat.spec, flat.frozen_spec)  # the dry run sees the same split
    everything = build_flat_model(model_cfg(trainable=["transformer.h.1.*"], exchange="all"), seed=0)
    assert not everything.frozen_spec.entries and len(everything.spec.entries) == len(exchanged) + len(frozen)


def test_a_trainable_pattern_that_matches_nothing_is_named():
    with pytest.raises(ConfigError, match="'decoder.layers.*' matches no parameter"):
        build_flat_model(model_cfg(trainable=["decoder.layers.*"]), seed=0)


def test_lora_exchanges_only_adapters_and_starts_as_the_base_model():
    pytest.importorskip("peft")
    cfg = model_cfg(lora={"r": 4, "target_modules": ["c_attn"]})
    flat = build_flat_model(cfg, seed=7)
    names = [e.name for e in flat.spec.entries]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert all(float(t.abs().max()) == 0 for n, t in flat.tensors() if ".lora_B." in n)
    assert all(float(t.abs().max()) > 0 for n, t in flat.tensors() if ".lora_A." in n)
    base = normal_build(model_cfg(), seed=7)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    flat.module.eval(), base.eval()
    with torch.no_grad():
        assert torch.equal(flat.module(input_ids=ids).logits, base(input_ids=ids).logits)


def test_text_blocks_come_from_local_files_with_a_tokenizer_trained_on_the_spot(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Return the sum of two numbers. Raise ValueError when empty.\n" * 200)
    x, y, x_test, y_test = text(files=[str(corpus)], vocab_size=300, seq_len=16, test_fraction=0.25)
    assert x.shape[1] == 16 and x_test.shape[1] == 16 and len(x_test) == (len(x) + len(x_test)) // 4
    assert int(x.max()) < 300 and not y.any() and not y_test.any()
    again = text(files=[str(corpus)], vocab_size=300, seq_len=16, test_fraction=0.25)
    assert torch.equal(x, again[0])  # the trained tokenizer is deterministic


def test_a_local_tokenizer_file_is_used_as_is(tmp_path):
    from mpifl.learning.text import train_tokenizer

    train_tokenizer(["alpha beta gamma delta"] * 50, vocab_size=280).save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta " * 100)
    x, *_ = text(files=[str(corpus)], tokenizer=str(tmp_path), seq_len=8)
    assert int(x.max()) < 280


def test_one_path_for_data_kwargs_files_reads_as_a_list_of_that_one_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Return the sum of two numbers. Raise ValueError when empty.\n" * 50)
    alone = text(files=str(corpus), vocab_size=260, seq_len=16)
    listed = text(files=[str(corpus)], vocab_size=260, seq_len=16)
    assert all(torch.equal(a, b) for a, b in zip(alone, listed))
    with pytest.raises(ValueError, match=r"^data.kwargs.files: takes a list of paths to UTF-8 text files \(or one "
                                         r"path\), not \{'a': 1\}$"):
        text(files={"a": 1}, vocab_size=260, seq_len=16)


def test_an_empty_list_of_corpus_files_is_refused_rather_than_read_as_the_key_left_out():
    """Leaving data.kwargs.files out trains on the standard library's docstrings; an empty list names no file, and
    was read the same way without a word."""
    with pytest.raises(ValueError, match=r"^data.kwargs.files: an empty list names no corpus file; name the files, "
                                         r"or leave the key out"):
        text(files=[], vocab_size=260, seq_len=16)


@pytest.mark.parametrize("content, says", [("", "is empty"), (" \n\t\n", "holds only whitespace")])
def test_a_corpus_file_without_text_is_refused_naming_the_key_and_the_path_even_beside_one_with_text(
        tmp_path, content, says):
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("Return the sum of two numbers. Raise ValueError when empty.\n" * 50)
    empty.write_text(content)
    for files in ([str(empty)], [str(good), str(empty)]):
        with pytest.raises(ValueError) as refused:
            text(files=files, vocab_size=260, seq_len=16)
        assert str(refused.value) == f"data.kwargs.files: {str(empty)!r} {says}; name files that hold text"


def test_a_corpus_file_that_is_not_utf8_is_refused_naming_the_key_the_path_and_the_bytes_offset_in_the_file(
        tmp_path):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"x" * 20_000 + b"\xff" + b"y" * 100)  # past a text-mode read's first chunk
    with pytest.raises(ValueError) as refused:
        text(files=[str(binary)], vocab_size=260, seq_len=16)
    assert str(refused.value) == (f"data.kwargs.files: {str(binary)!r} must be UTF-8 text, but byte 0xff at offset "
                                  f"20000 does not decode (invalid start byte)")


def test_a_tokenizer_file_that_is_not_a_tokenizers_json_is_refused_naming_the_key_the_path_and_the_format(tmp_path):
    from mpifl.learning.text import load_tokenizer

    garbage = tmp_path / "corpus.txt"
    garbage.write_text("not json at all\n")
    with pytest.raises(ValueError) as refused:
        load_tokenizer(str(garbage))
    assert str(refused.value).startswith(
        f"data.kwargs.tokenizer: {str(garbage)!r} is not a Hugging Face tokenizers JSON file (tokenizer.json, as "
        f"Tokenizer.save writes it): ")


def test_the_default_corpus_is_the_standard_librarys_docstrings():
    docs = stdlib_docstrings(max_chars=20_000)
    assert sum(map(len, docs)) >= 20_000 and all(isinstance(d, str) and d for d in docs)


def tiny_lm_data(n: int = 32, seq_len: int = 16) -> ClientData:
    pattern = torch.arange(n * seq_len) % 7  # a learnable sequence
    return ClientData(pattern.reshape(n, seq_len), torch.zeros(n, dtype=torch.long))


def lm_train_cfg(**train):
    return load_config(None, data={"model": {"name": "transformers", "transformers": {"architecture": "gpt2"}},
                                   "data": {"dataset": "text"},
                                   "train": {"trainer": "causal_lm", "optimizer": "adamw", "lr": 3e-3,
                                             "batch_size": 8, "local_steps": 20, **train}}).train


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_lm_training_lowers_held_out_loss_and_leaves_frozen_tensors_bitwise_alone(dtype):
    torch.set_num_threads(1)
    flat = build_flat_model(model_cfg(dtype=dtype, trainable=["transformer.h.*"]), seed=0)
    data = tiny_lm_data()
    frozen_before = flat.frozen.clone()
    trainable_before = flat.buffer.clone()
    before = evaluate_language_model(flat.module, data.x, 16)
    result = CausalLMTrainer(lm_train_cfg(grad_accum_steps=2, max_grad_norm=1.0)).train(flat.module, data, seed=1)
    after = evaluate_language_model(flat.module, data.x, 16)
    assert after["loss"] < before["loss"] - 0.3
    assert math.isclose(after["perplexity"], math.exp(after["loss"]))
    assert result.num_samples == 32 and result.metrics["loss"] > 0
    assert torch.equal(flat.frozen, frozen_before)
    assert not torch.equal(flat.buffer, trainable_before)
    assert all(p.dtype == getattr(torch, dtype) for p in flat.module.parameters())


def test_gradient_checkpointing_gives_the_same_update():
    torch.set_num_threads(1)
    results = []
    for checkpointing in (False, True):
        flat = build_flat_model(model_cfg(), seed=0)
        CausalLMTrainer(lm_train_cfg(local_steps=3, gradient_checkpointing=checkpointing)).train(
            flat.module, tiny_lm_data(), seed=4)
        results.append(flat.buffer.view(torch.float32).clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)


def run_cli(*args: str, address_space: int | None = None):
    import resource
    import subprocess
    import sys

    def limit() -> None:
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run([sys.executable, "-m", "mpifl", *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)


@pytest.mark.parametrize("preset, parameters", [("llama3.1-8b", "8.030 B"), ("llama3.1-70b", "70.554 B")])
def test_cluster_presets_validate_and_plan_without_allocating_the_model(preset, parameters):
    from conftest import ROOT, mpifl_here

    config = str(ROOT / "configs" / f"{preset}.yaml")
    validated = mpifl_here("validate", config)
    assert validated.returncode == 0 and parameters in validated.stdout, validated.stderr
    # 6 GiB of address space: far less than the model (15 or 131 GiB), so nothing may be allocated
    planned = run_cli("plan", config, "--ranks-per-node", "1", "--server-alone", address_space=6 * 2**30)
    assert planned.returncode == 0, planned.stderr
    assert parameters in planned.stdout and "rank 0 (server)" in planned.stdout and "clients" in planned.stdout


TINY_LLAMA_RUN = {  # the user walkthrough's tiny llama, trained on text blocks (a trained tokenizer has 257 ids)
    "data": {"dataset": "text", "partition": "iid", "kwargs": {"vocab_size": 256, "seq_len": 64}},
    "model": {"name": "transformers", "transformers": {"architecture": "llama",
                                                       "config": {**TINY["llama"], "vocab_size": 320}}},
    "train": {"trainer": "causal_lm"}, "eval": {"every": 0}}


def checked(*overrides: str):
    """A config through every check ``mpifl run`` does before MPI starts."""
    from mpifl.cli.preflight import check_plugins

    cfg = load_config(None, overrides, data=copy.deepcopy(TINY_LLAMA_RUN))  # overrides write into the dict
    check_plugins(cfg)
    return cfg


def test_each_lora_target_must_adapt_a_module_even_beside_one_that_does():
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: 'q_projj' matches no module of the model; "
                                          r"closest module names: q_proj"):
        checked("model.lora.r=4", "model.lora.target_modules=[q_projj,v_proj]")
    checked("model.lora.r=4", "model.lora.target_modules=[q_proj,self_attn.v_proj]")


def test_lora_targets_match_as_peft_matches_them_the_name_or_a_dotted_suffix():
    names = ["", "model", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]
    assert hf.unmatched_target_problem(names, ["q_proj", "mlp.up_proj", "model.layers.0.mlp.up_proj"]) is None
    assert "'proj' matches no module" in hf.unmatched_target_problem(names, ["q_proj", "proj"])
    assert "'_proj' matches no module" in hf.unmatched_target_problem(names, ["_proj"])  # a suffix, not a dotted one


@pytest.mark.parametrize("architecture, key", [("gpt2", "n_positions"), ("llama", "max_position_embeddings")])
def test_text_blocks_longer_than_the_models_positions_are_refused_before_mpi_naming_both_keys(architecture, key):
    config = hf.transformers_config(model_cfg(architecture))
    assert hf.positions_problem(config, 64) is None
    assert hf.positions_problem(config, 65) == (
        f"data.kwargs.seq_len: blocks of 65 tokens are longer than the model's 64 positions; lower "
        f"data.kwargs.seq_len or raise model.transformers.config's {key}")
    with pytest.raises(ConfigError, match=f"^data.kwargs.seq_len: blocks of 128 tokens .*config's {key}$"):
        checked("data.kwargs.seq_len=128", f"model.transformers.architecture={architecture}",
                f"model.transformers.config={TINY[architecture]}".replace("'", ""))
    with pytest.raises(ConfigError, match="blocks of 128 tokens"):  # text's own default block length
        checked("data.kwargs={vocab_size: 256}")


def word_tokenizer(path, ids: int) -> str:
    """A tokenizer.json of ``ids`` token ids (a word-level one: its size is all these tests look at)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(ids)}, unk_token="w0")).save(str(path))
    return str(path)


def test_a_named_tokenizer_with_more_ids_than_the_model_has_rows_is_refused_before_mpi_naming_both_keys(tmp_path):
    checked(f"data.kwargs.tokenizer={word_tokenizer(tmp_path / 'fits.json', 320)}")  # ids 0..319: 320 rows do
    with pytest.raises(ConfigError) as refused:
        checked(f"data.kwargs.tokenizer={word_tokenizer(tmp_path / 'big.json', 2000)}")
    assert str(refused.value) == (
        "data.kwargs.tokenizer: the tokenizer gives 2000 token ids, more than the model's 320-row embedding "
        "(model.transformers.config's vocab_size); raise model.transformers.config's vocab_size to 2000 or name a "
        "tokenizer with fewer ids in data.kwargs.tokenizer (data.kwargs.vocab_size is for a tokenizer trained at "
        "start-up)")
    with pytest.raises(ConfigError, match=r"^data.kwargs.tokenizer: no tokenizer.json at '.*nope.json'$"):
        checked(f"data.kwargs.tokenizer={tmp_path / 'nope.json'}")


def test_a_tokenizer_trained_to_more_ids_than_the_model_has_rows_is_refused_before_mpi_naming_both_keys():
    with pytest.raises(ConfigError) as refused:
        checked("data.kwargs.vocab_size=2000")
    assert str(refused.value) == (
        "data.kwargs.vocab_size: the tokenizer gives 2000 token ids, more than the model's 320-row embedding "
        "(model.transformers.config's vocab_size); raise model.transformers.config's vocab_size to 2000 or lower "
        "data.kwargs.vocab_size")
    with pytest.raises(ConfigError, match=r"^data.kwargs.vocab_size: the tokenizer gives 8192 token ids"):
        checked("data.kwargs={seq_len: 64}")  # text's own default vocab_size


def test_a_tokenizer_trained_to_256_ids_has_257_and_a_256_row_model_is_refused_before_mpi_naming_both_keys():
    """A trained tokenizer holds every byte and <|endoftext|> whatever data.kwargs.vocab_size asks: 257 ids at
    least, so vocab_size 256 does not fit a 256-row embedding, and lowering it would not help."""
    with pytest.raises(ConfigError) as refused:
        checked("model.transformers.config.vocab_size=256")  # data.kwargs.vocab_size: 256
    assert str(refused.value) == (
        "data.kwargs.vocab_size: the tokenizer trained to 256 gives 257 token ids, more than the model's 256-row "
        "embedding (model.transformers.config's vocab_size); raise model.transformers.config's vocab_size to 257 "
        "or name a tokenizer with fewer ids in data.kwargs.tokenizer (one trained at start-up has at least 257, "
        "every byte and <|endoftext|>, whatever data.kwargs.vocab_size asks)")
    checked("model.transformers.config.vocab_size=257")


@pytest.mark.parametrize("vocab_size", [10, 256, 257, 258, 300])
def test_the_ids_a_trained_tokenizer_is_counted_before_mpi_to_have_are_at_least_those_it_has(vocab_size):
    from mpifl.learning.text import FEWEST_TRAINED_IDS, train_tokenizer, trained_token_ids

    docs = ["federated learning over MPI ranks, one round at a time. " * 40]
    vocabulary = train_tokenizer(docs, vocab_size).get_vocab(with_added_tokens=True)
    ids = max(vocabulary.values()) + 1
    assert ids <= trained_token_ids(vocab_size) and FEWEST_TRAINED_IDS == 257
    if vocab_size <= FEWEST_TRAINED_IDS:  # every byte and the special tokens, whatever was asked
        assert ids == trained_token_ids(vocab_size) == FEWEST_TRAINED_IDS


def test_validate_refuses_a_tokenizer_larger_than_the_model_with_exit_status_2(tmp_path):
    import yaml
    from conftest import mpifl_here

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_LLAMA_RUN))
    refused = mpifl_here("validate", str(path), f"data.kwargs.tokenizer={word_tokenizer(tmp_path / 't.json', 2000)}")
    assert refused.returncode == 2
    assert refused.stderr.startswith("mpifl: config error: data.kwargs.tokenizer: the tokenizer gives 2000 token ids")


@pytest.mark.parametrize("kwargs, advice", [
    ({"tokenizer": "t.json"}, "name a tokenizer with fewer ids in data.kwargs.tokenizer (data.kwargs.vocab_size is "
                              "for a tokenizer trained at start-up)"),
    ({"vocab_size": 2000}, "lower data.kwargs.vocab_size"),
])
def test_a_token_id_past_the_embedding_at_run_time_is_advised_by_where_the_ids_came_from(kwargs, advice):
    from mpifl.config import DataConfig
    from mpifl.learning.datasets import Dataset
    from mpifl.roles.data import vocabulary_problem

    flat = build_flat_model(model_cfg("gpt2"), seed=0)
    ids = torch.tensor([[1, 1986], [2, 3]])
    dataset = Dataset(ids, torch.zeros(2, dtype=torch.long), ids[:1], torch.zeros(1, dtype=torch.long))
    assert vocabulary_problem(flat, dataset, DataConfig(dataset="text", kwargs=kwargs)) == (
        f"data: token id 1986 does not fit the model's 256-row embedding; raise model.transformers.config's "
        f"vocab_size or {advice}")
    assert vocabulary_problem(flat, dataset, DataConfig(dataset="my_data:tokens")) == (
        "data: token id 1986 does not fit the model's 256-row embedding; raise model.transformers.config's "
        "vocab_size")


@pytest.mark.parametrize("architecture, heads, says", [
    ("llama", "num_attention_heads", r"The hidden size \(32\) is not a multiple of the number of attention heads "
                                     r"\(5\)"),  # refused by the config's validator
    ("gpt2", "n_head", "`embed_dim` must be divisible by num_heads"),  # refused by the model as it is built
])
def test_an_impossible_shape_is_a_config_error_naming_the_key_with_the_librarys_reason(architecture, heads, says):
    cfg = model_cfg(transformers={"architecture": architecture, "config": {**TINY[architecture], heads: 5}})
    with pytest.raises(ConfigError, match=f"^model.transformers.config: transformers refuses the model: {says}"):
        build_flat_model(cfg, seed=0)


def test_validate_says_a_transformers_config_error_in_one_line_with_exit_status_2(tmp_path):
    import subprocess
    import sys

    import yaml
    from conftest import mpifl_here

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_LLAMA_RUN))
    result = subprocess.run([sys.executable, "-m", "mpifl", "validate", str(path),
                             "model.transformers.config.num_attention_heads=5"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["mpifl: config error: model.transformers.config: transformers refuses the "
                                          "model: The hidden size (32) is not a multiple of the number of attention "
                                          "heads (5)."]
    # the console entry's exit status and its one stderr line are the process's, above; the same config without
    # the bad override validates in this process (a second interpreter would import torch and transformers again)
    fine = mpifl_here("validate", str(path))
    assert fine.returncode == 0, fine.stderr
    assert "model transformers float32 (" in fine.stdout and "K parameters (" in fine.stdout  # not "0.000 B"
    assert " KiB exchanged, 0 B frozen)" in fine.stdout


def test_exported_lora_adapters_load_with_peft_onto_the_base_model_and_give_mpifls_logits(tmp_path):
    """``mpifl export`` of a LoRA run writes the adapters under peft's names, peft's adapter_config.json and the
    base model's config.json: peft's own loader then rebuilds the model mpifl trained."""
    peft = pytest.importorskip("peft")
    from mpifl.cli.checkpoints import export
    from mpifl.config import dump_config
    from mpifl.storage.hdf5 import CheckpointWriter

    lora = {"r": 4, "alpha": 8.0, "target_modules": ["c_attn"]}
    cfg = load_config(None, data={"model": {"name": "transformers", "lora": lora, "transformers": {
        "architecture": "gpt2", "config": TINY["gpt2"]}}, "train": {"trainer": "none"}, "eval": {"every": 0}})
    flat = build_flat_model(cfg.model, seed=3)
    with torch.no_grad():  # trained adapters: B is no longer zero, so the adapters change the logits
        for name, tensor in flat.tensors():
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(len(name))))
    with CheckpointWriter(tmp_path / "model.h5", flat.spec, {"round": 1, "config": dump_config(cfg)}) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_metrics([])
        writer.publish()
    out = tmp_path / "adapter"
    out.mkdir()
    assert export(str(tmp_path / "model.h5"), str(out / "adapter_model.safetensors")) == 0
    assert {p.name for p in out.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "config.json"}
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    hf.initialize(base, 3)  # the base weights a LoRA run starts from (and never changes) are its seed's
    loaded = peft.PeftModel.from_pretrained(base, out)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    flat.module.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, flat.module(input_ids=ids).logits)
        with loaded.disable_adapter():  # the adapters were loaded, not left at zero
            assert not torch.equal(loaded(input_ids=ids).logits, flat.module(input_ids=ids).logits)


def tiny_gpt2_checkpoint(run_dir, seed: int = 3):
    """A finished run's final model, as ``run`` leaves it, of the tiny GPT-2 (its config: the architecture's
    special-token ids, 50256)."""
    from mpifl.config import dump_config
    from mpifl.storage.hdf5 import CheckpointWriter

    cfg = load_config(None, data={"model": {"name": "transformers", "transformers": {
        "architecture": "gpt2", "config": {**TINY["gpt2"], "vocab_size": 320}}},
        "train": {"trainer": "none"}, "eval": {"every": 0}})
    flat = build_flat_model(cfg.model, seed=seed)
    run_dir.mkdir()
    with CheckpointWriter(run_dir / "model.h5", flat.spec, {"round": 1, "config": dump_config(cfg)}) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_metrics([])
        return writer.publish()


def test_an_exported_config_names_the_run_tokenizers_end_of_text_id_not_the_architectures(tmp_path):
    from tokenizers import Tokenizer

    from mpifl.cli.checkpoints import export
    from mpifl.learning.text import EOS, train_tokenizer

    checkpoint = tiny_gpt2_checkpoint(tmp_path / "run")
    train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300).save(str(tmp_path / "run" / "tokenizer.json"))
    trained = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    assert trained.token_to_id(EOS) == 0  # the trainer's one special token comes first
    out = tmp_path / "export"
    out.mkdir()
    assert export(str(checkpoint), str(out / "model.safetensors")) == 0
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, None)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert (exported.bos_token_id, exported.eos_token_id) == (0, 0)
    sample = "def add(a, b):\n    return a + b\n"
    assert exported(sample)["input_ids"] == trained.encode(sample).ids  # no token added at either end


def test_an_exported_config_without_the_runs_tokenizer_keeps_the_architectures_ids(tmp_path):
    from mpifl.cli.checkpoints import export

    checkpoint = tiny_gpt2_checkpoint(tmp_path / "run")
    out = tmp_path / "export"
    out.mkdir()
    assert export(str(checkpoint), str(out / "model.safetensors")) == 0
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id) == (50256, 50256)
    assert not (out / "tokenizer.json").exists()


def test_a_tokenizer_pads_with_its_end_of_text_only_where_the_architecture_pads_and_names_none_it_lacks():
    from tokenizers import Tokenizer, models

    from mpifl.learning.text import special_token_ids, train_tokenizer

    trained = train_tokenizer(["x = 1\n"] * 5, 280)
    assert special_token_ids(trained) == {"bos_token_id": 0, "eos_token_id": 0}
    assert special_token_ids(trained, padded=True) == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    assert special_token_ids(Tokenizer(models.BPE())) == {}  # a model's own tokenizer: its config already agrees
