"""clients.sharding: fsdp: a logical client's model sharded over the R ranks of its group with FSDP, no rank holding
the whole model or the whole update. Its result is bitwise the replicated (DDP) group's of the same R, whatever the
number of groups (GPT-2's dropout too: each rank draws its own masks), and after a kill -9 and a resume on another
number of groups; within float rounding of one rank per client; the frozen base of LoRA is initialised as an
unsharded build initialises it, tied embeddings too; the out-of-core server's round 0 is gathered from the shards;
SCAFFOLD's, FedDyn's and Ditto's per-client state and top-k's error feedback are kept by every rank over its own
rows; compressed updates are encoded by the leader chunk by chunk; and what the sharded path does not carry yet is
refused, naming the key."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import killed_and_resumed, mpifl_here, run_mpi, write_config
from results import assert_bitwise, final_model, relative_l2
from safetensors import numpy as safetensors_numpy

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


def test_every_rank_of_a_client_group_notes_the_rounds_it_serves_for_mpifl_status(runs):
    """A group's members learn the round from their leader's orders: before, they stayed 'started' in round 0
    however far the run got, and `mpifl status` misreported a killed sharded run."""
    from mpifl.storage.rundir import read_rank_notes

    rounds = yaml.safe_load((runs["sharded, two groups"] / "config.yaml").read_text())["rounds"]
    for name in ("sharded, two groups", "replicated"):
        notes = read_rank_notes(runs[name])
        assert {r: (n["state"], n["round"]) for r, n in notes.items()} == {r: ("finished", rounds) for r in range(5)}


def test_tied_embeddings_shard_and_start_from_the_unsharded_initialisation(tmp_path):
    gpt2 = tuple(f"{k}={v}" for k, v in GPT2.items())
    sharded = final_model(run(tmp_path, "gpt2-fsdp", 3, *gpt2))
    assert_bitwise(sharded, final_model(run(tmp_path, "gpt2-ddp", 3, *gpt2, "clients.sharding=replicate")))


def test_each_ranks_own_dropout_masks_give_bitwise_the_same_model_on_one_or_two_groups(tmp_path):
    """GPT-2's default dropout (0.1): a rank's masks follow the client's seed and its place in the group alone."""
    gpt2 = tuple(f"{k}={v}" for k, v in GPT2.items())
    assert_bitwise(final_model(run(tmp_path, "one", 3, *gpt2)), final_model(run(tmp_path, "two", 5, *gpt2)))


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


def test_killed_with_sigkill_and_resumed_on_another_number_of_groups_it_ends_bitwise_as_run_whole(tmp_path):
    cfg = config(tmp_path)
    run_dir = tmp_path / "killed"
    longer = ("rounds=6", "checkpoint.every=1")
    killed_and_resumed(cfg, run_dir, 3, 5, *longer)  # killed on one group (its own mpiexec), resumed on two
    whole = run(tmp_path, "whole", 3, *longer)
    assert_bitwise(final_model(run_dir), final_model(whole))


SCAFFOLD = ("strategy.name=scaffold", "train.optimizer=sgd", "train.lr=0.05")
FEDDYN = ("strategy.name=feddyn", "strategy.alpha=0.1", "train.optimizer=sgd", "train.lr=0.05")


@pytest.fixture(scope="module")
def stateful(tmp_path_factory) -> dict[str, Path]:
    """Per-client state on sharded clients: SCAFFOLD on one group and on two (c_i on disk), and on a replicated
    group; FedDyn sharded and on one rank per client."""
    tmp = tmp_path_factory.mktemp("sharded-state")
    return {"scaffold, one group": run(tmp, "sc1", 3, *SCAFFOLD),
            "scaffold, two groups, c_i on disk": run(tmp, "sc2", 5, *SCAFFOLD, "strategy.control_ram_mb=0"),
            "scaffold, replicated": run(tmp, "scd", 3, *SCAFFOLD, "clients.sharding=replicate"),
            "feddyn": run(tmp, "fd", 3, *FEDDYN),
            "feddyn, one rank": run(tmp, "fd1", 2, *FEDDYN, "clients.sharding=replicate",
                                    "clients.ranks_per_client=1")}


