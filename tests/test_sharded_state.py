"""Per-client state on sharded clients (``clients.sharding: fsdp``), one rank's part: the hooks act on the rows a rank
holds and on the fp32 masters the causal_lm trainer steps; a client diverged on any rank of its group keeps its
vector on every one; a rank's checkpoint file is read back only by the rank of the same index in its group; the
server control section keeps only this rank's rows; and ``mpifl plan`` puts 1/R of each vector on every rank."""
from __future__ import annotations

from pathlib import Path

import h5py
import pytest
import torch
from torch import nn

from mpifl.algorithms.contract import ShardRows
from mpifl.algorithms.feddyn import ShardDynamics
from mpifl.algorithms.scaffold import ShardControls, control_delta
from mpifl.learning.sharding import shard_buffers
from mpifl.learning.steps import corrected_steps, regularized_gradients, regularized_shard_gradients
from mpifl.learning.trainers import master_copy
from mpifl.storage.residuals import RamResiduals, UndoJournal, load_snapshot, save_snapshot


def rows_of_one_rank(weights: list[torch.Tensor], anchors: list[torch.Tensor], streams: list[torch.Tensor],
                     agree: bool = True) -> ShardRows:
    """A rank's view for a client half, on plain tensors (a rank's rows of an FSDP parameter behave alike)."""
    params = [nn.Parameter(w.clone()) for w in weights]
    return ShardRows(params, params, anchors, streams, torch.device("cpu"), lambda mine: mine and agree)


def test_a_master_copy_is_corrected_in_place_of_the_narrow_parameter_it_stands_for():
    """The causal_lm trainer steps fp32 masters of bf16 weights and copies them back: SCAFFOLD's correction must
    land on the master, or the copy back would erase it."""
    weight = nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.bfloat16))
    master = master_copy(weight)
    optimizer = torch.optim.SGD([master], lr=0.5)
    with corrected_steps([weight], [torch.tensor([0.5, 2.0])]):
        master.grad = torch.ones(2)
        optimizer.step()
    assert torch.equal(master.detach(), torch.tensor([1.0 - 0.5 - 0.25, -1.0 - 0.5 - 1.0]))
    assert torch.equal(weight.detach(), torch.tensor([1.0, -1.0], dtype=torch.bfloat16))  # copied back by the trainer


def test_the_sharded_regulariser_adds_to_the_accumulated_gradient_what_the_whole_model_one_adds():
    """FSDP calls post-accumulate-grad hooks once it has reduce-scattered a gradient into a sharded parameter; on a
    plain parameter the hook fires once its gradient is accumulated: the same term either way."""
    x, g = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.1, -0.2, 0.3])
    sharded, whole = nn.Parameter(torch.tensor([1.0, 2.0, 3.0])), nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    with regularized_shard_gradients([sharded], [x], [g], alpha=0.5, backwards_per_step=2):
        for _ in range(2):
            (sharded * sharded).sum().div(2).backward()
    with regularized_gradients([whole], [x], [g], alpha=0.5, backwards_per_step=2):
        for _ in range(2):
            (whole * whole).sum().div(2).backward()
    assert sharded.grad is not None and whole.grad is not None
    assert torch.allclose(sharded.grad, whole.grad)
    assert torch.allclose(sharded.grad, 2 * sharded.detach() + 0.5 * (sharded.detach() - x) - g)


def test_scaffold_on_a_ranks_rows_keeps_c_i_and_sends_the_control_delta_over_its_weight():
    x, c = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.25, -0.25]])
    rows = rows_of_one_rank([torch.tensor([[0.5, 2.5]])], [x], [c.clone()])
    half = ShardControls(rows, RamResiduals([0, 2]), lr=0.1)
    half.update(3, steps=5, weight=2.0)
    delta = control_delta(x.flatten(), torch.tensor([0.5, 2.5]), c.flatten(), 5, 0.1)
    assert torch.equal(half.store.read(3, 0), delta)  # c_i = 0 + delta
    assert torch.equal(rows.streams[0].flatten(), c.flatten() + delta / 2.0)  # what the update carries


