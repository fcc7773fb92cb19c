"""The memory model: bytes per rank and on the fullest node, for a config, before anything is allocated.

One source of truth. The server's receive pool is sized by the same functions the running
server calls (``planning.pools``); the rest is the model, the strategy's server state, the
out-of-core window, the server's held-out evaluation (``evaluation_bytes``) and, on client ranks, the training
state and activations where they are estimated. ``mpifl plan``, ``mpifl pbs`` and the tests that compare a plan
with what a run allocates all use ``memory_estimate``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mpifl.config import Config
from mpifl.config.client_state import ClientStateLayout, StateSizes
from mpifl.planning.federation import clients_of_rank, even_spread, most_trained_per_rank
from mpifl.planning.out_of_core import STATE_ITEMSIZE, out_of_core_bytes
from mpifl.planning.pools import FloorProbe, PoolShape, floor_probe_dtype, holds_stacks, pool_bytes, pool_layout
from mpifl.units import GIB, MIB, format_bytes
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import itemsize

# Calibrated on the quick start (tests/test_mpi_memory_model.py: within 15% + 64 MiB of its measured peaks):
IMPORTS_BYTES = int(0.27 * GIB)  # torch + mpi4py + h5py per rank: its server peaks at 0.264 GiB (torch 2.13, CPU)
# a training rank's autograd engine, optimizer and per-step scratch beyond its tensors: its clients peak at
# 0.335-0.39 GiB against the server's 0.264
TRAINING_RUNTIME_BYTES = int(0.09 * GIB)
# What importing a model family's library adds to every rank that builds the model (the server builds it on the
# meta device for its layout): transformers 5.24 with its Llama modeling code, scipy and PIL brought in with it,
# measured as VmHWM on torch 2.13 (CPU), 403 MiB against 254 MiB without (2026-11-29).
LIBRARY_IMPORT_BYTES = {"transformers": 149 * MIB}
# What reading a table (data.dataset: table, Parquet or saved Arrow files) adds to every rank that reads it: pyarrow
# 26.0.1 with its parquet and compute modules imported (37 MiB) and the reader's buffers after a survey and one
# rank's read (16 MiB): VmHWM of one process, 321 MiB against 268 MiB with torch, mpi4py and h5py alone, on the
# walkthrough's 500-row table (2026-12-01, torch 2.13 CPU). From a client source every rank reads (the server
# surveys and reads the held-out set); a table read whole is read by rank 1 only.
TABLE_READER_BYTES = 53 * MIB
# A classifier with convolutions, scored on the CPU (VmHWM of one process scoring LeNet on 10,000 Fashion-MNIST-
# shaped samples, torch 2.13 CPU with oneDNN, 2026-12-01): the first convolution maps ATen's and oneDNN's kernels
# and their caches, 25.9 MiB on a batch of 1 sample (16.1 MiB with oneDNN off), whatever the batch;
CONV_KERNELS_BYTES = 26 * MIB
# and a batch of B samples then held about B x 62 KiB beside that (+5, +31 and +129 MiB at B = 64, 512 and 2,048)
# where a leaf's output and the next's came to 17 KiB a sample (conv1's 13.5 and the pooling's 3.4) and the input to
# 3 KiB: a convolution's output is held about 4 times (in oneDNN's blocked layout, channels padded; its plain copy;
# the functional ReLU's output; freed batches the allocator keeps). Fitted to those three batches: 4 copies and
# CONV_KERNELS_BYTES give +30, +56 and +147 MiB, the leaf outputs once +27, +36 and +66 MiB.
CONV_OUTPUT_COPIES = 4
# A client rank that trains on a GPU, calibrated on one H100 (torch 2.11.0+cu130, deterministic kernels; the GPU
# check of 2026-11-27 in docs/how-to/gpus.md):
CUDA_WORKSPACE_BYTES = 64 * MIB  # cuBLAS's workspaces, allocated by torch: the quick start's MLP, whose tensors
# take 0.3 MiB on the device, peaked at 65 MiB
CUDA_HOST_BYTES = int(0.84 * GIB)  # the CUDA runtime and libraries mapped on the host: the LEAF CNN's client rank
# peaked at 1,409 MiB resident on the GPU machine against 551 MiB training on the CPU (cuDNN loaded)


class StrategyFootprint(Protocol):
    """What the memory model needs to know of a strategy (mpifl.aggregation's Strategy has it)."""

    @property
    def stacked(self) -> bool:
        """Whether it keeps every participant's chunk (a robust stack) rather than a running sum."""

    def accumulator_rows(self, participants: int) -> int:
        """fp32 accumulator rows per chunk for ``participants`` participants."""

    def state_bytes(self, elements: int) -> int:
        """Bytes of server state for a model of ``elements`` exchanged elements."""

    @property
    def whole_update(self) -> bool:
        """Whether it keeps every participant's whole update for the round (Krum, the geometric median)."""


@dataclass(frozen=True)
class ModelBytes:
    """The configured model's size, from a meta-device build (nothing allocated)."""

    exchanged: int  # what travels, is reduced and checkpointed
    frozen: int  # frozen parameters: on every rank that builds the model, never on the wire
    parameters: int  # element count, exchanged and frozen (SCAFFOLD's control variates not counted)
    control: int = 0  # bytes of SCAFFOLD's control section, part of ``exchanged``
    local: int = 0  # bytes of the model.local tensors, part of ``frozen`` (they never travel)
    largest: int = 0  # bytes of the largest tensor that trains (0: unknown, count every gradient)
    trainable: int = 0  # elements of the parameters that travel: FedDyn's g_i (0: unknown, count all exchanged)
    largest_unit: int = 0  # bytes of the largest group of tensors FSDP gathers at once (fsdp_units; 0: unknown)
    gathered_unit: tuple[int, int] = (0, 0)  # the unit held whole in training: bytes, gradients' bytes (gathered_unit)
    activations: int = 0  # bytes of one micro-batch's activations on one rank (0: not estimated)
    cpu_activations: int = 0  # what training on a CPU adds to them (cpu_decoder_extra_bytes; 0: not estimated)
    evaluation: int = 0  # bytes one held-out batch works with beside the model (0: not estimated)
    evaluation_batch: int = 0  # its samples: eval.batch_size, or the held-out set where that is smaller

    @property
    def total(self) -> int:
        """Bytes of the whole model, exchanged and frozen."""
        return self.exchanged + self.frozen


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank and on the fullest node; ``server_pool_bytes`` is the receive pool inside ``server_bytes``."""

    model_bytes: int
    server_bytes: int
    server_pool_bytes: int
    client_bytes: int
    node_bytes: int  # the fullest node
    server_data_bytes: int = 0  # the data inside server_bytes (0: not counted)
    client_data_bytes: int = 0  # the data inside client_bytes
    node_data_bytes: int = 0  # the shared set, once per node with client ranks (inside node_bytes)
    client_device_bytes: int = 0  # GPU memory per client rank that trains on a GPU (0: it trains on the CPU)
    server_device_bytes: int = 0  # the server's evaluation copy on its GPU (eval.device; 0: it evaluates on the CPU)
    update_wire_bytes: int = 0  # one update (or a group's sum) as it travels: narrowed, compressed or fp32 sums
    server_eval_bytes: int = 0  # the held-out evaluation's working set, inside server_bytes or server_device_bytes
    reader_bytes: int = 0  # rank 1, which reads the shared data: its peak, when above client_bytes (0: not above)
    reading_bytes: int = 0  # its peak while reading (reading_rank_bytes), inside reader_bytes when that is set
    client_shared_bytes: int = 0  # the shared set's pages inside client_data_bytes (counted once, in node_data_bytes)
    kept_updates_bytes: int = 0  # a whole-update rule's kept updates (Krum, geometric median): RAM or a temporary file
    kept_on_disk: bool = False  # whether they go to the temporary file (else they are inside server_bytes)

    @property
    def reads_apart(self) -> bool:
        """Whether rank 1, which reads the shared data, is shown apart from the other client ranks: where its figure,
        as printed (to 0.01 GiB), is above theirs."""
        return round(self.reader_bytes / GIB, 2) > round(self.client_bytes / GIB, 2)

    def describe(self, exchanged: str = "model") -> str:
        """One line for a job script's comment and the ``pbs`` command's output; ``exchanged`` names what
        ``model_bytes`` counts (``exchanged_what``)."""
        gpu = f", GPU ~{self.client_device_bytes / GIB:.2f} GiB" if self.client_device_bytes else ""
        if self.server_device_bytes:
            gpu += f"; server's GPU ~{self.server_device_bytes / GIB:.2f} GiB"
        reader = f" (rank 1, reading the data, ~{self.reader_bytes / GIB:.2f} GiB)" if self.reads_apart else ""
        return (f"{exchanged} {format_bytes(self.model_bytes)}; server ~{self.server_bytes / GIB:.2f} GiB, "
                f"client rank ~{self.client_bytes / GIB:.2f} GiB{reader}{gpu}; fullest node "
                f"~{self.node_bytes / GIB:.1f} GiB")


def exchanged_what(cfg: Config) -> str:
    """What the exchanged bytes are, in a one-line summary: the whole model, or only the tensors that train where
    frozen ones stay put (LoRA adapters, ``model.trainable``), so that 250 MiB is not read as a 70 B model's size."""
    if cfg.model.exchange == "all":
        return "model"
    if cfg.model.lora.r:
        return "exchanged (adapters)"
    return "exchanged (model.trainable)" if cfg.model.trainable else "model"


@dataclass(frozen=True)
class DataBytes:
    """The data's bytes, as the ranks hold them: the training inputs, their labels, the held-out set."""

    inputs: int  # every training input
    labels: int  # every training label (the server partitions and samples from them, every rank places clients)
    test: int  # the held-out inputs and labels
    per_rank: bool  # a client source: each client rank reads only its own clients' inputs
    noisy_copy: int = 0  # data.feature_noise: one float32 copy of the held-out inputs, scored level by level
    test_rows: int = 0  # held-out samples (token blocks for text): a batch of evaluation holds at most this many
    train_rows: int = 0  # training samples: with ``inputs``, a sample's bytes (0: unknown, every page counts)
    reader: int = 0  # what the reading library adds to each rank that reads the data (TABLE_READER_BYTES)


def server_data_bytes(data: DataBytes) -> int:
    """The server holds the labels and the held-out set, never the training inputs (roles.data.server_view), and
    with feature noise one noisy copy of the held-out inputs at a time (mpifl.learning.noise.score_over_levels);
    from a client source it reads them itself, with the reading library (``data.reader``)."""
    return data.labels + data.test + data.noisy_copy + (data.reader if data.per_rank else 0)


def client_data_bytes(data: DataBytes, client_ranks: int, per_round: bool) -> int:
    """What a client rank's resident memory holds of the data. From a client source: every label and its own
    clients' inputs, with the reading library (``data.reader``). Otherwise the pages of the shared set that it
    maps (``client_shared_bytes``; the set lies once per node in shared memory, ``node_data_bytes``), plus a copy of
    its clients' samples sliced out once (clients.placement per_round: it copies one client only while it
    trains)."""
    share = math.ceil((data.inputs + data.labels) / max(1, client_ranks))
    if data.per_rank:
        return data.labels + share + data.reader
    return client_shared_bytes(data, client_ranks, per_round) + (0 if per_round else share)


# The kernel maps a file page that faults in for reading together with the cached pages around it, in aligned
# windows of fault_around_bytes (64 KiB unless changed in debugfs); the shared set's windows are shared memory that
# rank 1 wrote, so every page of them is cached (``mapped_inputs_bytes``).
FAULT_AROUND_BYTES = 64 * 1024


def mapped_inputs_bytes(inputs: int, rows: int, ranks: int) -> int:
    """Bytes of the shared training inputs a client rank maps when it reads its 1/``ranks`` of the ``rows``
    samples, scattered over the set (every partition but a client source's), sample by sample: a fault-around
    window is mapped whole when any of the W / row + 1 samples it overlaps is read, so a fraction
    1 - (1 - 1/ranks)^(W / row + 1) of the windows (``FAULT_AROUND_BYTES`` W), not 1/ranks of the set.

    Why: Fashion-MNIST's 3,136-byte images are 21 to a window, so a client rank of 3 maps the whole training set.
    Measured (docs/explanation/memory.md#a-client-rank): in `mpiexec -n 4 mpifl run configs/fashion_mnist.yaml`
    ranks 2-3 held 186 MiB of shared memory (RssShmem) for their 57-59 MiB of samples, and peaked at 635-638 MiB
    against 0.48 GiB planned with 1/3 of the set; reading 1/3, 1/10, 1/30 and 1/100 of 60,000 such rows out of a
    written /dev/shm file mapped 179, 161, 94 and 35 MiB, as this gives (179, 161, 93, 36). MADV_RANDOM changes
    none of it. ``rows`` 0 (unknown): every page."""
    if rows <= 0 or ranks <= 1:
        return inputs
    samples = FAULT_AROUND_BYTES / (inputs / rows) + 1  # the samples a window overlaps
    return min(inputs, math.ceil(inputs * (1 - (1 - 1 / ranks) ** samples)))


def client_shared_bytes(data: DataBytes, client_ranks: int, per_round: bool) -> int:
    """The pages of the node's shared set a client rank maps (inside ``client_data_bytes``, counted once per node
    in ``node_data_bytes``): every label (each rank partitions them), and the training inputs' pages around its
    clients' samples (``mapped_inputs_bytes``); with clients.placement per_round, every client's over a run. 0 from
    a client source."""
    if data.per_rank:
        return 0
    if per_round:
        return data.inputs + data.labels
    return data.labels + mapped_inputs_bytes(data.inputs, data.train_rows, client_ranks)


def node_data_bytes(data: DataBytes) -> int:
    """The shared set, once on each node that has client ranks (wire.shared); nothing from a client source."""
    return 0 if data.per_rank else data.inputs + data.labels + data.test


def reading_rank_bytes(started: int, data: DataBytes) -> int:
    """Rank 1's peak while it reads the data and shares it (roles.data): what it holds once ``started`` (libraries,
    and the torch._dynamo that a client rank's throwaway optimizer imports first), the reading library
    (``data.reader``), and the data twice, the tensors
    as read and their copy in the node's shared windows, every page of which it writes. 0 from a client source
    (each client rank reads its own clients').

    Why its own term: no other rank holds the data twice, and the twice is 2 x 210 MiB for Fashion-MNIST against a
    client rank's 0.54 GiB. Measured as VmHWM (docs/explanation/memory.md#rank-1-which-reads-the-data): on Fashion-MNIST
    at 4 ranks, rank 1 peaked at 773 MiB while reading (this gives 788 MiB), ranks 2-3 at 404 MiB; before its bytes
    went straight into the shared windows (a pickled broadcast, even to rank 1 itself), at 1,191 MiB."""
    return 0 if data.per_rank else started + data.reader + 2 * node_data_bytes(data)


def streams_per_rank(cfg: Config, client_ranks: int) -> int:
    """The most update streams one client rank sends per round: participants (``most_trained_per_rank``), or groups
    with clients.groups. A rank that sends several makes the server's accumulator window span the whole model
    (planning.pools), so the memory plan counts this worst case."""
    if cfg.clients.groups:
        return math.ceil(cfg.clients.groups / max(1, client_ranks))
    return most_trained_per_rank(cfg.clients, client_ranks)


def sending_ranks(cfg: Config, client_ranks: int) -> int:
    """How many ranks the server receives from in a full round (the chain: only its last rank)."""
    if cfg.clients.groups and cfg.transport.reduce == "chain":
        return 1
    return min(client_ranks, cfg.clients.groups or cfg.clients_per_round())


def server_pool_bytes(cfg: Config, exchange: ExchangeLayout, strategy: StrategyFootprint, client_ranks: int) -> int:
    """The receive pool of a full round, sized by planning.pools exactly as the server sizes it."""
    ranks = sending_ranks(cfg, client_ranks)
    per_rank = 1 if cfg.clients.groups and cfg.transport.reduce == "chain" else streams_per_rank(cfg, client_ranks)
    rows = strategy.accumulator_rows(cfg.clients_per_round()) if strategy.stacked else 1
    shape = PoolShape.of(exchange, rows)
    configured = int(cfg.transport.pool_mb * MIB)
    budget = configured if cfg.server.state == "disk" else min(configured, exchange.spec.total_bytes // 4)
    summed = cfg.privacy.mode == "central" or cfg.secagg.enabled
    held = holds_stacks(strategy.stacked, exchange.codec is not None, summed, per_rank)
    layout = pool_layout(shape, budget, ranks, stacked=strategy.stacked, held=held, sequential=per_rank > 1)
    return pool_bytes(shape, layout, ranks)


KEPT_UPDATES_RAM_BYTES = 256 * MIB  # a whole-update rule keeps the round's updates in RAM up to this, else in a file


def kept_updates_bytes(cfg: Config, elements: int) -> tuple[int, bool]:
    """What a whole-update rule (Krum, the geometric median: mpifl.aggregation.distances) keeps each step, fp32
    rows of every participant's update, and whether in a temporary file (past ``KEPT_UPDATES_RAM_BYTES``, or on an
    out-of-core server) rather than RAM."""
    nbytes = cfg.updates_per_step() * elements * 4
    return nbytes, cfg.server.state == "disk" or nbytes > KEPT_UPDATES_RAM_BYTES


def server_evaluates(cfg: Config) -> bool:
    """Whether rank 0 scores the global model on the held-out set (``eval.every``); a server that keeps the model
    out of core (``server.state: disk``) holds no module to score."""
    return cfg.eval.every > 0 and cfg.server.state == "memory"


def evaluates_on_gpu(cfg: Config, gpus_per_node: int) -> bool:
    """Whether the server's evaluation runs on its GPU: ``eval.device`` cuda, or auto on nodes with GPUs."""
    return cfg.eval.device == "cuda" or (cfg.eval.device == "auto" and gpus_per_node > 0)


def server_device_bytes(cfg: Config, size: ModelBytes, gpus_per_node: int) -> int:
    """GPU memory of the server's evaluation copy (``eval.device`` cuda, or auto on nodes with GPUs): the whole
    model and one held-out batch's working set (``size.evaluation``); 0 where the server evaluates on the CPU,
    never evaluates, or keeps the model out of core."""
    on_gpu = server_evaluates(cfg) and evaluates_on_gpu(cfg, gpus_per_node)
    return size.total + size.evaluation if on_gpu else 0


def server_evaluation_bytes(cfg: Config, size: ModelBytes) -> int:
    """The held-out evaluation's working set on rank 0, wherever it runs (0 where the server never evaluates). It
    is counted on top of the pool and state, which stay allocated between rounds: gpt2.yaml's server peaked at
    1,997 MiB with eval.every 1 against 968 MiB with 0 (docs/explanation/memory.md)."""
    return size.evaluation if server_evaluates(cfg) else 0


def client_evaluation_bytes(cfg: Config, size: ModelBytes) -> int:
    """What a client rank's federated evaluation (``eval.federated_every``) works with, held-out batch by batch,
    before it trains: the training activations are not allocated yet, so a rank holds the larger of the two, not
    both (``replicated_activations``)."""
    return size.evaluation if cfg.eval.federated_every > 0 else 0


def trains_on_gpu(cfg: Config, gpus_per_node: int) -> bool:
    """Whether a client rank trains a device replica on a GPU: ``cuda``, or ``auto`` on nodes with GPUs
    unless the replica is off (``train.device_copy: false``)."""
    if cfg.train.trainer == "none" or cfg.train.device_copy is False:
        return False
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and gpus_per_node > 0)


def optimizer_states(cfg: Config) -> int:
    """Tensors of optimizer state per trained tensor: SGD's momentum buffer, Adam's two moments."""
    return {"sgd": 1 if cfg.train.momentum else 0, "adam": 2, "adamw": 2}[cfg.train.optimizer]


def batched_lanes_bytes(cfg: Config, size: ModelBytes) -> int:
    """What training K clients as lanes of one batched model holds (``train.batched_clients``,
    mpifl.learning.batched): per lane, its weights, their gradients, a copy of them while the lane is frozen (the
    last steps freeze all lanes but the longest), its optimizer state, and its micro-batch's activations twice
    (saved for backward, and their gradients). ``size.activations``: one lane's micro-batch (0: not estimated).
    Measured at K = 2,000 (docs/how-to/batched-clients.md): the cross-device LEAF CNN peaked at 48.7 GiB of an
    H200 against 51.1 GiB planned; the quick start's MLP (momentum 0.9) at 718 MiB of the GPU against 814 MiB
    planned, and at 1.15 GiB of a CPU rank's RSS against 1.10 GiB."""
    trained = size.exchanged - size.control + size.local
    return cfg.train.batched_clients * ((3 + optimizer_states(cfg)) * trained + 2 * size.activations)


def training_state_bytes(cfg: Config, size: ModelBytes) -> int:
    """What training adds beside the model where it trains: gradients, optimizer state, fp32 master copies of
    narrow weights, DDP's gradient buckets; with batched clients, the lanes (``batched_lanes_bytes``)."""
    if cfg.train.trainer == "none":
        return 0
    if cfg.train.batched_clients:
        return batched_lanes_bytes(cfg, size)
    width = itemsize(cfg.model.dtype)
    elements = size.exchanged // width
    trained = size.exchanged - size.control + size.local  # SCAFFOLD's c never trains; model.local tensors do
    states = optimizer_states(cfg)
    masters = cfg.train.trainer == "causal_lm" and width < 4  # fp32 master weights and their gradients
    # gradients: every trained tensor's, or with steps inside backward the largest one's (each is freed as soon as
    # its parameter stepped)
    gradients = size.largest if cfg.steps_inside_backward() and size.largest else trained
    state = gradients + (8 * elements if masters else 0) + states * (4 * elements if masters else trained)
    if cfg.clients.ranks_per_client > 1 and cfg.clients.sharding == "replicate":
        state += trained  # DDP's gradient buckets (clients.ranks_per_client)
    return state


def fsdp_unit(name: str) -> str:
    """The FSDP unit a tensor lies in, as ``mpifl.learning.sharding.sharded_units`` forms them: a numbered block (the
    name up to its first numeric part: ``model.layers.3``), else its own module (the embeddings, the head, a norm)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def largest_fsdp_unit(tensors: Iterable[tuple[str, int]]) -> int:
    """Bytes of the largest FSDP unit among (name, bytes) tensors: what a sharded rank gathers whole at once."""
    units: dict[str, int] = {}
    for name, nbytes in tensors:
        units[fsdp_unit(name)] = units.get(fsdp_unit(name), 0) + nbytes
    return max(units.values(), default=0)


def gathered_unit(tensors: Iterable[tuple[str, int, bool]]) -> tuple[int, int]:
    """The FSDP unit that takes the most memory while it trains, among (name, bytes, trains) tensors: its bytes, and
    its gradients' bytes. A rank gathers a unit whole, and in backward its trained tensors' unsharded gradients lie
    beside it; a frozen unit (the embedding under LoRA) has none, so it counts once, not twice."""
    units: dict[str, tuple[int, int]] = {}
    for name, nbytes, trains in tensors:
        held, gradients = units.get(fsdp_unit(name), (0, 0))
        units[fsdp_unit(name)] = held + nbytes, gradients + (nbytes if trains else 0)
    return max(units.values(), key=sum, default=(0, 0))


@dataclass(frozen=True)
class DecoderShape:
    """What a transformer decoder's activations scale with (from its transformers config)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    dropout: bool = False  # dropout in training (GPT-2's attn_pdrop, resid_pdrop): the CPU keeps more (below)
    composed_gelu: bool = False  # an activation written as several torch ops (GPT-2's gelu_new), each saving its input


