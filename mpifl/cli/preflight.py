"""The checks a config passes before MPI starts, on every rank of ``mpifl run`` and in ``validate``, ``plan``,
``pbs`` and ``slurm``: what the schema cannot check (plug-ins against their signatures, data, clock traces,
transformers shapes, the model built on the meta device), so that a mistake is one line naming its key, exit 2,
and not a traceback on every rank or a job that queues only to stop at once. ``validate`` and ``partition`` also
build the partition (``check_partition``), which reads the whole dataset (or surveys one stored by client)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpifl.config import Config, ConfigError, config_warnings
from mpifl.plugins import is_import_path
from mpifl.trackers import tracker_problem

if TYPE_CHECKING:
    import numpy as np


def check_plugins(cfg: Config, partition_follows: bool = False) -> list[str]:
    """Check what the schema cannot: plugin kwargs against their signatures, transformers config keys, the
    strategy's capabilities against the run modes (a plug-in's are known only once it is imported), that
    the library of each of output.trackers is installed, and that clock.queue_trace and clock.availability_trace
    parse.

    Raises ConfigError naming the key; returns warnings for legal values that are surely mistakes.
    """
    from mpifl.aggregation.compatibility import checked_strategy
    from mpifl.algorithms import client_rule_problem, lanes_problem
    from mpifl.clock.availability import availability_trace_problem
    from mpifl.clock.queue import queue_trace_problem
    from mpifl.learning.datasets import client_source, dataset_problem, needs_dataset
    from mpifl.learning.models import model_problem
    from mpifl.learning.partitions import partition_problem
    from mpifl.learning.trainers import trainer_problem
    from mpifl.privacy.accounting import accounting_problem, budget_problem
    from mpifl.privacy.secagg import config_range_problem

    if cfg.model.name == "transformers":
        check_transformers(cfg)
    has_data = needs_dataset(cfg)
    problem = model_problem(cfg.model, has_data) or (dataset_problem(cfg.data) if has_data else None) or \
        (partition_problem(cfg.data) if has_data else None) or trainer_problem(cfg.train)
    problem = problem or tracker_problem(cfg.output.trackers) or accounting_problem(cfg.privacy.mode) or \
        budget_problem(cfg.privacy, cfg.clients.num_clients, cfg.clients_per_round()) or \
        queue_trace_problem(cfg.clock.queue_trace) or \
        availability_trace_problem(cfg.clock.availability_trace, cfg.clients.num_clients)
    if problem:
        raise ConfigError(problem)
    if cfg.clients.placement == "per_round" and has_data and client_source(cfg.data) is not None:
        raise ConfigError(f"clients.placement: 'per_round' lets any rank train any client, but data.dataset "
                          f"{cfg.data.dataset!r} split naturally is read per rank, each rank its own clients only; "
                          "use clients.placement='balanced'")
    strategy = checked_strategy(cfg)
    problem = client_rule_problem(cfg.client_rule, cfg.strategy.name) or \
        lanes_problem(cfg.client_rule, cfg.train.batched_clients)
    if problem:
        raise ConfigError(problem)
    # ``validate`` checks the range against the real largest client next (check_partition): not with a floor here
    problem = None if partition_follows and partition_readable(cfg) else config_range_problem(cfg, strategy)
    if problem:
        raise ConfigError(problem)
    return config_warnings(cfg)


def partition_readable(cfg: Config) -> bool:
    """Whether ``check_partition`` can build this run's partition in one process: whenever the run reads data (a
    dataset stored by client, split naturally, is only surveyed: every client's labels, as the run's rank 0 does)."""
    from mpifl.learning.datasets import needs_dataset

    return needs_dataset(cfg)


def check_transformers(cfg: Config) -> None:
    """A transformers model's config (an impossible shape names model.transformers.config), the text blocks against
    its positions and the tokenizer's ids against its embedding rows, and with LoRA the model itself built on the
    meta device, so that each of model.lora.target_modules must adapt a module: all before MPI starts, not as a
    traceback on every rank."""
    import torch

    from mpifl.learning import hf
    from mpifl.learning.text import block_length, vocabulary_problem

    config = hf.transformers_config(cfg.model)
    seq_len = block_length(cfg.data.kwargs) if cfg.data.dataset == "text" else None
    problem = hf.positions_problem(config, seq_len) if isinstance(seq_len, int) else None
    if problem is None and cfg.data.dataset == "text" and isinstance(getattr(config, "vocab_size", None), int):
        try:  # reads a named tokenizer's file (cheap); a trained one's size is data.kwargs.vocab_size
            problem = vocabulary_problem(cfg.data.kwargs, config.vocab_size)
        except ValueError as err:  # a missing or unreadable tokenizer file
            problem = str(err)
    if problem:
        raise ConfigError(problem)
    if cfg.model.lora.r:
        with torch.device("meta"):
            hf.build(cfg.model)


def check_model(cfg: Config, batched: bool = False) -> None:
    """Build a plug-in model, a built-in sized from the data (``lenet`` needs images of 16x16 or more), or any model
    with ``model.local`` patterns, once on the meta device, sized from the data when it asks for its shape: a
    signature or construction mistake is a ConfigError naming model.name, a pattern that names no tensor one naming
    model.local, before any MPI work. ``batched`` (``validate``'s): also any model under ``train.batched_clients``,
    refused naming that key where its clients cannot train as lanes of one batch (a module with running
    statistics, say), which a run's client ranks find only once they have built it."""
    from mpifl.learning.batched import batched_refusal
    from mpifl.learning.datasets import data_shape, needs_dataset
    from mpifl.learning.models import SIZED_BY_DATA, build_problem, supplied

    batched = batched and cfg.train.batched_clients > 0
    if not is_import_path(cfg.model.name) and cfg.model.name not in SIZED_BY_DATA and not cfg.model.local \
            and not batched:
        return
    try:
        shape = data_shape(cfg.data) if supplied(cfg.model, needs_dataset(cfg)) else {}
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"data: cannot read the data that sizes model {cfg.model.name!r}: {err}") from None
    lanes = (lambda model: batched_refusal(model, cfg.train)) if batched else None
    problem = build_problem(cfg.model, cfg.seed, lanes, **shape)
    if problem:
        raise ConfigError(problem)