def test_a_client_diverged_on_any_rank_of_its_group_keeps_its_c_i_on_every_rank():
    store = RamResiduals([0, 2])
    rows = rows_of_one_rank([torch.tensor([0.5, 2.5])], [torch.tensor([1.0, 2.0])], [torch.zeros(2)], agree=False)
    ShardControls(rows, store, lr=0.1).update(3, steps=5, weight=1.0)  # finite here, not on another rank
    assert not store.has(3) or torch.equal(store.read(3, 0), torch.zeros(2))
    assert torch.equal(rows.streams[0], torch.zeros(2))


def test_feddyn_on_a_ranks_rows_subtracts_alpha_times_its_move():
    rows = rows_of_one_rank([torch.tensor([1.5, 1.0])], [torch.tensor([1.0, 2.0])], [])
    half = ShardDynamics(rows, RamResiduals([0, 2]), alpha=0.5)
    half.update(0, steps=1, weight=1.0)
    assert torch.equal(half.store.read(0, 0), torch.tensor([-0.25, 0.5]))


def test_a_checkpoint_file_is_read_back_only_by_the_rank_of_the_same_index_in_its_group(tmp_path: Path):
    for shard, value in ((0, 1.0), (1, 2.0)):
        store = RamResiduals([0, 3])
        store.write(7, 0, torch.full((3,), value))
        save_snapshot(store, store.firsts, tmp_path, rank=1 + shard, round_=4, shard=(shard, 2))
    files = sorted(tmp_path.glob("rank*.h5"))
    for shard, value in ((0, 1.0), (1, 2.0)):
        back = RamResiduals([0, 3])
        assert load_snapshot(back, back.firsts, files, hosted=[7], shard=(shard, 2)) == 1
        assert torch.equal(back.read(7, 0), torch.full((3,), value))
    with h5py.File(files[0], "r") as f:
        assert (int(f.attrs["shard"]), int(f.attrs["shards"])) == (0, 2)
    with pytest.raises(ValueError, match="over 2 shard"):
        load_snapshot(RamResiduals([0, 3]), [0, 3], files, hosted=[7], shard=(0, 4))


def test_the_put_back_of_a_dropped_client_restores_a_ranks_rows():
    store = RamResiduals([0, 2])
    journal = UndoJournal(store)
    rows = rows_of_one_rank([torch.tensor([0.5, 2.5])], [torch.tensor([1.0, 2.0])], [torch.zeros(2)])
    ShardControls(rows, journal, lr=0.1).update(3, steps=5, weight=1.0)
    assert store.read(3, 0).abs().sum() > 0
    assert journal.settle([3]) == [3]
    assert torch.equal(store.read(3, 0), torch.zeros(2))


def test_a_summed_stream_buffer_keeps_this_ranks_rows_as_fsdp_splits_a_parameter():
    def model() -> nn.Module:
        built = nn.Module()
        built.add_module("streams", nn.Module())
        built.streams.register_buffer("c", torch.zeros(5, 3, device="meta"))
        built.streams.register_buffer("scalar", torch.zeros((), device="meta"))
        return built

    first, second = model(), model()
    assert shard_buffers(first, "streams", 2, 0) == ["streams.c"] and first.streams.c.shape == (3, 3)
    assert shard_buffers(second, "streams", 2, 1) == ["streams.c"] and second.streams.c.shape == (2, 3)
    assert first.streams.scalar.shape == ()  # a 0-d buffer stays whole (torch.chunk: ceil(5 / 2) rows, then 2)


def test_the_plan_puts_one_rth_of_each_clients_vector_on_every_rank_of_a_sharded_group():
    from mpifl.config import load_config
    from mpifl.planning.memory import ModelBytes, client_state_elements, client_state_plan

    base = ["model.name=transformers", "train.trainer=causal_lm", "strategy.name=scaffold", "clients.num_clients=8",
            "clients.ranks_per_client=2", "data.dataset=text", "model.transformers.architecture=gpt2"]
    size = ModelBytes(exchanged=8_000_000, frozen=0, parameters=1_000_000, control=4_000_000, trainable=1_000_000)
    sharded = load_config(None, [*base, "clients.sharding=fsdp"])
    replicated = load_config(None, [*base, "clients.sharding=replicate"])
    assert client_state_elements(sharded, size) == client_state_elements(replicated, size) // 2
    assert client_state_plan(sharded, 500_000, 4) == [([1, 2, 3, 4], 4, "RAM")]
    assert client_state_plan(replicated, 1_000_000, 4) == [([1, 3], 4, "RAM")]