# Bytes a decoder keeps for backward, per element of what it scales with (``decoder_activation_bytes``), measured on
# CPU with transformers 5.24's default attention (torch's scaled_dot_product_attention), fp32, AdamW, one dimension
# varied at a time (batch, layers, vocabulary, sequence length; profiling/sharded_client.py checks the sum): per token
# and layer about 4 hidden-wide and 2.5 intermediate-wide values (the norms' and projections' inputs, the MLP's gate
# and up: 11 KiB a token-layer at 256 wide); per score of the attention matrix (heads x seq x seq per sample and
# layer) about 2 values; per logit the model's own value and 6 bytes more (10.2 bytes a logit in fp32: its fp32 copy
# for the loss and that copy's gradient, partly reusing freed memory).
HIDDEN_VALUES, INTERMEDIATE_VALUES, SCORE_VALUES, LOGIT_EXTRA_BYTES = 4.0, 2.5, 2.0, 6
def decoder_activation_bytes(shape: DecoderShape, batch: int, seq: int, width: int, checkpointing: bool) -> int:
    """One micro-batch's activations held for backward on one rank: per layer the hidden- and intermediate-wide
    values of every token and the attention scores, then the logits (the constants above, after the accounting
    of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1). With
    gradient checkpointing a layer keeps only its input, and one layer is recomputed at a time. Fused attention
    kernels (flash attention on GPUs) keep no score matrix, so there it overestimates."""
    tokens = batch * seq
    layer = int(tokens * (HIDDEN_VALUES * shape.hidden + INTERMEDIATE_VALUES * shape.intermediate) * width
                + SCORE_VALUES * batch * shape.heads * seq * seq * width)
    logits = tokens * shape.vocab * (width + LOGIT_EXTRA_BYTES)
    if checkpointing:
        return shape.layers * tokens * shape.hidden * width + layer + logits
    return shape.layers * layer + logits