def check_trainer(cfg: Config) -> None:
    """Build a plug-in trainer once, as each client rank will: a setting its constructor refuses is a ConfigError
    naming train.kwargs. Only here, not before a run's MPI starts: a trainer may touch CUDA as it is built, which
    must wait until each rank is bound to its GPU (mpifl.roles.launch)."""
    from mpifl.learning.trainers import make_trainer

    make_trainer(cfg.train)


def partition_counts_of(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The configured partition's counts (mpifl.learning.partitions.partition_counts), the whole dataset read
    here (a dataset stored by client and split naturally: surveyed, its labels read): data that cannot be read, or
    a split that cannot be made (a bad partition file, an empty client of a natural split, more clients than
    samples, more classes per client than classes), is a ConfigError, one line naming the key."""
    from mpifl.learning.datasets import client_source, load_dataset, surveyed_dataset
    from mpifl.learning.partitions import partition_counts

    try:
        source = client_source(cfg.data)
        if source is None:
            dataset = load_dataset(cfg.data)
        else:  # stored by client: its survey (every client's labels) is what the run's ranks partition
            index, test = source.survey()
            dataset = surveyed_dataset(source, index, test)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"data: cannot read the data to partition it: {err}") from None
    try:
        return partition_counts(cfg.data, dataset, cfg.clients.num_clients, cfg.seed)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot partition the data: {err}") from None


def check_partition(cfg: Config) -> list[int] | None:
    """Build the configured partition, as ``mpifl run``'s ranks will (``partition_counts_of``), for ``mpifl
    validate``: a plain process, so it may read the data once; then check secure aggregation's range for its largest
    client. Not for a run without data; a dataset read per client rank (a client source) is only surveyed, as the
    run's rank 0 surveys it; and never before ``mpifl run``'s MPI, where every rank would read the data (there a bad
    split ends the job in one line: 'cannot partition the data', and the server checks the range as it starts).
    Returns each client's training samples (None: not read)."""
    from mpifl.aggregation.strategies import make_strategy
    from mpifl.privacy.secagg import config_range_problem

    if not partition_readable(cfg):
        return None
    histogram, _ = partition_counts_of(cfg)
    sizes = [int(n) for n in histogram.sum(axis=1)]
    problem = config_range_problem(cfg, make_strategy(cfg.strategy), sizes) if cfg.secagg.enabled else None
    if problem:
        raise ConfigError(problem)
    return sizes

