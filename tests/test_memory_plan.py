"""The memory model's node arithmetic: nodes filled in rank order as the launchers do, and advice that fits."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import ROOT, mpifl_here, run_mpi, write_config

from mpifl.cli.plan import clients_beside_server, estimate, gpu_warning, node_warning, ranks_per_gpu
from mpifl.config import load_config
from mpifl.planning.memory import (
    CONV_KERNELS_BYTES,
    CONV_OUTPUT_COPIES,
    IMPORTS_BYTES,
    TABLE_READER_BYTES,
    TRAINING_RUNTIME_BYTES,
    DataBytes,
    MemoryEstimate,
    client_data_bytes,
    client_state_plan,
    fullest_node,
    mapped_inputs_bytes,
    node_data_bytes,
    reading_rank_bytes,
    server_data_bytes,
)
from mpifl.units import MIB, format_bytes

GIB = 2**30


def test_the_fullest_node_counts_only_the_ranks_the_launcher_puts_there():
    # 70B out of core: a server of ~1 GiB and 4 clients of 132 GiB, 4 ranks per node: the server and three
    # clients share node 1, the fourth client is alone on node 2 (not 4 x 132 GiB)
    assert fullest_node(1 * GIB, 132 * GIB, nranks=5, ranks_per_node=4, server_alone=False) == 397 * GIB
    assert fullest_node(1 * GIB, 132 * GIB, nranks=5, ranks_per_node=4, server_alone=True) == 4 * 132 * GIB
    assert fullest_node(9 * GIB, 1 * GIB, nranks=3, ranks_per_node=4, server_alone=False) == 11 * GIB
    assert fullest_node(2 * GIB, 3 * GIB, nranks=9, ranks_per_node=4, server_alone=False) == 12 * GIB


def test_the_node_warning_gives_only_advice_the_config_does_not_already_follow():
    plan = MemoryEstimate(model_bytes=GIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB,
                          node_bytes=600 * GIB)
    on_disk = node_warning(load_config(None, ["server.state=disk", "eval.every=0"]), plan, 512, server_alone=True)
    assert on_disk is not None and "server.state=disk" not in on_disk and "--server-alone" not in on_disk
    in_memory = node_warning(load_config(None), plan, 512, server_alone=False)
    assert in_memory is not None and "server.state=disk" in in_memory and "--server-alone" in in_memory
    assert node_warning(load_config(None), plan, 1024, server_alone=False) is None
    assert node_warning(load_config(None), plan, None, server_alone=False) is None


def test_client_ranks_share_a_gpu_when_a_node_has_fewer_gpus_than_ranks():
    assert ranks_per_gpu(ranks_per_node=4, gpus_per_node=4, client_ranks=8) == 1
    assert ranks_per_gpu(ranks_per_node=4, gpus_per_node=1, client_ranks=8) == 4
    assert ranks_per_gpu(ranks_per_node=4, gpus_per_node=1, client_ranks=2) == 2  # only two ranks to place
    assert ranks_per_gpu(ranks_per_node=4, gpus_per_node=3, client_ranks=8) == 2
    assert ranks_per_gpu(ranks_per_node=4, gpus_per_node=0, client_ranks=8) == 0  # CPU only


def test_the_gpu_warning_counts_every_rank_on_the_fullest_gpu_and_gives_advice_that_fits():
    plan = MemoryEstimate(model_bytes=GIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB,
                          node_bytes=4 * GIB, client_device_bytes=12 * GIB)
    adam = load_config(None, ["train.optimizer=adam"])
    assert gpu_warning(adam, plan, 40.0) is None
    shared = gpu_warning(adam, plan, 40.0, sharing=4)  # four ranks x 12 GiB on one 40 GB GPU
    assert shared is not None and "4 client ranks x ~12.00 GiB" in shared
    assert "a GPU of its own" in shared and "train.optimizer" in shared and "model.dtype" in shared
    alone = gpu_warning(adam, plan, 12.0)
    assert alone is not None and "a GPU of its own" not in alone
    bf16_sgd = gpu_warning(load_config(None, ["model.dtype=bfloat16", "train.optimizer=sgd"]), plan, 12.0)
    assert bf16_sgd is not None and "model.dtype" not in bf16_sgd and "train.optimizer" not in bf16_sgd
    assert gpu_warning(adam, plan, None, sharing=4) is None  # no GPU size given
    on_cpu = MemoryEstimate(model_bytes=GIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB, node_bytes=GIB)
    assert gpu_warning(adam, on_cpu, 1.0, sharing=4) is None


def test_the_server_shares_its_gpu_with_every_local_rank_that_is_a_multiple_of_the_gpu_count():
    assert clients_beside_server(ranks_per_node=4, gpus_per_node=4, nranks=9, server_alone=False) == 0
    assert clients_beside_server(ranks_per_node=4, gpus_per_node=1, nranks=9, server_alone=False) == 3
    assert clients_beside_server(ranks_per_node=4, gpus_per_node=2, nranks=9, server_alone=False) == 1
    assert clients_beside_server(ranks_per_node=4, gpus_per_node=1, nranks=3, server_alone=False) == 2
    assert clients_beside_server(ranks_per_node=4, gpus_per_node=1, nranks=9, server_alone=True) == 0


def test_the_gpu_warning_names_the_servers_gpu_when_its_evaluation_copy_makes_it_the_fullest():
    plan = MemoryEstimate(model_bytes=GIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB,
                          node_bytes=4 * GIB, client_device_bytes=10 * GIB, server_device_bytes=8 * GIB)
    cfg = load_config(None, ["eval.device=cuda"])
    crowded = gpu_warning(cfg, plan, 30.0, sharing=2, beside_server=1)  # 8 + 10 on the server's GPU, 20 elsewhere
    assert crowded is None
    crowded = gpu_warning(cfg, plan, 19.5, sharing=1, beside_server=1)  # 18 GiB > 90% of 19.5
    assert crowded is not None and "the server's GPU holds ~18.00 GiB" in crowded
    assert "eval.device=cpu" in crowded and "--server-alone" in crowded
    alone = gpu_warning(cfg, plan, 8.5, sharing=1, beside_server=0)  # clients' 10 GiB is the fullest
    assert alone is not None and "a client rank's ~10.00 GiB" in alone and "eval.device" not in alone


def test_per_client_state_lives_on_the_group_leaders_when_a_client_spans_ranks():
    cfg = load_config(None, ["model.local=['*.bias']", "clients.num_clients=8", "clients.ranks_per_client=2"])
    assert client_state_plan(cfg, elements=100, client_ranks=8) == [([1, 3, 5, 7], 2, "RAM")]
    single = load_config(None, ["model.local=['*.bias']", "clients.num_clients=8"])
    assert client_state_plan(single, elements=100, client_ranks=8) == [([1, 2, 3, 4, 5, 6, 7, 8], 1, "RAM")]


def test_a_group_leaders_memory_counts_the_clients_it_hosts_once_whatever_ranks_per_client():
    """64 SCAFFOLD clients on 8 client ranks in groups of 2: 4 leaders host 16 clients each. The leader's figure
    holds 16 control variates in RAM, as the printed row says, and the RAM/HDF5 choice is the row's."""
    from mpifl.planning.memory import ModelBytes, client_bytes, client_state_elements

    size = ModelBytes(exchanged=4 * MIB, frozen=0, parameters=2**20, control=4 * MIB)
    def scaffold(ram_mb: float):
        return load_config(None, data={"strategy": {"name": "scaffold", "update": "delta", "control_ram_mb": ram_mb},
                                       "clients": {"num_clients": 64, "ranks_per_client": 2}})
    elements = client_state_elements(scaffold(100), size)
    vector = 4 * elements
    assert client_state_plan(scaffold(100), elements, client_ranks=8) == [([1, 3, 5, 7], 16, "RAM")]
    in_ram, on_disk = client_bytes(scaffold(100), size, 4), client_bytes(scaffold(0), size, 4)  # 4 groups
    assert in_ram - on_disk == 16 * vector
    between = 24 * vector / MIB  # room for 16 vectors and not for 32: RAM, as the row says
    assert client_state_plan(scaffold(between), elements, client_ranks=8)[0][2] == "RAM"
    assert client_bytes(scaffold(between), size, 4) == in_ram