def test_scaffold_on_sharded_clients_is_bitwise_the_replicated_groups_on_any_number_of_groups(stateful):
    """Each rank keeps c_i over its rows and corrects its rows' steps elementwise as a replicated rank corrects
    whole tensors, so the model and the server's c (the control section, sharded like the parameters) are the
    DDP group's to the bit, with c_i in RAM or on disk."""
    sharded = final_model(stateful["scaffold, one group"])
    controls = [name for name in sharded if name.startswith("scaffold_control.")]
    assert controls and sum(float(np.abs(sharded[name]).sum()) for name in controls) > 0
    assert_bitwise(sharded, final_model(stateful["scaffold, replicated"]))
    assert_bitwise(sharded, final_model(stateful["scaffold, two groups, c_i on disk"]))


def test_every_rank_of_a_sharded_group_keeps_only_its_rows_of_each_clients_c_i(stateful):
    import h5py

    files = sorted((stateful["scaffold, two groups, c_i on disk"] / "controls").glob("rank*.h5"))
    assert len(files) == 4  # every client rank of the two groups of 2
    whole = sum(v.size for name, v in final_model(stateful["scaffold, one group"]).items()
                if name.startswith("scaffold_control."))  # c has one value per trained element, as c_i has
    for path in files:
        with h5py.File(path, "r") as f:
            rows = {f["clients"][c].shape[0] for c in f["clients"]}
        assert rows and whole // 2 <= max(rows) <= whole // 2 + whole // 100  # about half of every c_i


def test_feddyn_on_sharded_clients_is_within_rounding_of_one_rank_per_client(stateful):
    """The regulariser joins the rows of the gradient FSDP reduce-scattered, not each share's gradient as under
    DDP: the same sum, rounded in another order."""
    sharded = final_model(stateful["feddyn"])
    assert relative_l2(sharded, final_model(stateful["feddyn, one rank"])) < TOLERANCE


def test_sharded_lora_with_scaffold_in_bf16_killed_and_resumed_on_another_number_of_groups_ends_bitwise(tmp_path):
    """The causal_lm trainer steps fp32 masters of the bf16 adapters, which SCAFFOLD corrects; each rank's c_i
    rows come back from the checkpoint's files of its index in its group, whichever group wrote them."""
    cfg = config(tmp_path)
    run_dir = tmp_path / "killed"
    longer = (*LORA, *SCAFFOLD, "rounds=5", "checkpoint.every=1")
    resumed = killed_and_resumed(cfg, run_dir, 5, 3, *longer)
    assert "resume: SCAFFOLD control variates of 4 of its 4 clients" in resumed.stderr
    whole = final_model(run(tmp_path, "whole", 3, *longer))
    assert any(name.startswith("scaffold_control.") for name in whole)
    assert_bitwise(final_model(run_dir), whole)


def test_ditto_on_sharded_clients_keeps_each_personal_model_over_the_ranks_rows_and_leaves_w_untouched(tmp_path, runs):
    """Each rank trains v_i's rows with lambda (v - w) added to its rows of every gradient and keeps them; the
    shard then holds w again, so the global model is the plain sharded run's to the bit, and v_i, made whole from
    the ranks' files, is within rounding of one rank per client's."""
    from results import client_vectors, sharded_client_vectors

    from mpifl.learning.models import model_spec

    ditto = ("train.ditto_lambda=0.5", "checkpoint.every=1")
    sharded = run(tmp_path, "ditto-fsdp", 3, *ditto)
    assert_bitwise(final_model(sharded), final_model(runs["sharded, one group"]))
    single = client_vectors(run(tmp_path, "ditto-one", 2, *ditto, "clients.sharding=replicate",
                                "clients.ranks_per_client=1"))
    cfg = load_config(config(tmp_path), list(ditto))
    shapes = [tuple(e.shape) for e in model_spec(cfg.model, cfg.seed)[0].entries]
    whole = sharded_client_vectors(sharded, shapes)
    assert sorted(whole) == sorted(single) == [0, 1, 2, 3]
    for client, personal in whole.items():
        assert relative_l2({"v": personal}, {"v": single[client]}) < TOLERANCE
    # `mpifl export --client` joins a client's rows from its group's rank files: its personal model, bitwise
    last = sorted((sharded / "checkpoints").glob("ckpt-r*.h5"))[-1]
    out = tmp_path / "client2.safetensors"
    done = mpifl_here("export", str(last), str(out), "--client", "2")
    assert done.returncode == 0, done.stderr
    exported = safetensors_numpy.load_file(str(out))
    names = [e.name for e in model_spec(cfg.model, cfg.seed)[0].entries]
    assert list(exported) == names or sorted(exported) == sorted(names)
    joined = np.concatenate([exported[name].reshape(-1) for name in names])
    assert np.array_equal(joined, whole[2].astype(joined.dtype))


