"""The config's sections: one small typed dataclass per component, a doc per field."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from mpifl.config.capabilities import BUILTIN_CAPABILITIES, Capabilities
from mpifl.config.client_state import ClientState, client_state, declared_vectors
from mpifl.config.schema import field_
from mpifl.plugins import is_import_path, resolve
from mpifl.trackers import TRACKERS
from mpifl.units import MIB

# The clock modes whose server steps apply updates trained on older model versions: every step's model is
# saved, and a resume retrains the clients in flight from the versions they started on.
ASYNCHRONOUS_MODES = ("fedasync", "fedbuff", "fedcompass")

NO_CLIENT_HALF = Capabilities()  # what Config.capabilities says of a plug-in strategy before it is imported

# The names a config may give strategy.name besides an import path. mpifl.aggregation.registry maps each to
# its stages and refuses, on import, to differ from this tuple: the config stays below aggregation.
STRATEGIES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "median", "trimmed_mean", "krum",
              "multi_krum", "bulyan", "geometric_median", "fednova", "scaffold", "feddyn")

# Algorithms from the literature that are not a server strategy in mpifl, and the key that gives each: a user who
# writes strategy.name=ditto is told where Ditto lives instead of only that 'ditto' is not a choice.
ELSEWHERE = {
    "fedprox": "FedProx is a client-side proximal term: train.prox_mu > 0 (e.g. 0.01) with any strategy",
    "ditto": "Ditto keeps a personal model per client: train.ditto_lambda > 0 (e.g. 0.1) with any strategy",
    "fedbn": "FedBN keeps the BatchNorm layers on each client: model.local, their names' patterns (e.g. ['*.bn*'] for "
             "layers named bn1, bn2; ['1.*', '4.*'] for the built-in cnn)",
    "fedper": "FedPer keeps the head on each client: model.local (e.g. ['fc3.*'])",
    "rfa": "RFA is the geometric median: strategy.name=geometric_median",
    "fedasync": "FedAsync is an asynchronous clock: clock.mode=fedasync with strategy.name=fedavg",
    "fedbuff": "FedBuff is an asynchronous clock: clock.mode=fedbuff with strategy.name=fedavg",
    "fedcompass": "FedCompass is an asynchronous clock: clock.mode=fedcompass with strategy.name=fedavg",
}


@dataclass
class ClientsConfig:
    """Who takes part."""

    num_clients: int = field_(8, "logical clients in the federation (may exceed client ranks)", min=1, max=10**7)
    per_round: int | None = field_(None, "clients sampled per round (overrides fraction)", min=1)
    fraction: float = field_(1.0, "fraction of clients sampled per round: fraction x num_clients rounded to the "
                             "nearest whole number, a tie to the even one (Python's round), and at least 1: 12 "
                             "clients x 0.3 sample 4, 10 x 0.25 sample 2, 10 x 0.01 sample 1", min=0.0, max=1.0,
                             exclusive_min=True)
    accept_failures: bool = field_(False, "drop a logical client that raises or sends NaN/Inf from the round (logged "
                                    "with client, rank and reason) instead of aborting the job; so are the rest "
                                    "of a round's clients on a rank still training past its deadline "
                                    "(timeouts.first_update, timeouts.straggler); under SCAFFOLD and FedDyn the "
                                    "dropped clients' c_i or g_i, and a plug-in trainer's declared vectors, are put "
                                    "back when the next header names them, while their top-k residuals, model.local "
                                    "tensors and Ditto personal models are kept as trained; a round left with too "
                                    "few usable updates: see clients.min_participants")
    min_participants: int = field_(1, "abort the round, and the job, when fewer usable updates than this remain "
                                      "(with a message that says when a resume would end the same way); under "
                                      "clock.mode other than off the round, or asynchronous step, is left out "
                                      "instead: the model unchanged, the record's 'unapplied' says why, and the run "
                                      "goes on, the usable clients' SCAFFOLD, FedDyn or declared vectors put back "
                                      "(record 'state_put_back'), their top-k residuals, model.local tensors and "
                                      "Ditto personal models kept as their training left them, as a client's dropped "
                                      "past its deadline are (record 'state_kept')", min=1)
    below_quorum: str = field_("abort", "a round left with fewer usable updates than clients.min_participants "
                               "(only clients.accept_failures leaves one) without a virtual clock: 'abort' ends the "
                               "job; 'keep' leaves the model unchanged, records why ('unapplied') and goes on, as "
                               "under clock.mode other than off, so that a diverging run (every update NaN/Inf, as "
                               "FedAvg under a strong attack) runs to its last round and a sweep to its next point",
                               choices=("abort", "keep"))
    placement: str = field_("round_robin", "which rank trains which client: round_robin (client, or its group, mod "
                            "the client ranks), balanced (a fixed home by samples x epochs, heaviest first, "
                            "deterministic) or per_round (each round's participants, or their groups, spread anew "
                            "by estimated cost, overhead + samples x epochs, the overhead fitted to measured "
                            "training times; every client rank holds the whole training set, and per-client "
                            "state is lent by its home rank, 1 + c mod N, to the rank that trains the client). "
                            "Results never change, and a resume may change it",
                            choices=("round_robin", "balanced", "per_round"))
    groups: int = field_(0, "reduction groups G: logical client c belongs to group c mod G, a group lives on one "
                         "rank, which sums its participants' updates (ascending id, fp32) before anything travels; "
                         "the server folds the G partial sums in ascending group id. Results depend on G, never on "
                         "the number of client ranks. 0: off, every participant's update travels", min=0)
    group_by: str = field_("id", "how participants fall into the clients.groups reduction groups: id (client c in "
                           "group c mod G, the same every round) or cost (each round, the participants split into G "
                           "groups of near-equal samples x epochs, heaviest first into the lightest group, so that "
                           "one group per rank keeps the ranks evenly loaded; needs clients.placement 'per_round'). "
                           "Either way a pure function of the round's participants: results depend on G and on "
                           "group_by, never on the number of client ranks", choices=("id", "cost"))
    ranks_per_client: int = field_(1, "R ranks train each logical client together: client ranks 1.. form groups "
                                   "of R consecutive ranks (the first sends the update), a torch.distributed group "
                                   "(gloo on CPUs, NCCL on GPUs) built once per run trains with DDP, each rank on its "
                                   "share of every batch; the rank count less the server must be a multiple of R. "
                                   "Results depend on R, never on the number of groups", min=1, max=1024)
    sharding: str = field_("replicate", "how a group of clients.ranks_per_client ranks holds its client's model: "
                           "replicate (DDP: every rank holds all of it) or fsdp (PyTorch's FSDP, fully_shard: each "
                           "rank holds 1/R of the parameters, gradients and optimizer state, and its pieces of every "
                           "chunk travel through the group's first rank, so no rank ever holds the whole model). fsdp "
                           "builds transformers models only", choices=("replicate", "fsdp"))

    def per_round_count(self) -> int:
        """How many logical clients take part in each round."""
        if self.per_round is not None:
            return min(self.per_round, self.num_clients)
        return max(1, round(self.fraction * self.num_clients))


@dataclass
class DataConfig:
    """The dataset and how it is split across logical clients."""

    dataset: str = field_("digits", "built-in dataset ('digits', 'synthetic', 'text': token blocks for causal-LM "
                           "training, see mpifl.learning.text, 'leaf': LEAF JSON files under data.kwargs.path, "
                           "'table': a Parquet, npz or saved Hugging Face table with a client-id column, see "
                           "mpifl.learning.tables, 'idx': MNIST-layout IDX files, plain or gzipped, in the folder "
                           "data.kwargs.path, or 'fashion_mnist': the same from /usr/share/datasets/fashion-mnist, "
                           "where apt-get install dataset-fashion-mnist puts it) or an import path returning "
                           "(x_train, y_train, x_test, y_test[, per-client train indices]); with partition: natural, "
                           "'leaf' and 'table' ranks read only the clients they host",
                           choices=("digits", "synthetic", "text", "leaf", "table", "idx", "fashion_mnist"),
                           import_ok=True)
    kwargs: dict = field_(dict, "keyword arguments for the dataset function")
    partition: str = field_("iid", "how training samples are split: iid, dirichlet (label skew), shards (k classes "
                            "per client from fixed groups of consecutive classes, see classes_per_client), labels "
                            "(NIID-Bench's #C=k label-quantity skew), unbalanced (lognormal sizes, iid labels), "
                            "natural (the data's own clients, e.g. LEAF users or a table's client ids), file "
                            "(data.partition_file), or an import path fn(labels, num_clients, seed) returning one "
                            "index array per client",
                            choices=("iid", "dirichlet", "shards", "labels", "unbalanced", "natural", "file"),
                            import_ok=True)
    partition_file: str | None = field_(None, "partition: file: a JSON list of per-client index lists (client c's "
                                           "the c-th) or {\"client id\": indices} with keys the client ids 0 to "
                                           "num_clients - 1; indices are integers, each a training sample held by "
                                           "one client, and no client is empty")
    alpha: float = field_(0.5, "dirichlet: concentration (smaller = more label skew)", min=0.0, exclusive_min=True)
    classes_per_client: int = field_(2, "k, the classes each client holds, for shards and labels (at most the number "
                                     "of classes). shards: the classes in a seeded cyclic order, client c takes the k "
                                     "from position c * k, so with C classes and k dividing C there are C / k fixed "
                                     "disjoint groups and clients c and c + C / k hold the same classes (10 classes, "
                                     "k 2, 10 clients: 5 pairs, each held by 2 clients); a class's samples are split "
                                     "evenly among its holders. labels (NIID-Bench's #C=k, Li et al. ICDE 2022): "
                                     "client i holds class i mod C and k - 1 more distinct classes drawn at random "
                                     "from the seed; each class's samples, shuffled, are cut into near-equal runs "
                                     "among its holders; a class nobody holds is left out", min=1)
    size_sigma: float = field_(1.0, "unbalanced: sigma of the lognormal client sizes (0 = equal)", min=0.0)
    val_fraction: float = field_(0.0, "share of each client's samples kept as its local validation split "
                                  "(federated evaluation)", min=0.0, max=0.9)
    feature_noise: float = field_(0.0, "noise-based feature skew (NIID-Bench): client k of n reads its inputs with "
                                  "Gaussian noise of std feature_noise * k / (n - 1) added, drawn afresh for every "
                                  "minibatch (its validation split noised once); the server scores the held-out set "
                                  "at each client's level and averages (n evaluations); 0 = off; see "
                                  "mpifl.learning.noise", min=0.0)


@dataclass
class TransformersConfig:
    """A Hugging Face transformers causal LM (model.name='transformers'), built offline."""

    architecture: str | None = field_(None, "model_type as transformers names it (gpt2, llama, mistral, ...); "
                                          "optional when path has a config.json")
    config: dict = field_(dict, "config values (n_layer, hidden_size, num_hidden_layers, ...) over the architecture's "
                           "defaults or over path's config.json")
    path: str | None = field_(None, "local folder with config.json (and, with pretrained, *.safetensors shards); "
                                  "never a hub name: nothing is downloaded")
    pretrained: bool = field_(False, "load the weights from path's safetensors shards, shard by shard into the flat "
                               "buffer (else: random init from the seed)")


@dataclass
class LoraConfig:
    """LoRA adapters through peft (the 'lora' extra); only the adapters train and travel."""

    r: int = field_(0, "adapter rank (0 = no LoRA)", min=0)
    alpha: float = field_(16.0, "LoRA scaling alpha", min=0.0, exclusive_min=True)
    dropout: float = field_(0.0, "dropout on the adapter input", min=0.0, max=1.0)
    target_modules: list = field_(list, "module names to adapt, e.g. [c_attn] (gpt2) or [q_proj, v_proj] (llama); "
                                   "default: peft's choice for the architecture")


@dataclass
class ModelConfig:
    """The model every rank builds."""

    name: str = field_("mlp", "built-in model ('mlp', 'cnn': conv-BN-ReLU blocks and global average pooling, "
                        "'lenet': LeNet-5-style, two conv + max-pool and three dense layers, the CNN to start an "
                        "image experiment from, 'blob', 'transformers') or import path to a function returning an "
                        "nn.Module", choices=("mlp", "cnn", "lenet", "blob", "transformers"), import_ok=True)
    kwargs: dict = field_(dict, "keyword arguments for the model function; mpifl passes input_shape and "
                          "num_classes itself (from the dataset) to mlp, cnn and to a plug-in whose signature names "
                          "them")
    dtype: str = field_("float32", "parameter dtype", choices=("float32", "bfloat16", "float16"))
    memory_format: str = field_("contiguous", "how a convolution's activations lie in memory: channels_last makes "
                                "every Conv2d's output NHWC, which PyTorch's CPU pooling and oneDNN convolutions run "
                                "faster (a LEAF CNN step 1.23x as fast on a CPU, 1.03x against nhwc_pooling alone); "
                                "results change in the last bits, and stay bitwise the same on any number of ranks",
                                choices=("contiguous", "channels_last"))
    nhwc_pooling: bool = field_(True, "CPU max pooling (nn.MaxPool2d) of NCHW activations runs forward by PyTorch's "
                                "channels-last kernel between two layout copies, backward by its NCHW kernel on the "
                                "indices found: bitwise the same values and gradients, a LEAF CNN step 1.19x as "
                                "fast on a CPU (PyTorch's NCHW forward kernel took 0.75 ms a call, the NHWC one "
                                "0.05); false: PyTorch's own kernel")
    init_from: str | None = field_(None, "an mpifl checkpoint to start from: every rank builds the model on the "
                                       "meta device and reads the weights straight into its flat buffer")
    transformers: TransformersConfig = field_(TransformersConfig, "model.name='transformers': architecture and config")
    trainable: list = field_(list, "glob patterns of parameter names that train (e.g. ['*.h.11.*', 'lm_head.*']); "
                              "the others are frozen; default: all")
    local: list = field_(list, "glob patterns of tensor names that never travel and are kept per logical client "
                         "on the rank that hosts it (FedBN: the BatchNorm layers, e.g. ['*.bn*'] for layers named "
                         "bn1, bn2, ['1.*', '4.*'] for the built-in cnn; FedPer: the head, e.g. ['fc3.*'] for "
                         "lenet); a pattern that matches nothing is refused with the model's tensor names; "
                         "default: none")
    local_ram_mb: float = field_(1024.0, "model.local: a client rank keeps its clients' local tensors in RAM while "
                                 "they fit in this many MiB, else in one HDF5 file per rank in the run directory",
                                 min=0.0)
    exchange: str = field_("trainable", "what travels and is reduced: only the trainable tensors (frozen ones stay "
                            "where they are) or all", choices=("trainable", "all"))
    lora: LoraConfig = field_(LoraConfig, "LoRA adapters (model.name='transformers')")


@dataclass
class TrainConfig:
    """Local training on each logical client."""

    trainer: str = field_("torch", "'torch' (plain loop), 'causal_lm' (transformers fine-tuning on "
                           "data.dataset='text'), 'none' (model-only exchange) or an import path",
                           choices=("torch", "causal_lm", "none"), import_ok=True)
    kwargs: dict = field_(dict, "a plug-in trainer's own settings (train.trainer an import path), passed as keyword "
                          "arguments after the TrainConfig, converted to its parameters' annotated types and "
                          "checked against its signature; the built-in trainers take none")
    optimizer: str = field_("sgd", "local optimizer", choices=("sgd", "adam", "adamw"))
    lr: float = field_(0.05, "local learning rate", min=0.0, exclusive_min=True)
    momentum: float = field_(0.0, "SGD momentum", min=0.0, max=1.0)
    weight_decay: float = field_(0.0, "weight decay", min=0.0)
    local_epochs: int = field_(1, "passes over the local data per round", min=1)
    local_steps: int | None = field_(None, "if set, a fixed number of minibatch steps instead of epochs", min=1)
    batch_size: int = field_(32, "local minibatch size", min=1)
    grad_accum_steps: int = field_(1, "micro-batches of batch_size accumulated per optimizer step (torch and "
                                   "causal_lm trainers)", min=1)
    step_in_backward: bool = field_(False, "torch trainer: step each parameter as soon as backward has accumulated "
                                    "its gradient (bitwise the same weights as one step after backward; no "
                                    "model-sized gradient held at once, so less memory; not faster on a CPU). Not "
                                    "with grad_accum_steps > 1, max_grad_norm, ranks_per_client > 1 or SCAFFOLD, "
                                    "nor for a model that uses a parameter's value later in its own backward pass")
    batched_clients: int = field_(0, "torch trainer: train this many of a rank's logical clients at once as one "
                                  "batched model (torch.func.vmap over their stacked weights; docs: "
                                  "how-to/batched-clients). 0 trains them one at a time. A client trains to the same "
                                  "bits in any batch of the same width, and within rounding of one at a time. Pays "
                                  "on a GPU and for small models; a CPU-bound CNN trains slower", min=0)
    reuse_freed_memory: bool = field_(True, "client ranks: glibc's malloc keeps freed memory for the next "
                                      "allocation instead of returning it to the kernel, so each training step "
                                      "reuses the pages the last one freed rather than page-faulting in freshly "
                                      "zeroed ones (no effect on results; resident memory stays at its "
                                      "high-water mark; a no-op without glibc)")
    gradient_checkpointing: bool = field_(False, "causal_lm: recompute activations in the backward pass (less memory, "
                                           "~30% more compute)")
    max_grad_norm: float | None = field_(None, "clip the global gradient norm to this before each step (torch and "
                                         "causal_lm trainers)", min=0.0, exclusive_min=True)
    device: str = field_("auto", "where local training runs: auto (cuda when the rank sees a GPU), cpu or cuda; each "
                         "rank uses the GPU of its node-local slot (docs: how-to/gpus)",
                         choices=("auto", "cpu", "cuda"))
    threads: int | str = field_(1, "compute threads per rank (torch.set_num_threads), or 'auto': one per core of the "
                                "rank's slot. 1 keeps results bitwise equal across rank counts; any other value "
                                "makes them depend on the thread count, since torch's CPU reductions split their "
                                "work by thread", min=1, choices=("auto",))
    device_copy: bool | None = field_(None, "train a replica of the model on the device, apart from the host "
                                         "exchange buffer (default: on for cuda, off for cpu; on with cpu runs the "
                                         "GPU path's copies on the CPU)")
    deterministic: bool = field_(True, "on a GPU, deterministic CUDA kernels (torch.use_deterministic_algorithms, "
                                 "cuDNN without autotuning, CUBLAS_WORKSPACE_CONFIG=:4096:8), so a run is bitwise "
                                 "reproducible and equal across rank counts on the same GPU model and software; "
                                 "false lets cuDNN and torch pick faster kernels that sum in arrival order. No "
                                 "effect on the CPU")
    prox_mu: float = field_(0.0, "FedProx proximal term mu/2 * ||w - w_global||^2 (0 = off)", min=0.0)
    ditto_lambda: float = field_(0.0, "Ditto (Li et al. 2021): lambda > 0 keeps a personal model per client, trained "
                                 "each round it is sampled, before the global one, on its own data with "
                                 "lambda/2 ||v - w||^2 towards the received global w (0 = off)", min=0.0)
    state_ram_mb: float = field_(1024.0, "a plug-in trainer's declared per-client vectors (its client_state): a "
                                 "client rank keeps its clients' vectors in RAM while they fit in this many MiB, else "
                                 "in one HDF5 file per rank in the run directory", min=0.0)
    personal_ram_mb: float = field_(1024.0, "ditto: a client rank keeps its clients' personal models (fp32) in RAM "
                                    "while they fit in this many MiB, else in one HDF5 file per rank in the run "
                                    "directory", min=0.0)
    loss: str = field_("cross_entropy", "loss: 'cross_entropy', 'mse' or an import path (fn(output, target))",
                        choices=("cross_entropy", "mse"), import_ok=True)

    def steps_inside_backward(self) -> bool:
        """Whether the torch trainer may step each parameter inside backward (``step_in_backward``): not where a
        step needs every gradient first, accumulated over micro-batches or clipped by their global norm. The
        trainer also asks its runtime (DDP, global optimizer hooks); the memory plan asks the whole Config."""
        return self.trainer == "torch" and self.step_in_backward and self.grad_accum_steps == 1 \
            and not self.max_grad_norm


@dataclass
class StrategyConfig:
    """How the server combines updates."""

    name: str = field_("fedavg", "fedavg, fedavgm (server momentum), fedadam/fedyogi/fedadagrad (Reddi et al. 2021), "
                        "median or trimmed_mean (coordinate-wise, unweighted), krum, multi_krum or bulyan (Blanchard "
                        "et al. 2017, El Mhamdi et al. 2018), geometric_median (RFA, Pillutla et al. 2022), fednova "
                        "(Wang et al. 2020: deltas normalised by each client's local steps; clients send deltas), "
                        "scaffold (Karimireddy et al. 2020: control variates correct each local step; clients send "
                        "deltas), "
                        "feddyn (Acar et al. 2021: a dynamic regulariser per client; deltas, equal weights), or an "
                        "import path to a "
                        "plug-in called as fn(cfg, **strategy.kwargs), cfg this StrategyConfig, returning a Strategy "
                        "(see mpifl.api)", choices=STRATEGIES, import_ok=True,
                        elsewhere=ELSEWHERE)
    kwargs: dict = field_(dict, "a plug-in strategy's own settings (strategy.name an import path), passed as keyword "
                          "arguments and checked against its signature; built-in strategies take none (their "
                          "settings are this section's keys)")
    weighting: str = field_("auto", "client weight in means: by sample count or equal; auto: equal where the "
                            "strategy or privacy needs it (feddyn, privacy.mode), else samples",
                            choices=("auto", "samples", "equal"))
    update: str = field_("auto", "what a client sends: its trained weights or its delta (trained - global); auto: "
                          "delta where the strategy or a run mode needs it (fednova, scaffold, feddyn, privacy.mode, "
                          "compression.method=topk, clock.mode fedbuff or fedcompass), else weights",
                          choices=("auto", "weights", "delta"))
    wire_dtype: str | None = field_(None, "dtype of float32/float64 tensors in client updates (e.g. bfloat16 halves "
                                        "the bytes; the server still accumulates in float32); default: the model's",
                                        choices=("float32", "bfloat16", "float16"))
    server_lr: float | None = field_(None, "server learning rate eta (default 1.0 for fedavgm, 0.01 for the "
                                         "adaptive ones)", min=0.0, exclusive_min=True)
    momentum: float = field_(0.9, "fedavgm: server momentum beta", min=0.0, max=1.0)
    beta1: float = field_(0.9, "fedadam/fedyogi: first-moment decay", min=0.0, max=1.0)
    beta2: float = field_(0.99, "fedadam/fedyogi: second-moment decay", min=0.0, max=1.0)
    tau: float = field_(1e-3, "adaptive strategies: adaptivity tau (also v's initial value tau^2)", min=0.0,
                         exclusive_min=True)
    trim_fraction: float = field_(0.1, "trimmed_mean: fraction beta trimmed from each end (< 0.5)", min=0.0, max=0.49)
    byzantine_clients: int = field_(0, "krum, multi_krum, bulyan: f, how many of a round's participants may be "
                                    "Byzantine: each update is scored by its squared distances to its n - f - 2 "
                                    "nearest others (Blanchard et al. 2017; their guarantee needs n >= 2f + 3, "
                                    "Bulyan's n >= 4f + 3)", min=0)
    krum_keep: int = field_(0, "multi_krum: m, how many of the best-scored updates are averaged (El Mhamdi et al. "
                            "2018); 0: n - f", min=0)
    geomed_iterations: int = field_(4, "geometric_median: most smoothed Weiszfeld iterations (RFA, Pillutla et al. "
                                    "2022; each reads the n x n Gram matrix, not the model)", min=0)
    geomed_tolerance: float = field_(1e-6, "geometric_median: stop once an iteration improves the objective "
                                     "sum_i a_i ||z - x_i|| by less than this fraction of it", min=0.0)
    geomed_smoothing: float = field_(1e-6, "geometric_median: nu, the smallest distance a Weiszfeld weight "
                                     "a_i / max(nu, ||z - x_i||) divides by", min=0.0, exclusive_min=True)
    control_ram_mb: float = field_(1024.0, "scaffold, feddyn: a client rank keeps its clients' vectors (SCAFFOLD's "
                                   "control variates c_i, FedDyn's gradient states; fp32, one per trainable "
                                   "element) in RAM while they fit in this many MiB, else in one HDF5 file per rank "
                                   "in the run directory", min=0.0)
    alpha: float = field_(0.01, "feddyn: alpha, the weight of the dynamic regulariser alpha/2 ||y - x||^2 (Acar "
                          "et al. 2021 use 0.01 to 0.1)", min=0.0, exclusive_min=True)


@dataclass
class TransportConfig:
    """Chunked exchange."""

    chunk_mb: float = field_(16.0, "largest message in MiB (16 was best on shared-memory MPICH; at least 1 byte)",
                             min=1 / MIB, min_text="1 byte")
    inflight: int = field_(4, "chunks in flight per peer", min=1)
    dispatch_fanout: int = field_(0, "send the global model down a pipelined broadcast tree in which every rank "
                                  "forwards each chunk to this many others, so the server sends it this many "
                                  "times instead of once per client rank (0: the server sends to every client "
                                  "rank)", min=0)
    reduce: str = field_("direct", "'direct': every update stream goes to the server; 'chain' (with "
                         "clients.groups): the groups' partial sums are added along a pipelined chain of the ranks "
                         "that hold them, group by group in ascending id (the server's order, so the same bits), and "
                         "the server receives one fp32 sum per round", choices=("direct", "chain"))
    pool_mb: float = field_(256.0, "server memory budget for receive slots and chunk accumulators, MiB", min=0.0,
                             exclusive_min=True)
    doorbells: bool = field_(True, "a rank that sends to a rank of its node wakes it through a named pipe, "
                             "instead of leaving it to its next poll (up to 2 ms later); false: poll alone")
    floor_probe_mb: float = field_(64.0, "before round 1, the server times plain chunked Isend/Irecv of this many "
                                   "MiB, shared among its client ranks (at most the model's size each), and every "
                                   "round's record gives its exchange against that floor for its bytes (the record's "
                                   "'exchange'); 0: no probe", min=0.0)

    @property
    def chunk_bytes(self) -> int:
        """``chunk_mb`` in whole bytes, at least one."""
        return max(1, int(self.chunk_mb * MIB))


@dataclass
class TimeoutsConfig:
    """How long a client rank may make no progress, per stage of a round, before the server ends the job."""

    model_delivered: float | None = field_(None, "seconds a rank may take up none of the global model sent to it "
                                              "(default: 60 + its in-flight chunks at 10 MB/s)", min=0.0,
                                              exclusive_min=True)
    first_update: float | None = field_(None, "seconds a training rank may stay silent (its model's forward passes "
                                           "report progress) before sending a logical client's update header "
                                           "(default: until a round has been timed, 10 x the slowest first report "
                                           "of the other ranks, at least 30, or 300 while none has reported; "
                                           "then 60 + 10 x the slowest client's training so far)", min=0.0,
                                           exclusive_min=True)
    update_complete: float | None = field_(None, "seconds a rank may send no chunk while its update is in flight "
                                              "(default: as model_delivered)", min=0.0, exclusive_min=True)
    sigterm_grace: float = field_(5.0, "after SIGTERM, seconds a round may wait on a silent rank before the server "
                                  "saves what it can and ends the job", min=0.0)
    straggler: float | None = field_(None, "with clients.accept_failures: seconds a rank may train (from taking up "
                                        "the model, or from when the server begins taking up updates if later) "
                                        "before the rest of its round is dropped; later rounds leave it "
                                        "out, not waiting, until its late updates are in, and it rejoins at the "
                                        "newest round (default: once half the ranks have finished, 3 x the slowest "
                                        "of them, at least 60); real time only: under a virtual clock.mode, the "
                                        "virtual clock decides who is a straggler", min=0.0, exclusive_min=True)


@dataclass
class EvalConfig:
    """Held-out evaluation of the global model on the server."""

    every: int = field_(1, "evaluate every K rounds (0 = never); the last round is always evaluated", min=0)
    federated_every: int = field_(0, "every K rounds, clients evaluate the global model they received on their "
                                   "local validation split (data.val_fraction), and in the run's last round; "
                                   "0 = never", min=0)
    batch_size: int = field_(512, "evaluation batch size", min=1)
    device: str = field_("cpu", "where the server evaluates the global model: cpu; cuda (the server rank's GPU: a "
                         "copy of the model is kept there and refreshed before each evaluation); or auto (cuda when "
                         "the server rank sees a GPU)", choices=("cpu", "cuda", "auto"))


@dataclass
class CheckpointConfig:
    """HDF5 checkpoints in <run dir>/checkpoints (always one after the last round)."""

    every: int = field_(0, "save every K rounds (0 = only at the end and on SIGTERM)", min=0)
    keep: int = field_(3, "keep the newest K checkpoints (the final one is always the newest)", min=1)


@dataclass
class ServerConfig:
    """Where the server keeps the global model."""

    state: str = field_("memory", "'memory', or 'disk': out-of-core, window by window from HDF5",
                         choices=("memory", "disk"))
    window_mb: float = field_(96.0, "out-of-core read windows for streaming the model out, MiB in all (three)",
                               min=0.0, exclusive_min=True)
    map_windows: bool = field_(True, "out of core: send each window that is one stretch of the checkpoint file "
                                     "straight from a read-only mapping of it (no copy); false: always read")


@dataclass
class ClockConfig:
    """Virtual time: heterogeneous clients, deadlines, availability and asynchronous FL (mpifl.clock).

    Every duration comes from the cost model, never from the machine: the schedule, and every
    result, depend only on the config and the seed.
    """

    mode: str = field_("off", "off (rounds in real time only), sync (rounds in virtual time: deadlines, "
                       "over-selection, availability), fedasync (Xie et al. 2019), fedbuff (Nguyen et al. 2022) or "
                       "fedcompass (Li et al. 2024)", choices=("off", "sync", *ASYNCHRONOUS_MODES))

    @property
    def asynchronous(self) -> bool:
        """Whether server steps apply updates trained on older versions (every version is checkpointed)."""
        return self.mode in ASYNCHRONOUS_MODES

    def in_flight(self) -> int:
        """``concurrency`` as ``load_config`` resolves it (mpifl.config.automatic: 10, or every client where
        there are fewer); a ClockConfig built in code must set it."""
        if self.concurrency is None:
            raise ValueError("clock.concurrency is unset; load_config resolves it, a config built in code must set it")
        return self.concurrency

    seconds_per_sample: float = field_(0.01, "virtual compute seconds for one training sample (forward and backward) "
                                       "on a device of speed 1", min=0.0)
    task_overhead: float = field_(0.0, "virtual compute seconds of a task besides its samples (start-up, evaluation, "
                                       "encoding) on a device of speed 1; mpifl calibrate fits it", min=0.0)
    speed_sigma: float = field_(0.5, "relative compute speeds are lognormal with median 1 and this sigma (0: equal)",
                                min=0.0)
    bandwidth_mbps: float = field_(20.0, "median link bandwidth, megabits per second (both directions)", min=0.0,
                                   exclusive_min=True)
    bandwidth_sigma: float = field_(0.8, "lognormal sigma of the bandwidths (0: equal)", min=0.0)
    trace: str | None = field_(None, "device trace in FedScale's layout (JSON or pickle): {client: {computation: "
                                  "ms per sample, communication: kbps}}; client c takes the c-th entry (ids sorted), "
                                  "cycling when there are fewer entries than clients")
    deadline: float | None = field_(None, "sync: virtual seconds a round waits; later updates are stragglers, "
                                       "dropped", min=0.0, exclusive_min=True)
    over_selection: float = field_(0.0, "sync: sample ceil(k x (1 + x)) clients and keep the first k to finish "
                                   "(Bonawitz et al. 2019)", min=0.0)
    availability: str = field_("always", "who can be sampled: always, diurnal (each client online for "
                               "online_fraction of every period, at its own seeded phase), trace "
                               "(availability_trace) or queue (each client a batch job: queue waits, walltimes, "
                               "preemption; a task its job's end cuts short is lost)",
                               choices=("always", "diurnal", "trace", "queue"))
    online_fraction: float = field_(0.5, "diurnal: fraction of each period a client is online", min=0.0, max=1.0,
                                    exclusive_min=True)
    period: float = field_(86400.0, "diurnal: the period, virtual seconds", min=0.0, exclusive_min=True)
    availability_trace: str | None = field_(None, "availability: trace: JSON {client: [[start, end], ...]} online "
                                               "intervals in virtual seconds (clients not listed are always online)")
    queue_wait: float = field_(600.0, "queue: median virtual seconds a client's job waits in the batch queue "
                               "(lognormal)", min=0.0)
    queue_wait_sigma: float = field_(1.0, "queue: lognormal sigma of the queue waits", min=0.0)
    walltime: float = field_(3600.0, "queue: virtual seconds a client's job may run before the scheduler ends it",
                             min=0.0, exclusive_min=True)
    preemption_rate: float = field_(0.0, "queue: preemptions per virtual second of a running job (Poisson; 0: none)",
                                    min=0.0)
    preemption_checkpoint: bool = field_(False, "queue: a task cut short by its job's end carries on in the "
                                                "client's next job, instead of being lost")
    queue_trace: str | None = field_(None, "queue: a Standard Workload Format trace (Parallel Workloads Archive); "
                                          "job i in submit order runs for client i mod num_clients from its submit "
                                          "time plus its wait (a client is online while any of its jobs runs), and "
                                          "replaces queue_wait, walltime and preemption_rate")
    concurrency: int | None = field_(None, "fedasync/fedbuff/fedcompass: clients training at once (default: 10, or "
                                           "every client where there are fewer)", min=1)
    buffer: int = field_(5, "fedbuff: updates buffered per server step (K)", min=1)
    alpha: float = field_(0.6, "fedasync: mixing weight alpha (x = (1 - a) x + a x_client, a = alpha x s(staleness))",
                          min=0.0, max=1.0, exclusive_min=True)
    staleness: str = field_("polynomial", "staleness function s(t - tau) (Xie et al. 2019): constant (1), "
                            "polynomial ((1 + t - tau)^-a) or hinge (1 up to b, then 1 / (a (t - tau - b) + 1))",
                            choices=("constant", "polynomial", "hinge"))
    staleness_a: float = field_(0.5, "staleness exponent or slope a (0.5: FedBuff's 1/sqrt(1 + staleness))", min=0.0)
    staleness_b: float = field_(4.0, "hinge: staleness tolerated at full weight, b", min=0.0)
    min_steps: int = field_(5, "fedcompass: fewest local steps a client is given to join an arrival group (Q_min)",
                            min=1)
    max_steps: int = field_(50, "fedcompass: local steps of a client that opens a new arrival group (Q_max)", min=1)
    latest_factor: float = field_(1.2, "fedcompass: a group is aggregated with whoever has arrived at latest_factor x "
                                  "its expected duration (lambda); later members are applied on their own",
                                  min=1.0)


@dataclass
class PrivacyConfig:
    """Differential privacy of client updates (mpifl.privacy): DP-FedAvg with an accountant, or local DP."""

    mode: str = field_("off", "off; central (DP-FedAvg, McMahan et al. 2018: clients clip their delta to L2 norm "
                       "clip, the server adds Gaussian noise of std noise_multiplier x clip to the sum); or local "
                       "(each client clips and adds that noise to its own update before sending)",
                       choices=("off", "central", "local"))
    clip: float = field_(1.0, "L2 norm bound C of each client's update (the initial bound with adaptive_clip)",
                         min=0.0, exclusive_min=True)
    noise_multiplier: float = field_(1.0, "z: the noise std is z x C", min=0.0)
    sampling: str = field_("fixed", "how clients are sampled, as the accountant assumes: fixed (clients.per_round "
                           "without replacement; replace-one adjacency) or poisson (each client independently with "
                           "probability clients.per_round / clients.num_clients; add-or-remove adjacency)",
                           choices=("fixed", "poisson"))
    accountant: str = field_("rdp", "privacy accountant of Google's dp-accounting: rdp, or pld (poisson sampling "
                             "only)", choices=("rdp", "pld"))
    delta: float = field_(1e-5, "the delta of the reported (epsilon, delta)", min=0.0, max=1.0, exclusive_min=True)
    epsilon_budget: float | None = field_(None, "end the run, complete (evaluated, checkpointed, model.h5), "
                                             "before a round would take epsilon past this", min=0.0,
                                          exclusive_min=True)
    adaptive_clip: bool = field_(False, "central: the clip bound follows a quantile of the update norms (Andrew "
                                 "et al. 2021, geometric update, the count of updates within C noised)")
    target_quantile: float = field_(0.5, "adaptive_clip: the quantile of update norms C tracks", min=0.0, max=1.0)
    clip_lr: float = field_(0.2, "adaptive_clip: eta_C of C = C x exp(-eta_C (share of updates within C - "
                            "target_quantile)): C shrinks while more than the quantile are within it", min=0.0)
    count_noise: float | None = field_(None, "adaptive_clip: sigma_b, std of the noise on the count of updates "
                                          "within C (default clients per round / 20, as Andrew et al.; its share of "
                                          "the budget is taken out of noise_multiplier)", min=0.0, exclusive_min=True)


@dataclass
class SecAggConfig:
    """Secure aggregation, simulated (mpifl.privacy.secagg): the server only learns the sum."""

    enabled: bool = field_(False, "clients send their weighted updates in fixed point, masked with pairwise and "
                           "self masks that cancel or are removed in the server's sum (Bonawitz et al. 2017)")
    fraction_bits: int = field_(16, "fixed point: a client of weight w sends round(w * x * 2^bits) in Z_(2^32), "
                                "clamped to ±(2^31 - 1) / cohort so that no sum wraps: only values within ±(2^31 - 1) "
                                "/ (cohort * w * 2^bits) pass unclamped, and rank 0 warns of a round that clamps "
                                "(docs/how-to/secure-aggregation.md)", min=1, max=30)
    masking: bool = field_(True, "false: fixed point without masks, the plain sum the masked one must equal")
    min_range: float = field_(1.0, "the range a fraction_bits must give, in update units, (2^31 - 1) / "
                              "(clients.per_round * largest client weight * 2^fraction_bits), or it is refused before "
                              "any round; the largest weight is the partition's largest client under "
                              "strategy.weighting=samples once the data is read (mpifl validate, the server's start), "
                              "else 1 (0: no check)", min=0.0)
    min_cohort: int = field_(2, "the fewest participants whose sum is revealed (Bonawitz et al.'s threshold t): "
                             "clients.per_round below it is refused; a round left with fewer usable updates is "
                             "aborted, as under clients.min_participants; a Poisson or virtual-time round drawing "
                             "fewer runs without updates (1: none, a cohort of one reveals its update)", min=1)


@dataclass
class CompressionConfig:
    """Compressed updates (mpifl.wire.codecs): fewer bytes on the wire, decoded as the server folds."""

    method: str = field_("none", "none, int8 or int4: stochastic quantization with a scale per block (after "
                         "QSGD); topk: the largest compression.fraction of each chunk's values, as int32 indices "
                         "and fp32 values; for bf16 use strategy.wire_dtype", choices=("none", "int8", "int4", "topk"))
    block: int = field_(256, "elements per quantization block (one fp32 scale each)", min=8)
    fraction: float = field_(0.01, "topk: share of each chunk's values sent, k = max(1, ceil(fraction x chunk "
                             "elements))", min=0.0, exclusive_min=True, max=1.0)
    error_feedback: bool = field_(True, "topk: each logical client keeps what it did not send (an fp32 residual "
                                  "the size of the model) and adds it to its next update (EF-SGD)")
    residual_ram_mb: float = field_(1024.0, "topk with error feedback: a client rank keeps its clients' residuals "
                                    "in RAM while (hosted clients x model fp32 bytes) fits in this many MiB, "
                                    "else in an HDF5 file in the run directory, read chunk by chunk", min=0.0)


@dataclass
class OutputConfig:
    """What a run writes."""

    dir: str | None = field_(None, "run directory (default runs/<config name>-<time>)")
    save_model: bool = field_(True, "write the final global model to <run dir>/model.h5")
    progress: bool = field_(True, "progress bar on rank 0")
    trackers: list = field_(list, "experiment trackers rank 0 also logs each round to, in the run directory and "
                            "offline: tensorboard (<run dir>/tensorboard), mlflow (a file store, <run dir>/mlruns), "
                            "wandb (an offline run, <run dir>/wandb); each needs its extra, e.g. pip install "
                            "'mpifl[wandb]'", choices=TRACKERS)


# What a fault in the faults: section does (docs/how-to/faults.md), and where in a round it strikes.
FAULT_KINDS = {
    "raise": "the client's training raises an exception",
    "nan": "the client's trained model holds a NaN",
    "inf": "the client's trained model holds an Inf",
    "corrupt": "`bits` random bits of the client's update flip after its checks, as a corrupted chunk would",
    "scale": "the client's update (trained - global) is multiplied by `factor`: -1 flips its sign (a Byzantine client)",
    "noise": "the client's update (trained - global) is replaced by Gaussian noise of standard deviation `std` (a "
             "Gaussian Byzantine client; std 0: it sends no change, a free rider)",
    "label_flip": "the client trains on flipped labels, y -> C - 1 - y for C classes (data poisoning)",
    "stall": "the rank sleeps `seconds`, silent (no progress reports)",
    "slowdown": "the client's training takes `factor` x as long (the rank keeps reporting progress)",
    "exit": "the rank exits with `code`, `via` sys.exit, os._exit or C's _exit",
    "kill": "the rank sends itself SIGKILL",
    "lose": "the client's update is lost on its way to the server (stage send): it trained, and the server never folds "
            "it",
}
FAULT_STAGES = ("train", "send", "receive")
# on a client's training data, trained model or update: stage train only
UPDATE_FAULTS = ("nan", "inf", "corrupt", "scale", "noise", "slowdown", "label_flip")


@dataclass
class FaultConfig:
    """One fault injected into a run: what, on which clients or ranks, in which rounds, at which stage. Which clients
    a ``fraction`` hits is drawn from the run's seed, the round, the client and the fault's place in the list, so a
    run with faults gives the same bits every time and on any number of ranks (docs/how-to/faults.md)."""

    kind: str = field_("raise", "what happens: " + "; ".join(f"{k}: {v}" for k, v in FAULT_KINDS.items()),
                       choices=tuple(FAULT_KINDS))
    clients: list[int] = field_(list, "logical client ids hit (when trained); set one of clients, ranks, fraction",
                                min=0)
    ranks: list[int] = field_(list, "client ranks hit (every client they train); set one of clients, ranks, fraction",
                              min=1)
    fraction: float | None = field_(None, "hit this fraction of each round's trained clients, each drawn on its own "
                                          "from the seed, the round, the client and the fault's index (0: none, a "
                                          "sweep's clean baseline)", min=0.0, max=1.0)
    rounds: list[int] = field_(list, "the rounds (asynchronous modes: steps) it strikes in; empty: from_round to "
                                     "to_round", min=1)
    from_round: int = field_(1, "first round it strikes in, when rounds is empty", min=1)
    to_round: int = field_(0, "last round it strikes in, when rounds is empty (0: the run's last)", min=0)
    stage: str = field_("train", "where: train (before the client trains; update faults after), send (after the "
                                 "first chunk of the client's update), receive (before the rank takes up the model)",
                        choices=FAULT_STAGES)
    seconds: float = field_(0.0, "stall: how long; 0 with kind stall: for ever (a hang). Under clock.mode other than "
                                 "off: virtual seconds added to the task (0: it never arrives), no rank sleeps",
                            min=0.0)
    factor: float = field_(1.0, "slowdown: how many times as long the training takes (under clock.mode other than "
                                "off: its virtual compute time, transfers unchanged); scale: the update's factor")
    std: float = field_(0.0, "noise: the standard deviation of the Gaussian noise the client sends as its update "
                             "(drawn from the seed, the fault, the round, the client and the tensor)", min=0.0)
    bits: int = field_(1, "corrupt: how many bits flip in the update", min=1)
    code: int = field_(1, "exit: the exit status", min=0, max=255)
    via: str = field_("sys", "exit: sys (sys.exit), os (os._exit) or c (C's _exit, past everything Python can catch)",
                      choices=("sys", "os", "c"))

    def strikes_in(self, round_: int, rounds: int) -> bool:
        """Whether it strikes in ``round_`` of a run of ``rounds``."""
        if self.rounds:
            return round_ in self.rounds
        return self.from_round <= round_ <= (self.to_round or rounds)


@dataclass
class Config:
    """One experiment."""

    name: str = field_("experiment", "experiment name (used in the default run directory)")
    seed: int = field_(0, "root seed: sampling, partitioning and client randomness derive from it", min=0,
                            max=2**32 - 1)
    rounds: int = field_(10, "federated rounds", min=1)
    clients: ClientsConfig = field_(ClientsConfig, "participation")
    data: DataConfig = field_(DataConfig, "dataset and partitioning")
    model: ModelConfig = field_(ModelConfig, "model")
    train: TrainConfig = field_(TrainConfig, "local training")
    strategy: StrategyConfig = field_(StrategyConfig, "aggregation")
    transport: TransportConfig = field_(TransportConfig, "chunked exchange")
    timeouts: TimeoutsConfig = field_(TimeoutsConfig, "deadlines: a silent client rank ends the job, named")
    eval: EvalConfig = field_(EvalConfig, "evaluation")
    checkpoint: CheckpointConfig = field_(CheckpointConfig, "checkpoints")
    server: ServerConfig = field_(ServerConfig, "server state")
    clock: ClockConfig = field_(ClockConfig, "virtual time: heterogeneous and asynchronous clients")
    privacy: PrivacyConfig = field_(PrivacyConfig, "differential privacy of client updates")
    secagg: SecAggConfig = field_(SecAggConfig, "secure aggregation (simulated)")
    compression: CompressionConfig = field_(CompressionConfig, "compressed updates")
    output: OutputConfig = field_(OutputConfig, "outputs")
    faults: tuple[FaultConfig, ...] = field_(tuple, "faults injected on purpose, each a mapping "
                                                    "(docs/how-to/faults.md)")

    def to_dict(self) -> dict:
        """The whole configuration as nested plain dicts and lists (for the YAML dump and resume checks: a list of
        sections, ``faults``, reads back from a checkpoint's JSON as a list)."""
        return typing.cast(dict, _lists(dataclasses.asdict(self)))

    def clients_per_round(self) -> int:
        """How many logical clients take part in each round."""
        return self.clients.per_round_count()

    def updates_per_step(self) -> int:
        """The most updates one server step combines: a round's participants, a FedBuff buffer, or the clients a
        FedCompass arrival group can hold (clock.concurrency); FedAsync applies one at a time."""
        return {"fedasync": 1, "fedbuff": self.clock.buffer, "fedcompass": self.clock.in_flight()}.get(
            self.clock.mode, self.clients_per_round())

    def updates_per_step_key(self) -> str:
        """The key that sets ``updates_per_step``, as a message names it."""
        return {"fedasync": "clock.mode", "fedbuff": "clock.buffer", "fedcompass": "clock.concurrency"}.get(
            self.clock.mode, "clients.per_round")

    def steps_inside_backward(self) -> bool:
        """Whether the torch trainer steps each parameter inside backward in this run (TrainConfig's rule, and
        neither DDP across ranks nor a client half that acts after every optimizer step: SCAFFOLD's correction)."""
        return self.train.steps_inside_backward() and self.clients.ranks_per_client == 1 \
            and not self.capabilities.corrects_steps

    @property
    def capabilities(self) -> Capabilities:
        """What the strategy declares before it is built: a built-in's (``BUILTIN_CAPABILITIES``), or a plug-in
        builder's ``capabilities`` attribute (how a plug-in names its client half, ``client_rule``, and says what it
        appends to the model); else the defaults, with no client half. What a built strategy declares is checked
        against it on every rank before MPI starts (mpifl.aggregation.compatibility)."""
        builtin = BUILTIN_CAPABILITIES.get(self.strategy.name)
        if builtin is not None:
            return builtin
        if is_import_path(self.strategy.name):
            try:
                declared = getattr(resolve(self.strategy.name), "capabilities", None)
            except ImportError:  # said with its key where the strategy is built (check_plugins)
                declared = None
            if isinstance(declared, Capabilities):
                return declared
        return NO_CLIENT_HALF

    @property
    def summed_streams(self) -> bool:
        """Whether the model carries a client half's summed streams (SCAFFOLD's server control variate c)."""
        return self.capabilities.summed_streams

    @property
    def client_rule(self) -> str:
        """The strategy's client half ('control_variates', 'dynamic_regularizer': mpifl.algorithms), read from what
        it declares (``Capabilities.client_rule``), or '' for none."""
        return self.capabilities.client_rule

    @property
    def statistics_as_values(self) -> bool:
        """Whether clients send their statistics (BatchNorm's running mean and variance) as values even when they
        send deltas: in the asynchronous modes, where a change measured from the version a client trained on
        would be added to a newer model (and can take a running variance below zero). The server then takes
        the values' mean, or mixes them in (FedAsync)."""
        return self.clock.asynchronous and self.strategy.update == "delta"

    def client_state(self) -> ClientState | None:
        """The state this run keeps per logical client on the rank hosting it, which checkpoints must carry: the
        strategy's client rule (SCAFFOLD's control variates, FedDyn's gradient states), top-k error-feedback
        residuals, model.local tensors, Ditto's personal models and a plug-in trainer's declared vectors, any of them
        together in each client's one vector (mpifl.config.client_state); None for none."""
        rule = self.client_rule or None
        vectors = declared_vectors(resolve(self.train.trainer)) if is_import_path(self.train.trainer) else {}
        budgets = {"strategy.control_ram_mb": self.strategy.control_ram_mb,
                   "compression.residual_ram_mb": self.compression.residual_ram_mb,
                   "model.local_ram_mb": self.model.local_ram_mb, "train.personal_ram_mb": self.train.personal_ram_mb,
                   "train.state_ram_mb": self.train.state_ram_mb}
        return client_state(rule, self.error_feedback, bool(self.model.local), self.train.ditto_lambda > 0, vectors,
                            budgets)

    @property
    def lends_client_state(self) -> bool:
        """Whether each client's state lives on a home rank and is lent, each round, to the rank that trains the
        client: per-client state under ``clients.placement: per_round``."""
        return self.client_state() is not None and self.clients.placement == "per_round"

    @property
    def undoes_dropped_state(self) -> bool:
        """Whether client ranks journal their clients' SCAFFOLD or FedDyn vectors and a plug-in trainer's declared
        ones each round, to put back those of clients the server drops past their deadline
        (``clients.accept_failures``), which the server's c or h never took in and which must read as if the client
        had not trained (under ``clients.placement: per_round``, on each client's home rank)."""
        state = self.client_state()
        return self.clients.accept_failures and state is not None and bool(state.rule or state.vectors)

    @property
    def error_feedback(self) -> bool:
        """Whether each client keeps a residual of what top-k did not send (EF-SGD)."""
        return self.compression.method == "topk" and self.compression.error_feedback




def _lists(value: object) -> object:
    """``value`` with every tuple inside it a list, as JSON and YAML read it back."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