def test_the_server_holds_labels_and_the_held_out_set_never_the_training_inputs():
    data = DataBytes(inputs=800 * MIB, labels=8 * MIB, test=100 * MIB, per_rank=False)
    assert server_data_bytes(data) == 108 * MIB


def test_a_node_holds_the_shared_set_once_and_a_client_rank_its_clients_pages_and_copies_or_a_sources_rows():
    shared = DataBytes(inputs=800 * MIB, labels=8 * MIB, test=100 * MIB, per_rank=False)
    assert node_data_bytes(shared) == 908 * MIB  # in shared memory, once per node
    # a quarter of 1 MiB samples: every label, their pages (about a quarter of the set: 16 fault-around windows
    # each) and their copy
    big = dataclasses.replace(shared, train_rows=800)
    held = client_data_bytes(big, client_ranks=4, per_round=False)
    assert held == 8 * MIB + mapped_inputs_bytes(800 * MIB, 800, 4) + 202 * MIB
    # rows of unknown size: every page of the set it reads from, and the copy of its quarter
    assert client_data_bytes(shared, client_ranks=4, per_round=False) == 808 * MIB + 202 * MIB
    assert client_data_bytes(shared, client_ranks=4, per_round=True) == 808 * MIB  # reads every client, no copy
    source = DataBytes(inputs=800 * MIB, labels=8 * MIB, test=100 * MIB, per_rank=True)
    assert client_data_bytes(source, client_ranks=4, per_round=False) == 8 * MIB + 202 * MIB  # labels + its rows
    assert node_data_bytes(source) == 0


def test_the_shared_set_counts_once_on_each_node_with_client_ranks():
    # 4 ranks per node, 1 + 6 ranks: node 1 has the server and 3 clients, node 2 three clients, each node one set
    assert fullest_node(5 * GIB, 1 * GIB, nranks=7, ranks_per_node=4, server_alone=False, shared=2 * GIB) == 10 * GIB
    # the server alone: its node holds no shared set
    assert fullest_node(9 * GIB, 1 * GIB, nranks=3, ranks_per_node=4, server_alone=True, shared=2 * GIB) == 9 * GIB


# Fashion-MNIST as mpifl.learning.idx reads it: 60,000 + 10,000 float32 28x28 images, int64 labels
FASHION_MNIST = DataBytes(inputs=60_000 * 784 * 4, labels=60_000 * 8, test=10_000 * (784 * 4 + 8), per_rank=False,
                          train_rows=60_000)
# rank 1's VmHWM in `mpiexec -n 4 mpifl run fm.yaml rounds=1` (docs/explanation/memory.md, 2026-12-01)
FASHION_MNIST_READER_PEAK = 773 * MIB


def test_the_rank_that_reads_the_data_holds_it_twice_as_measured_on_fashion_mnist():
    started = IMPORTS_BYTES + TRAINING_RUNTIME_BYTES
    planned = reading_rank_bytes(started, FASHION_MNIST)
    assert planned == started + 2 * node_data_bytes(FASHION_MNIST)  # as read, and its copy in shared memory
    assert abs(planned - FASHION_MNIST_READER_PEAK) <= 0.15 * FASHION_MNIST_READER_PEAK
    assert reading_rank_bytes(started, dataclasses.replace(FASHION_MNIST, per_rank=True)) == 0  # each reads its own


# ranks 2-3's VmHWM in `mpiexec -n 4 mpifl run configs/fashion_mnist.yaml rounds=1` (2026-12-01, docs/explanation/
# memory.md#the-shared-pages-a-client-rank-maps)
FASHION_MNIST_CLIENT_PEAK = 638 * MIB


def test_a_client_rank_maps_the_fault_around_windows_of_its_clients_samples_not_a_share_of_the_set():
    # measured on a written /dev/shm file of 60,000 rows of 3,136 bytes, reading 1/3, 1/10, 1/30, 1/100 of them
    inputs = FASHION_MNIST.inputs
    for ranks, mapped in ((3, 179.3), (10, 161.2), (30, 93.5), (100, 35.4)):
        planned = mapped_inputs_bytes(inputs, 60_000, ranks) / MIB
        assert abs(planned - mapped) <= 0.05 * mapped, (ranks, planned, mapped)
    assert mapped_inputs_bytes(inputs, 0, 3) == inputs  # rows of unknown size: every page
    # samples wider than a window: little more than the rank's share (a window at each end of a sample)
    assert 200 * MIB < mapped_inputs_bytes(800 * MIB, 800, 4) < 1.1 * 200 * MIB