def rows_by_checkpoint(run_dir: Path, client: int) -> dict[int, list[np.ndarray]]:
    """``client``'s per-client vector in each checkpoint of a sharded run, by round: every rank's rows, rank by rank."""
    import h5py

    out = {}
    for folder in sorted((run_dir / "checkpoints").glob("ckpt-r*.residuals")):
        rows = []
        for path in sorted(folder.glob("rank*.h5")):
            with h5py.File(path, "r") as f:
                rows.append(f["clients"][str(client)][()])
        out[int(folder.name.removeprefix("ckpt-r").split(".")[0])] = rows
    return out


@pytest.mark.parametrize("state", ["scaffold", "feddyn", "ditto"])
def test_a_sharded_client_whose_update_is_refused_as_non_finite_keeps_its_vector_as_before_the_round(tmp_path,
                                                                                                    state):
    """A ``nan`` fault puts a NaN in client 1's round-2 update, past its SCAFFOLD c_i or FedDyn g_i (kept over every
    rank's rows before the update is checked) and its Ditto v_i (trained before the global model): the group refuses
    the update, and on every rank of the group the client's c_i or g_i is put back (the leader relays the server's
    note of the refused client), and its v_i is never kept, so each ends round 2 bitwise as it ended round 1, as if
    never sampled; the other clients' vectors moved on."""
    import json

    kind = {"scaffold": SCAFFOLD, "feddyn": FEDDYN, "ditto": ("train.ditto_lambda=0.5",)}[state]
    result = run_mpi(3, "run", str(config(tmp_path)), "--run-dir", str(tmp_path / "run"), *kind, "checkpoint.every=1",
                     "checkpoint.keep=5", "clients.accept_failures=true",
                     "faults=[{kind: nan, clients: [1], rounds: [2]}]")
    assert result.returncode == 0, result.stderr[-3000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [[d["client"] for d in r["dropped"]] for r in history] == [[], [1]]
    assert "put there by faults[0] ('nan')" in history[1]["dropped"][0]["reason"]
    if state != "ditto":
        assert "logical client 1 was dropped from the round it trained" in result.stderr
    refused, other = rows_by_checkpoint(tmp_path / "run", 1), rows_by_checkpoint(tmp_path / "run", 2)
    assert sorted(refused) == [1, 2] and len(refused[2]) == 2  # both rounds' checkpoints, a file per rank
    for before, after in zip(refused[1], refused[2]):
        assert_bitwise({"rows": after}, {"rows": before})
    assert all(not np.array_equal(a, b) for a, b in zip(other[1], other[2]))


def test_compressed_updates_from_sharded_clients_are_bitwise_the_replicated_groups(tmp_path):
    """The leader widens every rank's pieces of a chunk, encodes the chunk as an unsharded client does (the same
    quantization noise by element) and sends it; nothing else changes on the wire."""
    int8 = ("compression.method=int8",)
    assert_bitwise(final_model(run(tmp_path, "int8-fsdp", 5, *int8)),
                   final_model(run(tmp_path, "int8-ddp", 3, *int8, "clients.sharding=replicate")))


def test_top_k_error_feedback_kept_by_every_rank_over_its_pieces_resumes_bitwise_on_another_number_of_groups(
        tmp_path):
    """Each rank adds its rows of the client's residual before the leader selects the top-k of the chunk; what
    was not sent goes back to the ranks that own it. Killed with SIGKILL on two groups and resumed on one, the run
    ends bitwise as the replicated group's uninterrupted run."""
    cfg = config(tmp_path)
    run_dir = tmp_path / "killed"
    topk = ("compression.method=topk", "compression.fraction=0.05", "compression.error_feedback=true", "rounds=5",
            "checkpoint.every=1")
    resumed = killed_and_resumed(cfg, run_dir, 5, 3, *topk)
    assert "resume: error-feedback residuals of 4 of its 4 clients" in resumed.stderr
    assert_bitwise(final_model(run_dir), final_model(run(tmp_path, "ddp", 3, *topk, "clients.sharding=replicate")))


@pytest.mark.parametrize(("override", "key"), [
    ("clients.ranks_per_client=1", "clients.ranks_per_client"),
    ("model.local=[model.norm.weight]", "per-client state"),
    ("strategy.name=scaffold clients.placement=per_round", "clients.placement"),
    ("clients.groups=2", "clients.groups"),
    ("train.ditto_lambda=0.1 compression.method=int8", "train.ditto_lambda"),
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


# Every kind of fault that strikes a client, each on a client sampled in its round (all 4 are, each round)
SHARDED_FAULTS = ("faults=[{kind: raise, clients: [1], rounds: [1]}, {kind: nan, clients: [0], rounds: [2]}, "
                  "{kind: lose, clients: [2], stage: send, rounds: [2]}, {kind: scale, clients: [3], factor: -1}, "
                  "{kind: corrupt, clients: [1], bits: 6, rounds: [2]}, "
                  "{kind: slowdown, clients: [3], factor: 1.5, rounds: [1]}, "
                  "{kind: stall, clients: [3], seconds: 0.2, stage: send, rounds: [2]}, "
                  "{kind: stall, clients: [2], seconds: 0.1, stage: receive, rounds: [1]}]")


def test_a_sharded_group_takes_the_configs_faults_through_its_leader_bitwise_as_a_replicated_group(tmp_path):
    """The leader does every strike on its group's clients and tells the members what they need in each step: a
    ``raise`` before training (no rank of the group trains the client) and a lost update are every rank's refusal,
    a ``nan`` is found by the group's check, a ``scale`` is each rank's on its rows, a corruption flips the bits of
    the gathered chunks as they leave; stalls and a slowdown only delay. Under accept_failures the same clients are
    dropped or folded with the same reasons as in a replicated group, and the model ends bitwise the same."""
    import json

    faulted = ("clients.accept_failures=true", SHARDED_FAULTS, *SCAFFOLD)  # c_i reads the scaled model, as unsharded
    sharded, replicated = run(tmp_path, "fsdp", 3, *faulted), run(tmp_path, "ddp", 3, *faulted,
                                                                  "clients.sharding=replicate")
    assert_bitwise(final_model(sharded), final_model(replicated))

    def records(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def outcomes(run_dir: Path) -> list[list[tuple]]:
        return [sorted((f["kind"], f["client"], f["outcome"], f.get("reason", "")) for f in r.get("faults", []))
                for r in records(run_dir)]

    assert outcomes(sharded) == outcomes(replicated)
    assert [[(k, c, o) for k, c, o, _ in round_] for round_ in outcomes(sharded)] == [
        [("raise", 1, "dropped"), ("scale", 3, "folded"), ("slowdown", 3, "folded"), ("stall", 2, "folded")],
        [("corrupt", 1, "folded"), ("lose", 2, "dropped"), ("nan", 0, "dropped"), ("scale", 3, "folded"),
         ("stall", 3, "folded")]]
    assert [sorted(d["client"] for d in r["dropped"]) for r in records(sharded)] == [[1], [0, 2]]


def test_an_injected_raise_in_a_sharded_group_ends_the_job_without_accept_failures_naming_the_client(tmp_path):
    result = run_mpi(3, "run", str(config(tmp_path)), "--run-dir", str(tmp_path / "run"), "rounds=1",
                     "faults=[{kind: raise, clients: [1]}]")
    assert result.returncode != 0
    assert ("logical client 1, trained by the sharded group of rank 1, failed: InjectedFault: faults[0]: an injected "
            "exception in round 1 (clients.accept_failures=false)") in result.stderr, result.stderr[-3000:]