# What a decoder that trains on a CPU holds beyond decoder_activation_bytes, measured on GPT-2 (bf16, transformers
# 5.24, torch 2.13, CPU) by summing the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks) at 1 and 3
# layers, and from peak RSS over a forward and backward at batch 4 and 8 (docs/explanation/memory.md#a-client-rank):
# - an activation written as several torch ops (transformers' NewGELUActivation, GPT-2's gelu_new) saves 3 more
#   intermediate-wide values a token and layer (46,136 against 27,704 bytes with the fused gelu, at 768 wide);
# - dropout (0.1 on GPT-2's attention and residuals) adds 22,992 bytes a token and layer: 12 bytes an attention
#   score (the CPU's scaled_dot_product_attention falls back to its math path and keeps its scores, softmax and mask)
#   and, per hidden value, each of the two residual dropouts' mask and output (2 x (1 + width) bytes);
# - backward's peak: the loss's fp32 gradients of the logits (its log-softmax's, the softmax it recomputes, the
#   upcast's narrow one) come on top of what is held, 12 bytes a logit (11-13 measured at batch 4 and 8);
# - glibc's heap keeps freed activations in fragments, so a rank's peak grows with each micro-batch and round:
#   GPT-2's LoRA client rose 1,756 -> 1,955 MiB within its first round and reached 2,170 MiB by round 5, 0.4 of the
#   activations counted (CPU_RETAINED_SHARE).
# An H100 showed none of it (configs/gpt2.yaml's client peaked at 3,000 MiB of the GPU against 2.96 GiB planned
# without these terms: fused attention and loss kernels, and a caching allocator), so only ranks that train on the
# CPU count it.
COMPOSED_GELU_VALUES, DROPOUT_SCORE_BYTES, LOGIT_BACKWARD_BYTES, CPU_RETAINED_SHARE = 3, 12, 12, 0.4