def test_plan_holds_fashion_mnists_client_ranks_within_15_percent_of_their_measured_peak():
    from mpifl.learning.idx import FASHION_MNIST as FOLDER

    if not Path(FOLDER).is_dir():
        pytest.skip(f"no Fashion-MNIST in {FOLDER} (sudo apt-get install dataset-fashion-mnist)")
    _, plan = estimate(load_config(ROOT / "configs" / "fashion_mnist.yaml"), nranks=4, ranks_per_node=4,
                       server_alone=False)
    assert abs(plan.client_bytes - FASHION_MNIST_CLIENT_PEAK) <= 0.15 * FASHION_MNIST_CLIENT_PEAK, plan.client_bytes
    # every label, all but 0.3% of the training inputs' pages (21 images to a 64 KiB window), a copy of its third
    share = -(-(FASHION_MNIST.inputs + FASHION_MNIST.labels) // 3)
    assert plan.client_shared_bytes >= 0.997 * (FASHION_MNIST.inputs + FASHION_MNIST.labels)
    assert plan.client_data_bytes == plan.client_shared_bytes + share


# rank 0's peak RSS (/usr/bin/time -f %M) in `mpiexec -n 4 mpifl run configs/fashion_mnist.yaml rounds=2`, the median
# of three runs (393.7, 393.8, 397.0 MiB; 2026-12-01, docs/explanation/memory.md#the-server): its last round's
# held-out evaluation sets it
FASHION_MNIST_SERVER_PEAK = 394 * MIB


def test_plan_holds_fashion_mnists_server_within_10_percent_of_its_measured_peak():
    from mpifl.learning.idx import FASHION_MNIST as FOLDER

    if not Path(FOLDER).is_dir():
        pytest.skip(f"no Fashion-MNIST in {FOLDER} (sudo apt-get install dataset-fashion-mnist)")
    _, plan = estimate(load_config(ROOT / "configs" / "fashion_mnist.yaml", ["rounds=2"]), nranks=4,
                       ranks_per_node=4, server_alone=False)
    assert abs(plan.server_bytes - FASHION_MNIST_SERVER_PEAK) <= 0.10 * FASHION_MNIST_SERVER_PEAK, plan.server_bytes
    assert plan.server_eval_bytes > CONV_KERNELS_BYTES  # LeNet's convolutions, scored on the CPU


def test_a_convolutions_output_counts_several_times_in_a_held_out_batch_and_its_kernels_once():
    from mpifl.planning.memory import classifier_evaluation_bytes

    dense = classifier_evaluation_bytes(400, [100, 300, 40], width=4)
    assert dense == classifier_evaluation_bytes(400, [100, 300, 40], width=4, convolutions=[False] * 3)
    conv = classifier_evaluation_bytes(400, [100, 300, 40], width=4, convolutions=[False, True, False])
    assert conv == 400 + 100 + CONV_OUTPUT_COPIES * 300 + 40 + CONV_KERNELS_BYTES


def test_a_table_read_through_pyarrow_counts_its_reader_on_every_rank_that_reads_it():
    from mpifl.config.sections import DataConfig
    from mpifl.learning.datasets import reader_bytes

    assert reader_bytes(DataConfig(dataset="table", kwargs={"path": "t.parquet"})) == TABLE_READER_BYTES
    assert reader_bytes(DataConfig(dataset="table", kwargs={"path": "t.npz"})) == 0  # numpy reads npz
    assert reader_bytes(DataConfig(dataset="digits")) == 0
    source = DataBytes(inputs=800 * MIB, labels=8 * MIB, test=100 * MIB, per_rank=True, reader=TABLE_READER_BYTES)
    assert server_data_bytes(source) == 108 * MIB + TABLE_READER_BYTES  # the server surveys and reads its held-out set
    assert client_data_bytes(source, client_ranks=4, per_round=False) == 8 * MIB + 202 * MIB + TABLE_READER_BYTES
    whole = dataclasses.replace(source, per_rank=False)  # read whole by rank 1 alone
    assert server_data_bytes(whole) == 108 * MIB
    assert reading_rank_bytes(0, whole) == TABLE_READER_BYTES + 2 * 908 * MIB


def test_the_fullest_node_counts_rank_1_at_its_reading_peak_on_the_node_it_shares():
    # 1 + 3 ranks on one node: server 1, rank 1 reading 4 (its shared copy in it), ranks 2-3 1 each beside a 2 set
    assert fullest_node(1 * GIB, 1 * GIB, nranks=4, ranks_per_node=4, server_alone=False, shared=2 * GIB,
                        reader=4 * GIB) == 7 * GIB
    # server alone: rank 1 is on the first node of clients, the fullest; the next holds the set and its ranks only
    assert fullest_node(1 * GIB, 1 * GIB, nranks=9, ranks_per_node=4, server_alone=True, shared=2 * GIB,
                        reader=4 * GIB) == 7 * GIB
    # one rank per node: rank 1 on node 2
    assert fullest_node(1 * GIB, 1 * GIB, nranks=3, ranks_per_node=1, server_alone=False, shared=2 * GIB,
                        reader=4 * GIB) == 4 * GIB


def test_plan_gives_the_rank_that_reads_fashion_mnist_a_line_of_its_own_and_counts_it_in_the_node(capsys):
    from mpifl.cli import main
    from mpifl.learning.idx import FASHION_MNIST as FOLDER

    if not Path(FOLDER).is_dir():
        pytest.skip(f"no Fashion-MNIST in {FOLDER} (sudo apt-get install dataset-fashion-mnist)")
    config = ROOT / "configs" / "fashion_mnist.yaml"
    assert main(["plan", str(config), "--client-ranks", "3", "--ranks-per-node", "4"]) == 0
    reader, clients = capsys.readouterr().out.splitlines()[2:4]
    started = IMPORTS_BYTES + TRAINING_RUNTIME_BYTES
    assert reader.startswith(f"  rank 1 (reads the data): ~{reading_rank_bytes(started, FASHION_MNIST) / GIB:8.2f} GiB")
    assert "the data as read + its copy in shared memory, 2 x 209.88 MiB" in reader
    assert clients.startswith("  ranks 2-3 (clients): ~")
    _, plan = estimate(load_config(config), nranks=4, ranks_per_node=4, server_alone=False)
    assert plan.reader_bytes == reading_rank_bytes(started, FASHION_MNIST)
    others = 2 * (plan.client_bytes - plan.client_shared_bytes)
    assert plan.node_bytes == plan.server_bytes + plan.reader_bytes + others  # rank 1's peak holds the node's set
    assert "rank 1, reading the data, ~" in plan.describe()  # what pbs and slurm write in the job script


def test_plan_counts_the_data_each_rank_holds(capsys):
    from mpifl.cli import main
    from mpifl.learning.datasets import load_dataset

    quickstart = ROOT / "configs" / "quickstart.yaml"
    data = load_dataset(load_config(quickstart).data)
    inputs, labels = (t.numel() * t.element_size() for t in (data.x_train, data.y_train))
    test = sum(t.numel() * t.element_size() for t in (data.x_test, data.y_test))
    assert main(["plan", str(quickstart), "--client-ranks", "2"]) == 0
    server, clients, node = capsys.readouterr().out.splitlines()[1:4]
    assert f"data {format_bytes(labels + test)}: labels + held-out set" in server
    share = -(-(inputs + labels) // 2)  # its copy; it maps every page: 257 of its 256-byte rows to a 64 KiB window
    what = "the shared set's pages around its clients' samples + their copies"
    assert f"data {format_bytes(inputs + labels + share)}: {what}" in clients
    assert node.startswith(f"  shared data: {format_bytes(inputs + labels + test)} once per node")


def test_with_feature_noise_the_server_also_holds_a_noisy_copy_of_the_held_out_inputs(capsys):
    from mpifl.cli import main
    from mpifl.learning.datasets import load_dataset

    quickstart = ROOT / "configs" / "quickstart.yaml"
    data = load_dataset(load_config(quickstart).data)
    held_out = sum(t.numel() * t.element_size() for t in (data.x_test, data.y_test)) + data.x_test.numel() * 4
    assert main(["plan", str(quickstart), "--client-ranks", "2", "data.feature_noise=0.1"]) == 0
    server = capsys.readouterr().out.splitlines()[1]
    labels = data.y_train.numel() * 8
    assert (f"data {format_bytes(labels + held_out)}: labels + held-out set + one noisy copy of its inputs "
            "(data.feature_noise)") in server


def test_a_client_rank_holds_one_gradient_at_a_time_when_parameters_step_inside_backward():
    from mpifl.planning.memory import ModelBytes, client_bytes

    size = ModelBytes(exchanged=100 * MIB, frozen=0, parameters=25 * 2**20, largest=60 * MIB)
    inside = load_config(None, data={"clients": {"num_clients": 4}, "train": {"step_in_backward": True}})
    held = {key: load_config(None, data={"clients": {"num_clients": 4}, "train": {"step_in_backward": True, **value}})
            for key, value in (("off (the default)", {"step_in_backward": False}),
                               ("accumulating", {"grad_accum_steps": 2}), ("clipping", {"max_grad_norm": 1.0}))}
    assert inside.steps_inside_backward() and not any(c.steps_inside_backward() for c in held.values())
    for cfg in held.values():  # every gradient at once, against the largest alone
        assert client_bytes(cfg, size, 2) - client_bytes(inside, size, 2) == 40 * MIB
    scaffold = load_config(None, data={"clients": {"num_clients": 4}, "train": {"step_in_backward": True},
                                       "strategy": {"name": "scaffold", "update": "delta"}})
    assert not scaffold.steps_inside_backward()  # its correction hooks every whole optimizer step


def test_a_gpu_client_rank_keeps_its_training_state_on_the_gpu_and_maps_the_cuda_libraries_on_the_host():
    from mpifl.planning.memory import (
        CUDA_HOST_BYTES,
        CUDA_WORKSPACE_BYTES,
        ModelBytes,
        client_bytes,
        client_device_bytes,
        training_state_bytes,
        trains_on_gpu,
    )

    size = ModelBytes(exchanged=100 * MIB, frozen=20 * MIB, parameters=30 * 2**20)
    cfg = load_config(None, data={"clients": {"num_clients": 8, "groups": 2}, "train": {"device": "cuda"}})
    state = training_state_bytes(cfg, size)
    assert state == 100 * MIB  # the gradients (plain SGD keeps no state)
    # replica (exchanged + frozen), the global copy it resets from, the training state, the group's fp32 sum
    assert client_device_bytes(cfg, size) == 120 * MIB + 100 * MIB + state + 100 * MIB + CUDA_WORKSPACE_BYTES
    kept_global = 100 * MIB  # on the CPU the rank keeps the global model for its next client; on a GPU, the replica
    assert client_bytes(cfg, size, 2, on_gpu=False) - client_bytes(cfg, size, 2, on_gpu=True) == \
        state + kept_global - CUDA_HOST_BYTES

    def on_gpu(gpus: int, **train) -> bool:
        return trains_on_gpu(load_config(None, data={"train": train}), gpus)

    assert on_gpu(0, device="cuda") and on_gpu(4, device="auto") and not on_gpu(0, device="auto")
    assert not on_gpu(4, device="cpu") and not on_gpu(4, device="cuda", device_copy=False)
    assert not on_gpu(4, device="cuda", trainer="none")


def test_per_client_states_working_vectors_are_counted_where_the_client_trains():
    """SCAFFOLD's c - c_i and control deltas, FedDyn's g_i, Ditto's zero linear term: beside the replica on a GPU,
    beside the host model on the CPU; the hosted clients' stored vectors stay in host memory either way."""
    from mpifl.planning.memory import (
        CUDA_HOST_BYTES,
        CUDA_WORKSPACE_BYTES,
        ModelBytes,
        client_bytes,
        client_device_bytes,
        state_rule_bytes,
        training_state_bytes,
    )

    size = ModelBytes(exchanged=100 * MIB, frozen=0, parameters=25 * 2**20, control=40 * MIB)  # 60 MiB of weights
    scaffold = load_config(None, data={"strategy": {"name": "scaffold", "update": "delta"},
                                       "train": {"device": "cuda"}})
    assert state_rule_bytes(scaffold, size) == 2 * 40 * MIB  # c - c_i, and the control deltas
    training = training_state_bytes(scaffold, size)
    assert client_device_bytes(scaffold, size) == 100 * MIB + 100 * MIB + training + 2 * 40 * MIB + \
        CUDA_WORKSPACE_BYTES  # the replica, its global copy, the training state, SCAFFOLD's working vectors
    kept_global = 100 * MIB  # on the CPU the host keeps the global model for the delta; on a GPU, the replica does
    assert client_bytes(scaffold, size, 2, on_gpu=False) - client_bytes(scaffold, size, 2, on_gpu=True) == \
        training + kept_global + 2 * 40 * MIB - CUDA_HOST_BYTES  # the stored c_i stay in host memory either way
    ditto = load_config(None, data={"strategy": {"update": "delta"}, "train": {"device": "cuda", "ditto_lambda": 1}})
    assert state_rule_bytes(ditto, ModelBytes(exchanged=100 * MIB, frozen=0, parameters=25 * 2**20)) == 100 * MIB


# The GPU check on one H100 (2026-11-27, docs/how-to/gpus.md): a client rank summing its clients (clients.groups=1)
# peaked at these GPU bytes (torch's allocator) and resident bytes.
H100_MLP = {"gpu": 65 * MIB, "rss": 1099 * MIB}  # the quick start's MLP, 20 clients a round
H100_CNN = {"gpu": 110 * MIB, "rss": 1409 * MIB}  # the LEAF CNN, 1,690,046 parameters, 200 clients a round


def test_a_rank_journals_a_copy_for_every_client_it_may_train_in_a_round_which_a_fixed_placement_can_crowd():
    from mpifl.planning.memory import undo_vectors

    state = ["strategy.name=scaffold", "strategy.update=delta", "clients.accept_failures=true",
             "clients.num_clients=8", "clients.per_round=2"]
    # 8 clients on 2 ranks, 2 a round: round robin may draw two of one rank's four; per_round deals one each
    assert undo_vectors(load_config(None, state), client_ranks=2) == 2
    assert undo_vectors(load_config(None, [*state, "clients.placement=per_round"]), client_ranks=2) == 1
    assert undo_vectors(load_config(None, [*state, "clients.accept_failures=false"]), client_ranks=2) == 0


def test_the_gpu_plan_is_what_an_h100_measured_activations_aside():
    from mpifl.cli.plan import estimate
    from mpifl.planning.memory import ModelBytes, client_device_bytes

    mlp = load_config(ROOT / "configs" / "quickstart.yaml", ["train.device=cuda", "clients.num_clients=20",
                                                             "clients.per_round=20", "clients.groups=1"])
    _, plan = estimate(mlp, 2, ranks_per_node=2, server_alone=False)
    assert abs(plan.client_device_bytes / H100_MLP["gpu"] - 1) < 0.03  # almost all of it cuBLAS's workspaces
    assert abs(plan.client_bytes / H100_MLP["rss"] - 1) < 0.15
    cnn = load_config(None, data={"clients": {"num_clients": 1000, "per_round": 200, "groups": 1},
                                  "train": {"device": "cuda", "batch_size": 10}})
    size = ModelBytes(exchanged=4 * 1_690_046, frozen=0, parameters=1_690_046)
    # activations and cuDNN's workspace are not counted: the plan stays below the measurement, by less than a fifth
    assert 0.8 * H100_CNN["gpu"] < client_device_bytes(cnn, size) < H100_CNN["gpu"]


def test_an_option_is_read_only_by_its_whole_name_and_a_mistyped_one_is_named_with_what_it_may_mean(capsys):
    """`--ranks 5` must not pass for `--ranks-per-node 5` (argparse's prefix matching would take it silently); the
    error comes with the subcommand's own usage and the options the user may have meant."""
    import pytest

    from mpifl.cli import main

    with pytest.raises(SystemExit):
        main(["plan", str(ROOT / "configs" / "quickstart.yaml"), "--ranks", "5"])
    err = capsys.readouterr().err
    assert err.startswith("usage: mpifl plan ")
    assert ("mpifl plan: error: unrecognized arguments: --ranks 5 (--ranks: did you mean --client-ranks or "
            "--ranks-per-node?)") in err
    with pytest.raises(SystemExit):
        main(["run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dri", "x"])
    assert "(--run-dri: did you mean --run-dir?)" in capsys.readouterr().err


def test_the_bytes_moved_per_round_count_updates_as_they_travel():
    """An update on the wire: the model's bytes, half of them in bf16, the top-k's indices and values, or a group's
    fp32 sum; a round moves the model out to each client rank and those updates back."""
    from mpifl.cli.plan import estimate

    def update_bytes(*overrides: str) -> tuple[int, int]:
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))
        size, plan = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
        assert plan.update_wire_bytes > 0
        return plan.update_wire_bytes, size.exchanged

    dense, model = update_bytes()
    assert 0 <= model - dense < 64  # every tensor's bytes; the buffer's 64-byte alignment padding never travels
    assert update_bytes("strategy.wire_dtype=bfloat16")[0] < 0.51 * model
    topk = update_bytes("compression.method=topk", "compression.fraction=0.01", "strategy.update=delta")[0]
    assert 8 * 0.01 * model / 4 <= topk < 0.03 * model  # an int32 index and an fp32 value per kept value
    bf16 = update_bytes("model.dtype=bfloat16")[0]
    assert update_bytes("clients.groups=2", "model.dtype=bfloat16")[0] == 2 * bf16  # a bf16 model's fp32 group sums


