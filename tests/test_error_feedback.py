"""Top-k with error feedback, in process: what a client sent plus what it kept is what it had to send,
residuals in RAM and in HDF5 are bitwise the same, checkpoints carry them by client id, and a
checkpoint without its residuals is never resumed from."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mpifl.config import ConfigError, load_config
from mpifl.roles.encoding import UpdateCompressor
from mpifl.storage.checkpointer import (
    WITHHELD,
    latest_checkpoint,
    prune_checkpoints,
    residuals_dir,
    withheld_ranks,
)
from mpifl.storage.hdf5 import CheckpointWriter
from mpifl.storage.residuals import DiskResiduals, RamResiduals, load_snapshot, open_residuals, save_snapshot
from mpifl.wire.codecs import TopK
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import element_offsets, layout

SPEC = layout([("a", (300,), "float32"), ("b", (7, 9), "float32")])
CHUNKS = SPEC.chunks(4 * 128)  # 128, 128, 44 and 63 elements: several chunks, uneven


def plan(fraction: float = 0.1) -> ExchangeLayout:
    codec = TopK(fraction)
    return ExchangeLayout(SPEC, CHUNKS, codec.wire_chunks(CHUNKS), 1, 4 * 128, codec=codec)


def deltas(seed: int, integers: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-50, 51, (c.numel,), generator=g).float() if integers else torch.randn(c.numel, generator=g)
            for c in CHUNKS]


def sent(p: ExchangeLayout, buffers) -> torch.Tensor:
    return torch.cat([p.codec.decode(b, c.numel, torch.empty(c.numel)) for c, b in zip(CHUNKS, buffers)])


def residual(store, client: int) -> torch.Tensor:
    return torch.cat([store.read(client, i).clone() for i in range(len(CHUNKS))])


def run_rounds(store, rounds: int = 6, integers: bool = False, bound: float | None = None, clients=(3, 5)):
    """Compress each client's deltas every round; the wire bytes, what the server decodes, and each client's sums."""
    p = plan()
    compressor = UpdateCompressor(p, seed=0, residuals=store)
    wire, total_sent, total_delta = [], {}, {}
    for r in range(1, rounds + 1):
        for client in clients:
            update = deltas(100 * r + client, integers)
            buffers = compressor.compress([d.clone() for d in update], r, client, bound)
            wire.append(np.concatenate(buffers).copy())
            decoded = sent(p, buffers)
            total_sent[client] = total_sent.get(client, 0) + decoded.double()
            total_delta[client] = total_delta.get(client, 0) + torch.cat(update).double()
    return wire, total_sent, total_delta


def test_what_was_sent_plus_the_residual_is_exactly_the_sum_of_the_deltas_when_sums_are_exact():
    """Integer deltas add exactly in fp32: the error-feedback identity then holds bit for bit."""
    store = RamResiduals(element_offsets(CHUNKS))
    _, total_sent, total_delta = run_rounds(store, integers=True)
    for client in (3, 5):
        assert torch.equal(total_sent[client] + residual(store, client).double(), total_delta[client])


def test_with_real_valued_deltas_the_identity_holds_to_fp32_rounding_of_each_delta_plus_residual():
    store = RamResiduals(element_offsets(CHUNKS))
    _, total_sent, total_delta = run_rounds(store)
    for client in (3, 5):
        gap = (total_sent[client] + residual(store, client).double() - total_delta[client]).abs()
        assert float(gap.max()) < 6 * 2 ** -23 * float(total_delta[client].abs().max() + 10)  # a few ulps a round


def test_a_dp_bound_holds_for_what_is_sent_and_the_clipped_part_stays_in_the_residual():
    store = RamResiduals(element_offsets(CHUNKS))
    p = plan()
    compressor = UpdateCompressor(p, seed=0, residuals=store)
    update = deltas(1, integers=True)
    buffers = compressor.compress([d.clone() for d in update], 1, 0, bound=10.0)
    decoded = sent(p, buffers)
    assert float(decoded.norm()) <= 10.0 * (1 + 1e-6)
    gap = decoded + residual(store, 0) - torch.cat(update)
    assert float(gap.abs().max()) <= 1e-5 * float(torch.cat(update).abs().max())


def test_residuals_in_ram_and_in_hdf5_give_bitwise_identical_bytes_and_residuals(tmp_path):
    ram = RamResiduals(element_offsets(CHUNKS))
    disk = DiskResiduals(element_offsets(CHUNKS), tmp_path / "rank00001.h5")
    for bound in (None, 5.0):
        wire_ram, _, _ = run_rounds(ram, rounds=4, bound=bound)
        wire_disk, _, _ = run_rounds(disk, rounds=4, bound=bound)
        assert all(np.array_equal(a, b) for a, b in zip(wire_ram, wire_disk))
    assert disk.clients() == ram.clients() == [3, 5]
    for client in (3, 5):
        assert torch.equal(residual(ram, client), residual(disk, client))
    disk.close()


def test_a_failed_clients_update_leaves_the_residual_as_it_was():
    store = RamResiduals(element_offsets(CHUNKS))
    compressor = UpdateCompressor(plan(), seed=0, residuals=store)
    compressor.compress(deltas(1, False), 1, 4, None)
    before = residual(store, 4)
    compressor.compress(deltas(2, False), 2, 4, None, usable=False)
    assert torch.equal(residual(store, 4), before)


def test_the_store_is_in_ram_while_hosted_clients_fit_else_on_disk(tmp_path):
    firsts = element_offsets(CHUNKS)  # 363 elements: 1452 bytes a client
    assert isinstance(open_residuals(firsts, 3, 3 * 1452, tmp_path / "r.h5"), RamResiduals)
    assert isinstance(open_residuals(firsts, 3, 3 * 1452 - 1, tmp_path / "r.h5"), DiskResiduals)
    with pytest.raises(ValueError, match="compression.residual_ram_mb"):
        open_residuals(firsts, 3, 0, None)


def test_a_snapshot_is_read_by_client_id_whatever_rank_wrote_it(tmp_path):
    firsts = element_offsets(CHUNKS)
    ranks = {1: RamResiduals(firsts), 2: RamResiduals(firsts)}  # two client ranks at the checkpoint
    run_rounds(ranks[1], rounds=2, clients=(0, 2))
    run_rounds(ranks[2], rounds=2, clients=(1,))
    files = [tmp_path / save_snapshot(store, firsts, tmp_path, rank, 2) for rank, store in ranks.items()]
    resumed = DiskResiduals(firsts, tmp_path / "work" / "rank00001.h5")  # one client rank after the resume
    assert load_snapshot(resumed, firsts, files, hosted=[0, 1, 2, 3]) == 3
    assert resumed.clients() == [0, 1, 2]  # client 3 was never sampled: no residual, zeros
    for client, store in ((0, ranks[1]), (1, ranks[2]), (2, ranks[1])):
        assert torch.equal(residual(resumed, client), residual(store, client))
    assert torch.equal(residual(resumed, 3), torch.zeros(firsts[-1]))


def publish(directory, round_: int, residual_files: list[str] | None, **extra: str):
    attrs = {"round": round_, **extra}
    if residual_files is not None:
        attrs["residual_files"] = json.dumps(residual_files)
        residuals_dir(directory / f"ckpt-r{round_:06d}.h5").mkdir(parents=True, exist_ok=True)
        for name in residual_files:
            (residuals_dir(directory / f"ckpt-r{round_:06d}.h5") / name).write_bytes(b"x")
    with CheckpointWriter(directory / f"ckpt-r{round_:06d}.h5", SPEC, attrs) as writer:
        writer.write_range(0, np.zeros(SPEC.total_bytes, dtype=np.uint8))
        writer.write_metrics([])
        return writer.publish()


def test_a_checkpoint_whose_residuals_are_missing_is_skipped_for_the_one_before(tmp_path, capsys):
    publish(tmp_path, 1, ["rank00001.h5", "rank00002.h5"])
    newest = publish(tmp_path, 2, ["rank00001.h5", "rank00002.h5"])
    (residuals_dir(newest) / "rank00002.h5").unlink()  # killed before every rank published
    with latest_checkpoint(tmp_path, feedback=True) as ckpt:
        assert ckpt.round == 1
    assert "skipping incomplete checkpoint" in capsys.readouterr().err
    with latest_checkpoint(tmp_path) as ckpt:  # without error feedback, residuals are not needed
        assert ckpt.round == 2


def test_a_checkpoint_saved_while_a_rank_was_silent_resumes_no_longer_run_but_still_ends_a_complete_one(tmp_path,
                                                                                                      capsys):
    publish(tmp_path, 1, ["rank00001.h5", "rank00002.h5"])
    publish(tmp_path, 2, ["rank00001.h5"], **{WITHHELD: "[2]"})  # rank 2 silent as the last round was saved
    with latest_checkpoint(tmp_path, feedback=True, rounds=3) as ckpt:  # a longer run: the state is needed
        assert ckpt.round == 1
        assert "rank 2 stayed silent past timeouts.first_update" in capsys.readouterr().err
    with latest_checkpoint(tmp_path, feedback=True, rounds=2) as ckpt:  # the run is complete there: nothing to train
        assert ckpt.round == 2 and withheld_ranks(ckpt) == [2]


def test_pruning_removes_a_checkpoints_residuals_with_it(tmp_path):
    for r in (1, 2, 3):
        publish(tmp_path, r, ["rank00001.h5"])
    (tmp_path / "ckpt-r000000.residuals").mkdir()  # an orphan left by a crash between the two phases
    (tmp_path / "ckpt-r000004.residuals").mkdir()  # the next checkpoint's, being written
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-r000002.h5", "ckpt-r000002.residuals", "ckpt-r000003.h5", "ckpt-r000003.residuals",
        "ckpt-r000004.residuals"]


FEDBUFF = {"mode": "fedbuff", "concurrency": 8}


def topk(**compression):
    return {"strategy": {"update": "delta"}, "compression": {"method": "topk", **compression}}


@pytest.mark.parametrize("data,message", [
    (topk(fraction=0), r"compression.fraction: must be > 0.0, got 0"),
    (topk(fraction=1.5), r"compression.fraction: must be <= 1.0, got 1.5"),
    (topk(residual_ram_mb=-1), r"compression.residual_ram_mb: must be >= 0.0"),
    ({"strategy": {"update": "weights"}, "compression": {"method": "topk"}},
     r"strategy.update: compression.method 'topk' needs 'delta'"),
    ({**topk(), "clock": FEDBUFF}, r"clock.mode: compression.method 'topk' needs 'off' or 'sync' with "
                                   r"compression.error_feedback"),
    (topk(method="top_k"), r"compression.method: 'top_k' is not allowed; choose one of .*'topk'"),
])
def test_bad_topk_settings_are_refused_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, data=data)


def test_topk_defaults_one_percent_with_error_feedback_in_ram_up_to_1_gib():
    cfg = load_config(None, data=topk()).compression
    assert (cfg.fraction, cfg.error_feedback, cfg.residual_ram_mb) == (0.01, True, 1024.0)
    load_config(None, data={**topk(error_feedback=False), "clock": FEDBUFF})  # no residuals: fine


def test_mpifl_plan_puts_each_client_ranks_residuals_in_ram_or_on_disk():
    from mpifl.planning.memory import client_state_plan

    cfg = load_config(None, data={**topk(residual_ram_mb=1.0), "clients": {"num_clients": 5}})
    elements = 2 ** 17  # 0.5 MiB of fp32 a client: two fit in 1 MiB, three do not
    assert client_state_plan(cfg, elements, 2) == [([1], 3, "HDF5"), ([2], 2, "RAM")]
    assert client_state_plan(load_config(None, data=topk(error_feedback=False)), elements, 2) == []