def cpu_decoder_extra_bytes(shape: DecoderShape, batch: int, seq: int, width: int, checkpointing: bool) -> int:
    """What one micro-batch of a decoder adds on a rank that trains on the CPU, beyond
    ``decoder_activation_bytes``: a composed activation's and dropout's saved values in every layer that keeps
    them (one with gradient checkpointing), the logits' fp32 gradients in backward, and what the heap keeps of
    the freed activations (the constants above, and why)."""
    tokens = batch * seq
    per_layer = tokens * (COMPOSED_GELU_VALUES * shape.intermediate * width if shape.composed_gelu else 0)
    if shape.dropout:
        per_layer += DROPOUT_SCORE_BYTES * batch * shape.heads * seq * seq + 2 * (1 + width) * tokens * shape.hidden
    layers = 1 if checkpointing else shape.layers
    held = decoder_activation_bytes(shape, batch, seq, width, checkpointing) + layers * per_layer
    backward = tokens * shape.vocab * LOGIT_BACKWARD_BYTES
    return layers * per_layer + backward + int(CPU_RETAINED_SHARE * (held + backward))


# A held-out batch's logits, per logit, beside the model's own value (``decoder_evaluation_bytes``): transformers'
# causal-LM loss (loss_utils.ForCausalLMLoss) upcasts them to fp32 (a copy where the model is narrower) and
# cross_entropy's log-softmax writes another fp32 tensor of the same size. Measured on gpt2.yaml (bf16, 16 x 128 x
# 50,257 logits, 982 MiB by this count): the server peaked 1,029 MiB higher with evaluation than without.
LOGIT_LOSS_BYTES = 4