@pytest.mark.parametrize("overrides, between_client_ranks", [
    ((), "nothing"), (("clients.groups=2",), "nothing"),
    (("clients.groups=2", "transport.reduce=chain"), "one group sum"), (("transport.dispatch_fanout=1",), "one model")])
def test_the_planned_bytes_through_rank_0_are_what_the_record_measures(tmp_path, overrides, between_client_ranks):
    """On 2 client ranks: the chain's first hop carries a group's sum from rank 1 to rank 2, and a tree of fanout 1
    sends the model to rank 1, which forwards it to rank 2; neither passes through rank 0."""
    from mpifl.cli.plan import estimate, round_traffic

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))
    size, plan = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    moved, through_server = round_traffic(cfg, 2, size.exchanged, plan.update_wire_bytes)
    hop = {"nothing": 0, "one group sum": plan.update_wire_bytes, "one model": size.exchanged}[between_client_ranks]
    assert moved - through_server == hop
    done = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "rounds=1", "eval.every=0",
                   "output.progress=false", *overrides, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert through_server == pytest.approx(record["cost"]["bytes_moved"], rel=0.01)  # headers and padding aside


def test_the_planned_bytes_of_an_asynchronous_step_bound_what_its_record_measures(tmp_path):
    """A FedBuff step applies clock.buffer updates, and the new version goes once to each rank holding a client
    dispatched in their place, all through rank 0: a round's figure (every client of a round, both ways) would be
    far too high. The first step also carries the first dispatch's models."""
    overrides = ["rounds=4", "eval.every=0", "output.progress=false", "clients.num_clients=8", "clock.mode=fedbuff",
                 "clock.concurrency=3", "clock.buffer=2"]
    planned = mpifl_here("plan", str(ROOT / "configs" / "quickstart.yaml"), "--client-ranks", "2", *overrides)
    assert planned.returncode == 0, planned.stderr
    first = planned.stdout.splitlines()[0]
    assert "3 of 8 clients training at once (clock.concurrency), ~" in first and "per round" not in first
    assert "moved per fedbuff server step (2 updates in (clock.buffer), the new version out to each rank" in first
    from mpifl.cli.plan import estimate, step_traffic

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    size, plan = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    fewest, most, _ = step_traffic(cfg, 2, size.exchanged, plan.update_wire_bytes)
    update, model = plan.update_wire_bytes, size.exchanged
    assert (fewest, most) == (2 * update + model, 2 * (update + model))
    done = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), *overrides, "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr[-2000:]
    records = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    moved = [json.loads(line)["cost"]["bytes_moved"] for line in records]
    assert all(0.99 * fewest <= m <= 1.01 * most for m in moved[1:]), (moved, fewest, most)
    assert moved[0] > moved[1]  # the first dispatch's models


def test_plan_suggests_one_group_of_equal_work_per_client_rank_only_where_the_config_can_take_it():
    from mpifl.cli.plan import groups_hint

    def config(**overrides):
        return load_config(None, data={"clients": {"num_clients": 1000, "per_round": 20},
                                       "data": {"dataset": "synthetic", "kwargs": {"num_samples": 2000}}, **overrides})

    hint = groups_hint(config(), 2)
    assert hint is not None and "clients.groups=2 clients.group_by=cost clients.placement=per_round" in hint
    assert "20 a round from 2 client ranks" in hint and "same on any number of ranks" in hint
    assert groups_hint(config(clients={"num_clients": 1000, "per_round": 20, "groups": 4}), 2) is None  # set already
    assert groups_hint(config(clients={"num_clients": 1000, "per_round": 3}), 2) is None  # about one client a rank
    assert groups_hint(config(strategy={"name": "median"}), 2) is None  # a robust rule needs every update
    assert groups_hint(config(), 1) is None


def test_plan_counts_one_client_rank_per_group_and_refuses_more_ranks_than_groups(capsys):
    """With clients.groups, a group lives on one client rank: the plan's default is one rank per group, and a
    launch of more is refused as `mpifl run` would refuse it (it used to be planned silently)."""
    from mpifl.cli import main

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    assert main(["plan", quickstart, "clients.groups=2"]) == 0
    assert "; 2 client ranks, 4 clients per round" in capsys.readouterr().out.splitlines()[0]
    assert main(["plan", quickstart, "--client-ranks", "3", "clients.groups=2"]) == 2
    assert ("config error: clients.groups=2 < 3 client ranks: a group lives on one client rank, so 1 of the 3 "
            "client ranks would hold no group and idle; launch at most 3 ranks or raise clients.groups (planned for 3 "
            "client ranks; --client-ranks sets them)"
            in capsys.readouterr().err)


def test_too_few_groups_for_the_client_ranks_says_how_many_ranks_would_idle():
    """The count that idles is of client ranks (or client groups of ranks), not of clients.groups."""
    from mpifl.planning.world import world_problem

    assert world_problem(5, load_config(None, ["clients.groups=2"])) == (
        "clients.groups=2 < 4 client ranks: a group lives on one client rank, so 2 of the 4 client ranks would hold "
        "no group and idle; launch at most 3 ranks or raise clients.groups")
    assert "so 1 of the 3 client groups of 2 ranks would hold no group and idle; launch at most 5 ranks" in \
        world_problem(7, load_config(None, ["clients.groups=2", "clients.ranks_per_client=2"]))


def test_a_chain_rank_with_k_groups_holds_k_group_sums_until_the_chain_passes():
    from mpifl.planning.memory import ModelBytes, client_bytes

    size = ModelBytes(exchanged=100 * MIB, frozen=0, parameters=25 * 2**20)

    def chain(groups: int):
        return load_config(None, data={"clients": {"num_clients": 16, "groups": groups},
                                       "transport": {"reduce": "chain"}})

    # 8 groups on 2 client ranks: 4 each, 3 fp32 sums (4 bytes per element) beside the group sum's own
    assert client_bytes(chain(8), size, 2) - client_bytes(chain(2), size, 2) == 3 * 100 * MIB
    assert client_bytes(chain(5), size, 2) - client_bytes(chain(2), size, 2) == 2 * 100 * MIB  # at most 3 a rank