def decoder_evaluation_bytes(shape: DecoderShape, batch: int, seq: int, width: int) -> int:
    """One held-out batch's working set under no_grad (mpifl.learning.trainers.evaluate_language_model): the
    logits, their fp32 copy for the loss where the model is narrower than fp32, the loss's fp32 log-softmax, and
    one layer's values at a time (nothing is kept for backward, so the layers do not add up)."""
    tokens = batch * seq
    logits = tokens * shape.vocab * (width + LOGIT_LOSS_BYTES + (4 if width < 4 else 0))
    layer = int(tokens * (HIDDEN_VALUES * shape.hidden + INTERMEDIATE_VALUES * shape.intermediate) * width
                + SCORE_VALUES * batch * shape.heads * seq * seq * width)
    return logits + layer


def classifier_evaluation_bytes(inputs: int, outputs: Sequence[int], width: int,
                                convolutions: Sequence[bool] = ()) -> int:
    """One held-out batch's working set for a classifier under no_grad (mpifl.learning.trainers.evaluate): its
    inputs (``inputs`` bytes, a copy where they are cast), a leaf module's input and output at a time (``outputs``:
    every leaf's output bytes in forward order, ``width`` bytes an element; nothing is kept for backward), and the
    loss's fp32 log-softmax of the last output, the logits. A convolution's output (``convolutions``: which leaves
    are) counts CONV_OUTPUT_COPIES times, and a model with any, CONV_KERNELS_BYTES once."""
    if not outputs:
        return 0
    conv = [*convolutions, *[False] * (len(outputs) - len(convolutions))]
    held = [n * CONV_OUTPUT_COPIES if c else n for n, c in zip(outputs, conv)]
    pairs = [a + b for a, b in zip(held, held[1:])] or list(held)
    kernels = CONV_KERNELS_BYTES if any(convolutions) else 0
    return inputs + max(pairs) + 4 * (outputs[-1] // width) + kernels


def share(nbytes: int, parts: int) -> int:
    """A rank's share of ``nbytes`` split over ``parts`` ranks (rounded up)."""
    return -(-nbytes // parts)


def sharded_training_bytes(cfg: Config, size: ModelBytes, parts: int) -> int:
    """What a rank of a sharded group (``clients.sharding: fsdp``) trains with, where it trains: its 1/R of the
    model, of the gradients and of the optimizer state; the FSDP unit gathered whole that takes the most (its
    parameters, and in backward the unsharded gradients of those that train: ``gathered_unit``); one micro-batch's
    activations on its share of the batch (``size.activations``, which the caller works out for the same R); and its
    rows of what a client half holds while a client trains (``state_rule_bytes``: SCAFFOLD's correction, FedDyn's
    g_i, Ditto's zero term).
    SCAFFOLD's control deltas are formed after training, once the activations are freed, so the larger of the two
    counts, not both: with both, a 168 M-parameter Llama's plan was 11% over its measured peak at R = 2."""
    held = share(size.total, parts)
    if cfg.train.trainer == "none":
        return held
    during = share(state_rule_bytes(cfg, size) - size.control, parts)  # the half's vectors while a client trains
    deltas = share(size.control, parts)  # SCAFFOLD's control deltas, after training
    return (held + share(training_state_bytes(cfg, size), parts) + sum(size.gathered_unit) + during
            + max(size.activations, deltas))


def sharded_client_bytes(cfg: Config, size: ModelBytes, on_gpu: bool = False, groups: int = 1) -> int:
    """A rank of a sharded client group (mpifl.roles.sharded), in host memory: what it trains with
    (``sharded_training_bytes``) and the round's global rows of its 1/R, unless they live on its GPU (then the CUDA
    libraries, and the block its initialisation makes whole), the chunk ring with the leader's gathered chunk, and
    its rows of its clients' state (``sharded_state_bytes``; ``groups``: the run's client groups)."""
    parts = cfg.clients.ranks_per_client
    client = imports_bytes(cfg)
    if on_gpu:  # the shards are initialised on the GPU from one block made whole on the host at a time
        client += CUDA_HOST_BYTES + size.largest_unit
    else:
        client += sharded_training_bytes(cfg, size, parts) + share(size.exchanged, parts)  # and the global rows
    if cfg.train.trainer != "none":
        client += TRAINING_RUNTIME_BYTES
    # every rank's ring slots and the leader's gathered chunk are the widest chunk, which is the whole exchanged
    # model where that is smaller than transport.chunk_mb (C, at most S): a 545 KiB model's ring is not 6 x 16 MiB
    chunk = min(cfg.transport.chunk_bytes, size.exchanged)
    ring = (cfg.transport.inflight + 2) * chunk
    if cfg.compression.method != "none":  # one chunk widened to fp32, the pieces gathered or scattered, this
        # rank's residual rows (3 x fp32), and the leader's ring of encoded chunks (no larger than a chunk)
        ring += 12 * (chunk // itemsize(cfg.model.dtype)) + (cfg.transport.inflight + 1) * chunk
    return client + ring + sharded_state_bytes(cfg, size, groups)


def sharded_state_bytes(cfg: Config, size: ModelBytes, groups: int) -> int:
    """A rank of a sharded group's per-client state in host memory (mpifl.roles.sharded_state): its rows, 1/R, of
    its group's clients' vectors while they fit the state's RAM budget (else they are on disk), and of the copies
    the put-back of dropped clients keeps through a round."""
    state = cfg.client_state()
    if state is None:
        return 0
    parts = cfg.clients.ranks_per_client
    hosted = -(-cfg.clients.num_clients // max(1, groups))
    kept = 4 * hosted * client_state_elements(cfg, size)
    return (kept if kept <= state.ram_mb * MIB else 0) + \
        4 * share(journaled_elements(cfg, size), parts) * undo_vectors(cfg, groups)


def client_device_bytes(cfg: Config, size: ModelBytes) -> int:
    """GPU memory of a client rank that trains on a GPU (mpifl.learning.device.DeviceReplica): the replica, the
    round's global model kept to reset it, the training state, what per-client state's rules hold while a client
    trains, a group's fp32 sum, cuBLAS's workspaces, and the activations where they are estimated
    (``replicated_activations``); not cuDNN's workspace. A rank of a sharded group: its share
    (``sharded_training_bytes``, activations included) and cuBLAS's workspaces."""
    if cfg.clients.sharding == "fsdp":  # its share, and the global rows of it
        parts = cfg.clients.ranks_per_client
        return sharded_training_bytes(cfg, size, parts) + share(size.exchanged, parts) + CUDA_WORKSPACE_BYTES
    elements = size.exchanged // itemsize(cfg.model.dtype)
    group_sum = 4 * elements if cfg.clients.groups else 0
    return (size.total + size.exchanged + training_state_bytes(cfg, size) + group_sum + CUDA_WORKSPACE_BYTES
            + state_rule_bytes(cfg, size) + client_working_set(cfg, size))


def replicated_activations(cfg: Config, size: ModelBytes) -> int:
    """The activations a client rank that holds the whole model keeps for backward, where the plan estimates them
    (``size.activations``: a transformers decoder under the causal_lm trainer); batched lanes count their own."""
    return 0 if cfg.train.batched_clients or cfg.train.trainer == "none" else size.activations


def host_activations(cfg: Config, size: ModelBytes) -> int:
    """The activations of a replicated client rank that trains on the CPU: ``replicated_activations`` and what the
    CPU adds to them (``size.cpu_activations``: ``cpu_decoder_extra_bytes``)."""
    acts = replicated_activations(cfg, size)
    return acts + size.cpu_activations if acts else 0


def client_working_set(cfg: Config, size: ModelBytes, on_cpu: bool = False) -> int:
    """The larger of a replicated client rank's training activations (``on_cpu``: with what the CPU adds,
    ``host_activations``) and its federated evaluation's working set: it scores the model it received before it
    trains, so the two never coexist."""
    acts = host_activations(cfg, size) if on_cpu else replicated_activations(cfg, size)
    return max(acts, client_evaluation_bytes(cfg, size))


def state_rule_bytes(cfg: Config, size: ModelBytes) -> int:
    """What per-client state's rules hold beside the model that trains, on its device, while a client trains: a
    client half's vector (FedDyn's g_i, SCAFFOLD's correction c - c_i), its summed streams' share of the update
    before it is kept (SCAFFOLD's control deltas), Ditto's zero linear term (fp32 per trainable element)
    (mpifl.algorithms)."""
    held = 4 * rule_vector_elements(cfg, size) if cfg.client_rule else 0
    if cfg.train.ditto_lambda:
        held += 4 * (size.exchanged // itemsize(cfg.model.dtype))
    return held + size.control


def imports_bytes(cfg: Config) -> int:
    """What a rank holds once its libraries are imported: torch, mpi4py and h5py, and the model family's library
    where it builds the model from one (LIBRARY_IMPORT_BYTES)."""
    return IMPORTS_BYTES + LIBRARY_IMPORT_BYTES.get(cfg.model.name, 0)


def widening_scratch_bytes(cfg: Config, exchange: ExchangeLayout) -> int:
    """The server's fp32 scratch for folding a narrow (bf16, fp16) chunk into its fp32 sum: one chunk widened
    (mpifl.aggregation.combiners.WeightedMean); none for fp32 models."""
    if itemsize(cfg.model.dtype) >= 4 or not exchange.chunks:
        return 0
    return 4 * max(c.numel for c in exchange.chunks)


def client_bytes(cfg: Config, size: ModelBytes, client_ranks: int, on_gpu: bool = False) -> int:
    """A client rank (any rank of a group, clients.ranks_per_client; ``client_ranks`` counts the groups): the
    model, its training state, the wire buffer, a group's sum, residuals in RAM. ``on_gpu``: the training state
    lives on the GPU (client_device_bytes) and the host maps the CUDA libraries instead."""
    if cfg.clients.sharding == "fsdp":
        return sharded_client_bytes(cfg, size, on_gpu, client_ranks)
    nbytes, width = size.exchanged, itemsize(cfg.model.dtype)
    elements = nbytes // width
    client = imports_bytes(cfg) + size.total
    if cfg.train.trainer != "none":
        client += TRAINING_RUNTIME_BYTES
        client += CUDA_HOST_BYTES if on_gpu else training_state_bytes(cfg, size) + client_working_set(cfg, size, True)
        if not on_gpu and (most_trained_per_rank(cfg.clients, client_ranks) > 1 or cfg.strategy.update == "delta"
                           or cfg.train.ditto_lambda):
            client += nbytes  # the global model kept for the next logical client, the delta or Ditto's regulariser
    if cfg.strategy.wire_dtype in ("bfloat16", "float16") and cfg.model.dtype == "float32":
        client += nbytes // 2  # the narrowed update
    if cfg.clients.groups:
        client += 4 * elements  # the group's fp32 partial sum
        if cfg.transport.reduce == "chain":  # the running sum's receive ring, and the rank's other groups' sums
            client += cfg.transport.inflight * min(cfg.transport.chunk_bytes * 4 // width, 4 * elements)
            client += 4 * elements * (streams_per_rank(cfg, client_ranks) - 1)
    if not on_gpu:  # on a GPU they live beside the replica (client_device_bytes)
        client += state_rule_bytes(cfg, size)
    state_elements = client_state_elements(cfg, size)
    state = client_state_plan(cfg, state_elements, client_ranks * cfg.clients.ranks_per_client)  # counts ranks
    if state and state[0][2] == "RAM":  # the fullest rank's hosted clients' fp32 vectors
        client += state[0][1] * 4 * state_elements
    client += 4 * (journaled_elements(cfg, size) * undo_vectors(cfg, client_ranks) + held_personal_elements(cfg, size))
    return client + 4 * state_elements * loaned_vectors(cfg, client_ranks, state[0][2] if state else "RAM")


def loaned_vectors(cfg: Config, client_ranks: int, where: str) -> int:
    """Whole state vectors a client rank holds beside its own for a round when ``clients.placement: per_round``
    lends each client's state to the rank that trains it (mpifl.roles.lending): those it borrows, up to its share of
    the participants (the placement balances their work, so about per_round / N), and, with the homes' vectors on
    disk, a copy of each it lends (about as many). 0 without loans."""
    if not cfg.lends_client_state:
        return 0
    return even_spread(cfg.clients_per_round(), client_ranks) * (2 if where == "HDF5" else 1)


def rule_vector_elements(cfg: Config, size: ModelBytes) -> int:
    """Elements of SCAFFOLD's c_i or FedDyn's g_i: the trainable parameters' that travel (the control section's
    size; else the exchanged parameters', BatchNorm's statistics left out; else, unknown, every exchanged element)."""
    return size.control // 4 if size.control else size.trainable or size.exchanged // itemsize(cfg.model.dtype)


def undo_vectors(cfg: Config, client_ranks: int) -> int:
    """Copies of c_i or g_i a client rank keeps through a round to put back those of clients dropped past their
    deadline (``Config.undoes_dropped_state``, storage.residuals.UndoJournal): one per client it trains that round,
    at most ``most_trained_per_rank`` (a fixed placement may draw several of one rank's clients in a round, as the
    server's streams count them). 0 where nothing is journaled."""
    return most_trained_per_rank(cfg.clients, client_ranks) if cfg.undoes_dropped_state else 0


def state_layout(cfg: Config, size: ModelBytes) -> ClientStateLayout | None:
    """The layout of one client's state vector (mpifl.config.client_state) for a model of ``size``, as the client
    ranks lay it out, one exchange chunk standing for all (their count does not change the elements); None for a
    run without per-client state."""
    state = cfg.client_state()
    if state is None:
        return None
    width = itemsize(cfg.model.dtype)
    return state.layout(StateSizes(trainable=rule_vector_elements(cfg, size), chunks=(size.exchanged // width,),
                                   local=size.local // width))


def client_state_elements(cfg: Config, size: ModelBytes) -> int:
    """Elements of one client's state vector on a rank that keeps it, every part of its layout together (0 without
    per-client state): the whole vector, or a rank's rows of it, 1/R, on a sharded client
    (``clients.sharding: fsdp``)."""
    layout = state_layout(cfg, size)
    if layout is None:
        return 0
    return share(layout.elements, cfg.clients.ranks_per_client) if cfg.clients.sharding == "fsdp" else \
        layout.elements


def journaled_elements(cfg: Config, size: ModelBytes) -> int:
    """Elements of one client's vector that the put-back of dropped clients copies (its rule's and plug-in
    vectors)."""
    layout = state_layout(cfg, size)
    return layout.journaled_elements if layout is not None else 0


def held_personal_elements(cfg: Config, size: ModelBytes) -> int:
    """Elements of the Ditto personal model a client rank holds under ``clients.accept_failures`` from its training
    until the client's round is known to stand (mpifl.algorithms.ditto.PersonalModels.pending); 0 otherwise."""
    layout = state_layout(cfg, size) if cfg.clients.accept_failures else None
    part = layout.part("personal") if layout is not None else None
    return sum(part.chunks) if part is not None else 0


def memory_estimate(cfg: Config, size: ModelBytes, exchange: ExchangeLayout, strategy: StrategyFootprint,  # noqa: PLR0913 - the run's shape, each from its own source
                    nranks: int, ranks_per_node: int, server_alone: bool,
                    data: DataBytes | None = None, gpus_per_node: int = 0) -> MemoryEstimate:
    """Per-rank and fullest-node memory for this config on ``nranks`` ranks (activations and the held-out
    evaluation's working set where ``size`` estimates them; the data only when ``data`` is known; GPU memory when
    client ranks train on GPUs, ``gpus_per_node``)."""
    client_ranks = max(1, (nranks - 1) // cfg.clients.ranks_per_client)  # a group of ranks hosts as one rank
    pool = server_pool_bytes(cfg, exchange, strategy, client_ranks)
    elements = size.exchanged // itemsize(cfg.model.dtype)
    probe = FloorProbe.of(exchange, cfg.transport.floor_probe_mb, client_ranks,
                          itemsize(floor_probe_dtype(cfg, exchange.grouped))).server_bytes  # before the pool exists
    scratch = widening_scratch_bytes(cfg, exchange)
    if cfg.server.state == "disk":  # the model stays in the file: its live windows, write staging and the pool
        vectors = strategy.state_bytes(1) // STATE_ITEMSIZE  # fp32 server-state vectors (momentum, moments)
        store = out_of_core_bytes(exchange.chunks, int(cfg.server.window_mb * MIB), vectors)
        server = imports_bytes(cfg) + max(store + pool + scratch, probe)
    else:  # the model, the pool, fp32 server-state vectors (momentum, moments)
        server = imports_bytes(cfg) + size.total + max(pool + scratch + strategy.state_bytes(elements), probe)
    kept, kept_on_disk = kept_updates_bytes(cfg, elements) if strategy.whole_update else (0, False)
    if not kept_on_disk:
        server += kept
    evaluation = server_evaluation_bytes(cfg, size)
    if not evaluates_on_gpu(cfg, gpus_per_node):  # else it is on the GPU, in server_device_bytes
        server += evaluation
    on_gpu = trains_on_gpu(cfg, gpus_per_node)
    client = client_bytes(cfg, size, client_ranks, on_gpu)
    server_data = client_data = node_data = shared_read = reading = 0
    if data is not None:
        server_data = server_data_bytes(data)
        client_data = client_data_bytes(data, client_ranks, cfg.clients.placement == "per_round")
        node_data = node_data_bytes(data)
        shared_read = client_shared_bytes(data, client_ranks, cfg.clients.placement == "per_round")
        reading = reading_rank_bytes(imports_bytes(cfg) + TRAINING_RUNTIME_BYTES, data)
    server, client = server + server_data, client + client_data
    # rank 1 wrote every page of the shared set, so it counts all of them, and it peaked higher while reading
    reader = max(client - shared_read + node_data, reading) if reading else 0
    node = fullest_node(server, client - shared_read, nranks, ranks_per_node, server_alone, node_data, reader)
    return MemoryEstimate(size.exchanged, server, pool, client, node, server_data, client_data, node_data,
                          client_device_bytes(cfg, size) if on_gpu else 0,
                          server_device_bytes(cfg, size, gpus_per_node), sum(c.nbytes for c in exchange.wire),
                          evaluation, reader if reader > client else 0, reading, shared_read, kept, kept_on_disk)


def fullest_node(server: int, client: int, nranks: int, ranks_per_node: int, server_alone: bool,
                 shared: int = 0, reader: int = 0) -> int:
    """Bytes on the fullest node when the launcher fills nodes in rank order, ``ranks_per_node`` at a time
    (MPICH's and Cray PALS's ``-ppn``/``--ppn``), rank 0 on the first node, alone with ``server_alone``;
    ``shared`` is held once by every node with a client rank (the data in shared memory); ``reader``: rank 1, the
    first client rank, which reads the data, at its own peak, the shared copy included (0: like any client rank)."""
    def clients_node(count: int, first: bool = False) -> int:
        held = count * client + (shared if count else 0)
        return held + max(0, reader - client - shared) if first and count else held

    clients = nranks - 1
    if server_alone:
        return max(server, clients_node(min(ranks_per_node, clients), first=True))
    beside_server = min(ranks_per_node, nranks) - 1
    return max(server + clients_node(beside_server, first=True),
               clients_node(min(ranks_per_node, clients - beside_server), first=not beside_server))


def client_state_plan(cfg: Config, elements: int, client_ranks: int) -> list[tuple[list[int], int, str]]:
    """Per-client state (Config.client_state) of ``elements`` fp32 each: (client ranks, clients each hosts, "RAM"
    or "HDF5"), fullest ranks first (round-robin placement); empty without any. With ``clients.ranks_per_client``
    R > 1 the state lives on the groups' leaders (world ranks 1, 1 + R, ...), each hosting a group's clients; on
    every rank of each group, its rows of them, under ``clients.sharding: fsdp``."""
    state = cfg.client_state()
    if state is None:
        return []
    per_client = cfg.clients.ranks_per_client
    hosts = max(1, client_ranks // per_client)
    by_count: dict[int, list[int]] = {}
    groups = 0 if cfg.lends_client_state else cfg.clients.groups  # per_round: each client's home is 1 + c mod N
    for host in range(1, hosts + 1):
        hosted = len(clients_of_rank(host, cfg.clients.num_clients, hosts, groups))
        leader = 1 + (host - 1) * per_client  # the host's world rank
        keeping = range(leader, leader + per_client) if cfg.clients.sharding == "fsdp" else (leader,)
        by_count.setdefault(hosted, []).extend(keeping)
    limit = state.ram_mb * MIB
    return [(ranks, n, "RAM" if 4 * n * elements <= limit else "HDF5") for n, ranks in sorted(by_count.items(),
                                                                                              reverse=True)]