def test_an_fsdp_unit_is_a_numbered_block_or_a_module_of_its_own():
    from mpifl.planning.memory import fsdp_unit, largest_fsdp_unit

    assert fsdp_unit("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert fsdp_unit("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0"
    assert fsdp_unit("lm_head.weight") == "lm_head" and fsdp_unit("model.embed_tokens.weight") == "model.embed_tokens"
    assert largest_fsdp_unit([("model.layers.0.a.weight", 5), ("model.layers.0.b.weight", 7),
                              ("model.layers.1.a.weight", 6), ("lm_head.weight", 11)]) == 12


def test_a_sharded_rank_holds_one_rth_of_what_scales_with_the_model_plus_what_does_not():
    """Without a gathered unit or activations, R ranks hold fixed + (model + global rows + training state) / R each."""
    from mpifl.planning.memory import ModelBytes, sharded_client_bytes, training_state_bytes

    size = ModelBytes(exchanged=4 * 2**30, frozen=0, parameters=2**30, largest=2**28, trainable=2**30)
    cfg = {r: load_config(None, ["train.optimizer=adamw", f"clients.ranks_per_client={r}", "clients.sharding=fsdp",
                                 "model.name=transformers", "train.trainer=causal_lm", "data.dataset=text",
                                 "model.transformers.architecture=llama"]) for r in (2, 4)}
    scaled = 2 * size.exchanged + training_state_bytes(cfg[2], size)
    assert sharded_client_bytes(cfg[2], size) - sharded_client_bytes(cfg[4], size) == scaled // 2 - scaled // 4


def test_a_sharded_ranks_chunk_ring_counts_each_chunk_at_most_the_exchanged_model():
    """C is transport.chunk_mb, at most S (docs/explanation/memory.md): every rank's ring slots and the leader's
    gathered chunk are the widest chunk, so a model smaller than a chunk is counted at its own size, (F + 2) x S."""
    from mpifl.planning.memory import ModelBytes, sharded_client_bytes

    def planned(size: ModelBytes, chunk_mb: int, compression: str = "none") -> int:
        return sharded_client_bytes(load_config(None, [*TINY_SHARDED, f"transport.chunk_mb={chunk_mb}",
                                                       "transport.inflight=4", f"compression.method={compression}"]),
                                    size)

    small = ModelBytes(exchanged=545 * 1024, frozen=0, parameters=545 * 256)  # the walkthrough's tiny llama
    assert planned(small, 16) == planned(small, 1) == planned(small, 64)
    assert planned(small, 16, "topk") == planned(small, 1, "topk")
    large = ModelBytes(exchanged=GIB, frozen=0, parameters=GIB // 4)
    assert planned(large, 16) - planned(large, 8) == (4 + 2) * 8 * MIB  # chunks narrower than S: C each


def test_activations_scale_with_the_batch_share_and_checkpointing_keeps_one_layer():
    from mpifl.planning.memory import DecoderShape, decoder_activation_bytes

    shape = DecoderShape(hidden=1024, intermediate=2816, layers=8, heads=16, vocab=32000)
    full = decoder_activation_bytes(shape, batch=8, seq=128, width=4, checkpointing=False)
    assert decoder_activation_bytes(shape, batch=4, seq=128, width=4, checkpointing=False) * 2 == full
    layers_only = DecoderShape(hidden=1024, intermediate=2816, layers=8, heads=16, vocab=0)  # no logits
    kept = decoder_activation_bytes(layers_only, batch=8, seq=128, width=4, checkpointing=True)
    assert kept < decoder_activation_bytes(layers_only, batch=8, seq=128, width=4, checkpointing=False) / 4


def test_plan_says_how_many_polaris_nodes_a_sharded_70b_lora_client_needs():

    result = mpifl_here("plan", "configs/llama3.1-70b-lora.yaml", "--ranks-per-node", "4", "--gpus-per-node", "4",
                        "--gpu-memory-gb", "40")
    assert result.returncode == 0, result.stderr
    assert "clients.ranks_per_client >= 8 to fit a 40 GiB GPU" in result.stdout
    assert "2 nodes of 4 GPUs per client" in result.stdout


def test_batched_clients_count_each_lanes_weights_gradients_frozen_copy_state_and_activations():
    from mpifl.planning.memory import ModelBytes, batched_lanes_bytes, training_state_bytes

    size = ModelBytes(exchanged=4_000, frozen=0, parameters=1_000, activations=300)
    sgd = load_config(None, ["train.batched_clients=8", "train.momentum=0.0"])
    adam = load_config(None, ["train.batched_clients=8", "train.optimizer=adam"])
    assert batched_lanes_bytes(sgd, size) == 8 * (3 * 4_000 + 2 * 300)
    assert batched_lanes_bytes(adam, size) == 8 * (5 * 4_000 + 2 * 300)
    assert training_state_bytes(adam, size) == batched_lanes_bytes(adam, size)  # instead of one client's state


def test_a_lanes_activations_are_every_layers_output_for_one_micro_batch_from_a_meta_forward():
    from mpifl.cli.plan import lane_activation_bytes

    cfg = load_config(None, ["model.name=mlp", "model.kwargs={hidden: [16, 8]}", "train.batch_size=5",
                             "train.batched_clients=4"])
    got = lane_activation_bytes(cfg, {"input_shape": (1, 8, 8), "num_classes": 10})
    per_sample = 64 + 16 + 16 + 8 + 8 + 10  # flatten, linear and ReLU at 16, at 8, the 10 logits; fp32
    assert got == 5 * 4 * per_sample


def test_a_replicated_client_counts_its_estimated_activations_on_the_gpu_or_on_the_host():
    import dataclasses

    from mpifl.planning.memory import ModelBytes, client_bytes, client_device_bytes

    size = ModelBytes(exchanged=4_000, frozen=1_000, parameters=1_250)
    acting = dataclasses.replace(size, activations=700)
    lm = load_config(None, ["train.optimizer=adamw"])
    assert client_device_bytes(lm, acting) - client_device_bytes(lm, size) == 700
    assert client_bytes(lm, acting, 2) - client_bytes(lm, size, 2) == 700
    assert client_bytes(lm, acting, 2, on_gpu=True) == client_bytes(lm, size, 2, on_gpu=True)  # on the GPU
    exchange_only = load_config(None, ["train.trainer=none", "eval.every=0", "model.name=blob"])
    assert client_device_bytes(exchange_only, acting) == client_device_bytes(exchange_only, size)


def test_an_out_of_core_server_short_of_client_ranks_suggests_only_fixes_the_config_can_take():
    """clients.groups sums a rank's participants into one stream, but a sharded client refuses it: the message
    offers it only where the config would then pass its checks."""
    from mpifl.planning.world import world_problem

    disk = ["server.state=disk", "eval.every=0", "clients.num_clients=4", "clients.per_round=2"]
    replicated = world_problem(2, load_config(None, disk))
    assert replicated is not None and replicated.endswith(
        "2 clients per round > 1 client rank: launch 3 ranks, lower clients.per_round, or sum each rank's "
        "participants first with clients.groups=1")
    sharded = world_problem(3, load_config(None, [*disk, *TINY_SHARDED]))
    assert sharded is not None and sharded.endswith(
        "2 clients per round > 1 client group of 2 ranks: launch 5 ranks or lower clients.per_round")


TINY_SHARDED = ("model.name=transformers", "model.transformers.architecture=gpt2", "train.trainer=causal_lm",
                "data.dataset=text", "data.partition=iid",
                "clients.ranks_per_client=2", "clients.sharding=fsdp")


def test_counts_and_rank_spans_read_as_a_person_writes_them():
    from mpifl.cli.plan import groups_of, leaders
    from mpifl.units import counted, rank_span

    assert [counted(1, "client rank"), counted(3, "client rank"), counted(2, "copy", "copies")] == \
        ["1 client rank", "3 client ranks", "2 copies"]
    assert [rank_span(1, 1), rank_span(1, 4)] == ["rank 1", "ranks 1-4"]
    assert [groups_of(2, 2), groups_of(8, 2)] == ["1 group of 2 ranks", "4 groups of 2 ranks"]
    assert [leaders(2, 2), leaders(4, 2), leaders(8, 2)] == [
        "rank 1 leads and exchanges", "ranks 1 and 3 lead and exchange", "ranks 1, 3, ... lead and exchange"]


def test_plan_of_one_client_rank_says_rank_1_once(capsys):
    from mpifl.cli import main

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    assert main(["plan", quickstart, "clients.per_round=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "; 1 client rank, 1 client per round," in out[0]
    assert out[2].startswith("  rank 1 (clients): ~") and " GiB each" not in out[2]


def test_a_sharded_rank_gathers_the_unit_that_takes_the_most_with_gradients_only_for_what_trains():
    """Under LoRA the embedding is frozen: gathered whole, it has no gradient beside it, so a decoder layer with
    trained adapters may be the unit that takes the most."""
    from mpifl.planning.memory import gathered_unit

    frozen_embedding = [("model.embed_tokens.weight", 1000, False), ("model.layers.0.q.weight", 300, False),
                        ("model.layers.0.q.lora_A.weight", 10, True)]
    assert gathered_unit(frozen_embedding) == (1000, 0)
    assert gathered_unit([*frozen_embedding[:1], ("model.layers.0.q.weight", 900, True)]) == (900, 900)
    assert gathered_unit([(n, b, True) for n, b, _ in frozen_embedding]) == (1000, 1000)
    assert gathered_unit([]) == (0, 0)


def test_the_70b_lora_plan_counts_no_gradient_for_its_frozen_embedding():

    result = mpifl_here("plan", "configs/llama3.1-70b-lora.yaml", "--ranks-per-node", "4", "--gpus-per-node", "4",
                        "--gpu-memory-gb", "40")
    gpu = next(line for line in result.stdout.splitlines() if "GPU of each client rank" in line)
    assert gpu.startswith("  GPU of each client rank: ~20.06 GiB")  # was 22.02: 1.96 GiB for a gradient that is not
    assert "the largest FSDP unit gathered (1.96 GiB, frozen: no gradients)" in gpu


@pytest.mark.parametrize("overrides, said", [
    (("data.dataset=idx",), "data.kwargs.path: idx takes path without a default; set it"),
    (("strategy.name=median", "clients.groups=2"), "clients.groups: strategy 'median' needs every participant's own"),
    (("model.local=[nosuch]",), "model.local: 'nosuch' matches no floating tensor of the model 'mlp'"),
], ids=["dataset", "strategy", "model-local"])
def test_plan_pbs_and_slurm_check_a_config_as_run_does_before_mpi(tmp_path, overrides, said):
    """A mistake ``mpifl run`` would refuse before MPI starts is refused by the commands that size and write its job
    too, in one line naming the key (plan used to print a traceback for a dataset without its path), and no job
    script is written: a job that queues only to stop at once burns the queue wait."""
    config = write_config(tmp_path / "c.yaml", "rounds: 2\nclients: {num_clients: 4}\ndata: {dataset: synthetic}\n"
                                               "model: {name: mlp}\n")
    for command in (("plan",), ("pbs", "-o", str(tmp_path / "j.pbs")), ("slurm", "-o", str(tmp_path / "j.sbatch"))):
        result = mpifl_here(command[0], str(config), *overrides, *command[1:])
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, (
            command, result.stderr)
    assert not (tmp_path / "j.pbs").exists() and not (tmp_path / "j.sbatch").exists()


@pytest.mark.parametrize("placement,clients,per_round,ranks,most", [
    ("per_round", 4, 2, 2, 1),  # dealt over the ranks
    ("round_robin", 4, 2, 2, 2),  # clients 0 and 2 live on rank 1: a round may sample both
    ("balanced", 4, 2, 2, 2),
    ("round_robin", 2, 2, 2, 1),  # a client per rank
    ("round_robin", 8, 2, 4, 2),
    ("round_robin", 9, 6, 2, 5),  # rank 1 hosts clients 0, 2, 4, 6 and 8: a round may sample all five
    ("per_round", 9, 6, 2, 3),  # more participants than ranks: the even spread
])
def test_a_fixed_placement_may_put_as_many_participants_on_a_rank_as_it_hosts(placement, clients, per_round, ranks,
                                                                              most):
    from mpifl.planning.federation import most_trained_per_rank

    cfg = load_config(None, [f"clients.placement={placement}", f"clients.num_clients={clients}",
                             f"clients.per_round={per_round}"])
    assert most_trained_per_rank(cfg.clients, ranks) == most


def test_plan_counts_the_round_that_samples_two_clients_of_one_rank_and_names_what_avoids_it(tmp_path, capsys):
    """Out of core, 2 of 4 clients a round on 2 client ranks: under round_robin a round may send two updates from one
    rank, one after the other, so the server's accumulators span the model; per_round deals them one per rank.
    Measured (2026-12-01, a 384 MiB model): 939 MiB against 0.93 GiB planned, and 683 MiB against 0.68 GiB."""
    from mpifl.cli import main

    cfg = write_config(tmp_path / "c.yaml", "clients: {num_clients: 4, per_round: 2}\nmodel: {name: blob, kwargs: "
                       "{size_mb: 384}}\ntrain: {trainer: none}\neval: {every: 0}\nserver: {state: disk}\n")
    disk = [str(cfg), "--client-ranks", "2"]
    assert main(["plan", *disk, "clients.placement=per_round"]) == 0
    dealt = capsys.readouterr().out
    assert main(["plan", *disk]) == 0
    fixed = capsys.readouterr().out

    def server_gib(out: str) -> float:
        return float(out.split("rank 0 (server):")[1].split("GiB")[0].strip(" ~"))

    assert "note:" not in dealt
    # the whole model's fp32 accumulators (384 MiB) and 4 in-flight 16 MiB slots per rank, against the 256 MiB budget
    assert "receive pool 512.00 MiB" in fixed and "receive pool 256.00 MiB" in dealt
    assert server_gib(fixed) == pytest.approx(server_gib(dealt) + 0.25, abs=0.011)
    note = fixed.split("note: ")[1]
    assert note.startswith("clients.placement='round_robin' fixes each client's rank, so a round may sample two "
                           "clients of one rank")
    assert f"With clients.placement=per_round, which deals each round's participants over the client ranks: rank 0 " \
           f"~{server_gib(dealt):.2f} GiB" in note


def test_a_held_out_batchs_logits_grow_with_the_batch_and_the_vocabulary_and_a_narrow_model_adds_an_fp32_copy():
    from mpifl.planning.memory import DecoderShape, decoder_evaluation_bytes

    gpt2 = DecoderShape(hidden=768, intermediate=3072, layers=12, heads=12, vocab=50257)
    bf16 = decoder_evaluation_bytes(gpt2, batch=16, seq=128, width=2)
    logits = 16 * 128 * 50257
    assert 10 * logits < bf16 < 10.6 * logits  # bf16 logits, their fp32 copy, the fp32 log-softmax; one layer
    assert decoder_evaluation_bytes(gpt2, batch=32, seq=128, width=2) == 2 * bf16
    wider = DecoderShape(hidden=768, intermediate=3072, layers=12, heads=12, vocab=2 * 50257)
    assert decoder_evaluation_bytes(wider, batch=16, seq=128, width=2) - bf16 == 10 * logits
    fp32 = decoder_evaluation_bytes(wider, batch=16, seq=128, width=4) - \
        decoder_evaluation_bytes(gpt2, batch=16, seq=128, width=4)
    assert fp32 == 8 * logits  # fp32 logits are their own fp32 copy: only the log-softmax beside them


@pytest.mark.parametrize("overrides, counted", [
    ((), True), (("eval.every=0",), False), (("server.state=disk", "eval.every=0"), False)])
def test_the_server_counts_its_held_out_evaluation_only_when_it_evaluates(overrides, counted):
    from mpifl.cli.plan import estimate

    size, plan = estimate(load_config(ROOT / "configs" / "gpt2.yaml", list(overrides)), 3, 4, False)
    assert size.evaluation_batch == 16 and (plan.server_eval_bytes == size.evaluation > GIB) == counted
    _, off = estimate(load_config(ROOT / "configs" / "gpt2.yaml", ["eval.every=0"]), 3, 4, False)
    if counted:
        assert plan.server_bytes - off.server_bytes == size.evaluation


def test_the_planned_evaluation_grows_with_eval_batch_size_up_to_the_held_out_set_and_is_shown_with_its_knob(capsys):
    from mpifl.cli import main
    from mpifl.cli.plan import estimate

    gpt2 = ROOT / "configs" / "gpt2.yaml"  # 64 held-out blocks of 128 tokens
    sizes = [estimate(load_config(gpt2, [f"eval.batch_size={b}"]), 3, 4, False)[0] for b in (8, 16, 64, 512)]
    assert [s.evaluation_batch for s in sizes] == [8, 16, 64, 64]
    assert sizes[0].evaluation < sizes[1].evaluation < sizes[2].evaluation == sizes[3].evaluation
    assert main(["plan", str(gpt2)]) == 0
    server = capsys.readouterr().out.splitlines()[1]
    assert f"evaluation {format_bytes(sizes[1].evaluation)}: 16 x 128 x 50,257 logits" in server
    assert "eval.batch_size sets it" in server


def test_a_classifiers_held_out_batch_is_small_and_the_quick_start_plan_barely_moves():
    from mpifl.cli.plan import estimate
    from mpifl.planning.memory import classifier_evaluation_bytes

    assert classifier_evaluation_bytes(400, [100, 300, 40], width=4) == 400 + 400 + 40
    assert classifier_evaluation_bytes(400, [], width=4) == 0
    size, plan = estimate(load_config(ROOT / "configs" / "quickstart.yaml"), 3, 4, False)
    assert 0 < plan.server_eval_bytes < MIB


def test_federated_evaluation_counts_on_a_client_rank_as_the_larger_of_it_and_the_training_activations():
    import dataclasses

    from mpifl.planning.memory import ModelBytes, client_working_set

    cfg = load_config(ROOT / "configs" / "gpt2.yaml", ["eval.federated_every=1", "data.val_fraction=0.1"])
    size = ModelBytes(exchanged=GIB, frozen=0, parameters=GIB // 2, activations=300 * MIB, evaluation=GIB)
    assert client_working_set(cfg, size) == GIB
    assert client_working_set(cfg, dataclasses.replace(size, evaluation=100 * MIB)) == 300 * MIB
    assert client_working_set(load_config(ROOT / "configs" / "gpt2.yaml"), size) == 300 * MIB


def test_a_70b_lora_client_that_does_not_fit_its_gpu_is_told_the_fsdp_group_that_does_as_the_planner_confirms():
    import argparse
    import re

    from mpifl.cli.plan import estimate, fewest_fitting_ranks

    overrides = ["clients.ranks_per_client=1", "clients.sharding=replicate"]
    result = mpifl_here("plan", "configs/llama3.1-70b-lora.yaml", *overrides, "--gpus-per-node", "4",
                        "--gpu-memory-gb", "40")
    assert result.returncode == 0, result.stderr
    fit = re.search(r"fit: clients.ranks_per_client=(\d+) clients.sharding=fsdp puts ~([\d.]+) GiB on each GPU",
                    result.stdout)
    assert fit is not None, result.stdout
    assert "shard each client over several GPUs" in result.stdout
    assert "model.trainable" not in result.stdout  # only the adapters train already
    parts = int(fit[1])
    sharded = load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml",
                          [f"clients.ranks_per_client={parts}", "clients.sharding=fsdp"])
    _, plan = estimate(sharded, 2 * parts + 1, 4, False, gpus_per_node=4)
    assert plan.client_device_bytes <= 0.9 * 40 * GIB and f"{plan.client_device_bytes / GIB:.2f}" == fit[2]
    half = load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml",
                       [f"clients.ranks_per_client={parts // 2}", "clients.sharding=fsdp"])
    assert estimate(half, parts + 1, 4, False, gpus_per_node=4)[1].client_device_bytes > 0.9 * 40 * GIB
    args = argparse.Namespace(gpu_memory_gb=200.0, node_memory_gb=None, ranks_per_node=4)
    replicated = load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml", overrides)
    size, fits = estimate(replicated, 3, 4, False, gpus_per_node=4)
    assert fewest_fitting_ranks(replicated, size, args, 4, fits) is None  # 144 GiB fits a 200 GiB GPU: no advice


def test_a_sharded_client_that_does_not_fit_its_gpu_is_told_first_the_ranks_per_client_the_fit_line_finds():
    import re

    result = mpifl_here("plan", "configs/llama3.1-8b-full.yaml", "clients.ranks_per_client=4", "--ranks-per-node",
                        "4", "--gpus-per-node", "4", "--gpu-memory-gb", "40")
    assert result.returncode == 0, result.stderr
    fit = re.search(r"fit: a client needs clients.ranks_per_client >= (\d+) to fit a 40 GiB GPU \(~([\d.]+) GiB",
                    result.stdout)
    assert fit is not None and int(fit[1]) > 4, result.stdout
    warning = re.search(r"warning: the fullest GPU holds a client rank's ~[\d.]+ GiB, > 90% of 40 GiB: (.*)",
                        result.stdout)
    assert warning is not None, result.stdout
    assert warning[1].startswith(f"raise clients.ranks_per_client to {fit[1]}, which puts ~{fit[2]} GiB on each GPU "
                                 f"(the fit: line), or train LoRA adapters only")


def test_a_built_in_model_is_built_once_a_process_however_often_its_config_is_planned(monkeypatch, tmp_path):
    """The fit advice re-plans a config per layout: a built-in model's spec, which follows from the model section,
    the seed and the client rule alone, is built the first time; a plug-in model may read anything, so it is
    built each time."""
    from mpifl.cli import plan
    from mpifl.learning import models

    built, real = [], models.model_spec
    monkeypatch.setattr(models, "model_spec", lambda *a, **k: built.append(a[0].name) or real(*a, **k))
    monkeypatch.setattr(plan, "_SPECS", {})
    layouts = [["clients.ranks_per_client=8", "clients.sharding=fsdp"], ["clients.ranks_per_client=4"], []]
    lora = [plan.model_and_data(load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml", o))[0] for o in layouts]
    assert built == ["transformers"] and lora[0] == lora[1] == lora[2]
    assert plan.model_and_data(load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml", ["seed=4"]))[0] == lora[0]
    assert built == ["transformers", "transformers"]  # another seed is another key (the spec happens not to differ)
    (tmp_path / "tiny_model.py").write_text("import torch\n\ndef tiny():\n    return torch.nn.Linear(2, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user = load_config(None, ["model.name=tiny_model:tiny", "train.trainer=none", "eval.every=0"])
    assert plan.model_and_data(user)[0] == plan.model_and_data(user)[0]
    assert built == ["transformers", "transformers", "tiny_model:tiny", "tiny_model:tiny"]


def test_the_one_line_summary_names_lora_bytes_as_the_exchanged_adapters_not_the_model():
    from mpifl.planning.memory import exchanged_what

    assert exchanged_what(load_config(ROOT / "configs" / "llama3.1-70b-lora.yaml")) == "exchanged (adapters)"
    assert exchanged_what(load_config(ROOT / "configs" / "gpt2.yaml")) == "model"
    plan = MemoryEstimate(model_bytes=250 * MIB, server_bytes=GIB, server_pool_bytes=0, client_bytes=GIB,
                          node_bytes=GIB)
    assert plan.describe("exchanged (adapters)").startswith("exchanged (adapters) 250.00 MiB; server")


# Client ranks' peak RSS measured on CPU (AMD EPYC, 2 cores; docs/explanation/memory.md#a-client-rank): the config,
# then the fuller client rank's peak in MiB, from `mpiexec -n 3 mpifl run configs/gpt2.yaml rounds=1..5 ...`.
GPT2_LORA = ("model.lora.r=8", "model.lora.target_modules=[c_attn]", "train.lr=0.002")
MEASURED_GPT2_CLIENTS = [((), 4008), ((), 3838), (("train.batch_size=2",), 3519), (GPT2_LORA, 2170),
                         (GPT2_LORA, 1955), ((*GPT2_LORA, "train.batch_size=8"), 3105)]


@pytest.mark.parametrize("overrides, measured_mib", MEASURED_GPT2_CLIENTS)
def test_a_gpt2_client_rank_on_the_cpu_is_planned_within_10_percent_of_its_measured_peak(overrides, measured_mib):
    from mpifl.cli.plan import estimate

    for evaluation in ("eval.every=0", "eval.every=1"):
        _, plan = estimate(load_config(ROOT / "configs" / "gpt2.yaml", [*overrides, evaluation]), 3, 4, False)
        assert 0.93 * measured_mib * MIB <= plan.client_bytes <= 1.10 * measured_mib * MIB


def test_what_the_cpu_adds_to_a_decoders_activations_is_not_counted_on_a_gpu():
    from mpifl.cli.plan import estimate

    size, cpu = estimate(load_config(ROOT / "configs" / "gpt2.yaml"), 3, 4, False)
    _, gpu = estimate(load_config(ROOT / "configs" / "gpt2.yaml", ["train.device=cuda"]), 3, 4, False, 1)
    assert size.cpu_activations > size.activations > 0
    assert gpu.client_device_bytes < cpu.client_bytes and size.cpu_activations < gpu.client_device_bytes


def test_cpu_decoder_extra_bytes_counts_gelu_new_dropout_logit_gradients_and_the_heap():
    from mpifl.planning.memory import DecoderShape, cpu_decoder_extra_bytes, decoder_activation_bytes

    gpt2 = DecoderShape(hidden=768, intermediate=3072, layers=12, heads=12, vocab=50257)
    assert cpu_decoder_extra_bytes(gpt2, 4, 128, 2, False) == 4 * 128 * 50257 * 12 + int(
        0.4 * (decoder_activation_bytes(gpt2, 4, 128, 2, False) + 4 * 128 * 50257 * 12))
    full = dataclasses.replace(gpt2, dropout=True, composed_gelu=True)
    per_layer = 4 * 128 * (3 * 3072 * 2 + 2 * 3 * 768) + 12 * 4 * 12 * 128 * 128  # 22,992 + 18,432 B a token
    assert per_layer == 4 * 128 * (23040 + 18432)
    added = cpu_decoder_extra_bytes(full, 4, 128, 2, False) - cpu_decoder_extra_bytes(gpt2, 4, 128, 2, False)
    assert abs(added - 12 * per_layer * 1.4) <= 1  # held in every layer, and 0.4 of it kept by the heap


def test_a_bad_rates_file_is_refused_before_anything_is_printed_as_a_bad_option_is(tmp_path):
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    (tmp_path / "broken.json").write_text("{not json")
    for rates, said in (("bogus", "'bogus' is neither a preset (polaris, lustre) nor a JSON file"),
                        (str(tmp_path / "broken.json"), "broken.json: Expecting property name")):
        refused = mpifl_here("plan", quickstart, "--time", "--rates", rates)
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout
        assert "argument --rates: " in refused.stderr and said in refused.stderr, refused.stderr
