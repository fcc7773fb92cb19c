"""``mpifl plan``: what a config will cost before it runs: parameters, bytes moved, memory per rank and node,
and (``--time``) the scale model's round time. The figures come from ``planning.memory`` and
``planning.scale``; this module only builds the model's spec on the meta device and prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from mpifl.config import Config, ConfigError, load_config
from mpifl.errors import UsageError
from mpifl.planning import binding
from mpifl.planning.federation import even_spread, most_trained_per_rank
from mpifl.planning.memory import (
    CUDA_HOST_BYTES,
    CUDA_WORKSPACE_BYTES,
    DataBytes,
    DecoderShape,
    MemoryEstimate,
    ModelBytes,
    batched_lanes_bytes,
    classifier_evaluation_bytes,
    client_state_elements,
    client_state_plan,
    cpu_decoder_extra_bytes,
    decoder_activation_bytes,
    decoder_evaluation_bytes,
    exchanged_what,
    gathered_unit,
    host_activations,
    journaled_elements,
    largest_fsdp_unit,
    loaned_vectors,
    memory_estimate,
    replicated_activations,
    state_rule_bytes,
    undo_vectors,
)
from mpifl.planning.routes import broadcast_tree
from mpifl.planning.scale import LUSTRE, POLARIS, Rates, round_estimate
from mpifl.planning.world import takes, world_problem
from mpifl.units import GIB, MIB, counted, format_bytes, rank_span
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import CONTROL, ModelSpec, control_bytes, is_local, itemsize


def model_specs(cfg: Config) -> tuple[ModelSpec, ModelSpec]:
    """The configured model's exchanged and frozen specs, from a meta-device build (nothing allocated); sized
    from the data when the model takes its shape (built-ins, and plug-ins that name input_shape/num_classes)."""
    return model_and_data(cfg)[0]


def model_and_data(cfg: Config) -> tuple[tuple[ModelSpec, ModelSpec], DataBytes | None]:
    """``model_specs``, and the data's bytes when the run reads data (None: it reads none). The data is read once,
    for both: a client source is only surveyed."""
    specs, data, _ = model_data_and_shape(cfg)
    return specs, data


def model_data_and_shape(cfg: Config) -> tuple[tuple[ModelSpec, ModelSpec], DataBytes | None, dict]:
    """``model_and_data``, and the data's shape (``input_shape``, ``num_classes``; empty without data)."""
    from mpifl.algorithms import model_streams
    from mpifl.learning.datasets import needs_dataset, surveyed_data
    from mpifl.learning.models import model_spec, supplied

    shape: dict = {}
    data = None
    if needs_dataset(cfg):
        shape, data = surveyed_data(cfg.data)
    sized = cfg.model.name != "transformers" and bool(set(supplied(cfg.model, True)) & {"input_shape", "num_classes"})
    key = _spec_key(cfg, shape if sized else {})
    specs = _SPECS.get(key) if key is not None else None
    if specs is None:
        specs = model_spec(cfg.model, cfg.seed, streams=model_streams(cfg.client_rule), **(shape if sized else {}))
        if key is not None:
            _SPECS[key] = specs
    return specs, data, shape


# One process's specs of built-in models, by what they are built from: the fit advice re-plans a config per layout,
# and a meta-device build of a large LoRA model takes about a second (configs/llama3.1-70b-lora.yaml's 320 adapted
# projections). A plug-in model or client rule, or a transformers model read from a folder, is built every time.
_SPECS: dict[str, tuple[ModelSpec, ModelSpec]] = {}


def _spec_key(cfg: Config, shape: dict) -> str | None:
    """What a built-in model's spec follows from, as a key (None where the build may read user code or files)."""
    from mpifl.algorithms import BUILTIN_RULES
    from mpifl.learning.models import SIZED_BY_DATA

    model = cfg.model
    builtin = model.name in (*SIZED_BY_DATA, "blob") or (model.name == "transformers" and not model.transformers.path)
    if not builtin or (cfg.client_rule and cfg.client_rule not in BUILTIN_RULES):
        return None
    return json.dumps([dataclasses.asdict(model), cfg.seed, cfg.client_rule, shape], sort_keys=True, default=str)


def size_of(exchanged: ModelSpec, frozen: ModelSpec, local: Sequence[str] = ()) -> ModelBytes:
    """Exchanged and frozen bytes, the element count of both (SCAFFOLD's control section apart), and the bytes of
    the tensors that the ``local`` patterns keep per client."""
    control = control_bytes(exchanged)
    elements = sum(e.nbytes // itemsize(e.dtype) for e in (*exchanged.entries, *frozen.entries)) - control // 4
    kept = sum(e.nbytes for e in frozen.entries if is_local(e.name, local))
    trained = [e.nbytes for e in exchanged.entries if not e.name.startswith(CONTROL + ".")]
    trained += [e.nbytes for e in frozen.entries if is_local(e.name, local)]
    parameters = sum(e.nbytes // itemsize(e.dtype) for e in exchanged.entries if not e.statistic
                     and not e.name.startswith(CONTROL + ".") and e.dtype.startswith(("float", "bfloat")))
    tensors = [(e.name, e.nbytes, True) for e in exchanged.entries if not e.name.startswith(CONTROL + ".")]
    tensors += [(e.name, e.nbytes, is_local(e.name, local)) for e in frozen.entries]  # summed streams: never gathered
    unit = largest_fsdp_unit((name, nbytes) for name, nbytes, _ in tensors)
    return ModelBytes(exchanged.total_bytes, frozen.total_bytes, elements, control, kept, max(trained, default=0),
                      parameters, largest_unit=unit, gathered_unit=gathered_unit(tensors))


def leaf_output_bytes(cfg: Config, shape: dict, batch: int) -> list[int]:
    """Every leaf module's output bytes for ``batch`` samples of the data's shape, from a forward pass on the meta
    device (nothing allocated); empty where the model cannot be built from the data's shape."""
    return [n for n, _ in leaf_outputs(cfg, shape, batch)]


def leaf_outputs(cfg: Config, shape: dict, batch: int) -> list[tuple[int, bool]]:
    """``leaf_output_bytes``, each with whether its leaf is a convolution."""
    import torch

    from mpifl.learning.models import build_model

    if "input_shape" not in shape:
        return []
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.seed, **shape)
    outputs: list[tuple[int, bool]] = []

    def count(module: torch.nn.Module, inputs: tuple, output: object) -> None:
        if isinstance(output, torch.Tensor) and not list(module.children()):
            conv = isinstance(module, torch.nn.modules.conv._ConvNd)
            outputs.append((output.numel() * output.element_size(), conv))

    handles = [m.register_forward_hook(count) for m in model.modules()]
    try:
        model(torch.empty((batch, *shape["input_shape"]), device="meta", dtype=next(model.parameters()).dtype))
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def lane_activation_bytes(cfg: Config, shape: dict) -> int:
    """One batched lane's activations for one micro-batch (``train.batched_clients``): every module's output for
    ``train.batch_size`` samples of the data's shape (``leaf_output_bytes``); 0 where the model cannot be built from
    the data's shape."""
    return sum(leaf_output_bytes(cfg, shape, cfg.train.batch_size))


def decoder_shape(cfg: Config) -> DecoderShape:
    """What a transformers decoder's activations scale with, from its transformers config."""
    from mpifl.learning.hf import transformers_config

    config = transformers_config(cfg.model)
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    dropout = max(getattr(config, key, 0.0) or 0.0 for key in DROPOUT_KEYS) > 0
    act = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
    return DecoderShape(hidden, inner, config.num_hidden_layers, config.num_attention_heads, config.vocab_size,
                        dropout=dropout, composed_gelu=act in COMPOSED_GELUS)


# A transformers config's dropout probabilities in training (GPT-2's names, then Llama's and BERT's), and the
# activations transformers writes as several torch ops (NewGELUActivation and its aliases; gelu_pytorch_tanh is fused)
DROPOUT_KEYS = ("attn_pdrop", "resid_pdrop", "attention_dropout", "hidden_dropout_prob", "hidden_dropout")
COMPOSED_GELUS = ("gelu_new", "gelu_fast", "quick_gelu")


def activation_bytes(cfg: Config, shape: dict | None = None) -> int:
    """One micro-batch's activations on a client rank (``planning.memory.decoder_activation_bytes``) for a
    transformers decoder trained by the causal_lm trainer on blocks of ``data.kwargs.seq_len`` tokens, each rank of a
    group on its share of the batch; one lane's with batched clients (``lane_activation_bytes``, from the data's
    ``shape``); 0 (not estimated) for anything else."""
    if cfg.train.batched_clients and shape:
        return lane_activation_bytes(cfg, shape)
    seq = cfg.data.kwargs.get("seq_len")
    if cfg.model.name != "transformers" or cfg.train.trainer != "causal_lm" or not isinstance(seq, int):
        return 0
    batch = -(-cfg.train.batch_size // cfg.clients.ranks_per_client)
    return decoder_activation_bytes(decoder_shape(cfg), batch, seq, itemsize(cfg.model.dtype),
                                    cfg.train.gradient_checkpointing)


def cpu_activation_bytes(cfg: Config) -> int:
    """What one micro-batch adds to ``activation_bytes`` on a client rank that trains a transformers decoder on the
    CPU (``planning.memory.cpu_decoder_extra_bytes``); 0 where activations are not estimated or lanes are batched."""
    seq = cfg.data.kwargs.get("seq_len")
    if cfg.train.batched_clients or cfg.model.name != "transformers" or cfg.train.trainer != "causal_lm" \
            or not isinstance(seq, int):
        return 0
    batch = -(-cfg.train.batch_size // cfg.clients.ranks_per_client)
    return cpu_decoder_extra_bytes(decoder_shape(cfg), batch, seq, itemsize(cfg.model.dtype),
                                   cfg.train.gradient_checkpointing)


def evaluation_batch(cfg: Config, data: DataBytes | None) -> int:
    """The samples in the largest held-out batch: ``eval.batch_size``, or the whole held-out set where it is smaller
    (known when the data is read). Federated evaluation's validation batches are taken to be no larger."""
    rows = data.test_rows if data is not None else 0
    return min(cfg.eval.batch_size, rows) if rows else cfg.eval.batch_size


def evaluation_bytes(cfg: Config, batch: int, shape: dict | None = None) -> int:
    """What one held-out batch of ``batch`` samples works with beside the model, where anything evaluates
    (``eval.every`` on the server, ``eval.federated_every`` on the clients; 0 otherwise). A transformers model is
    scored by perplexity on blocks of ``data.kwargs.seq_len`` tokens (``decoder_evaluation_bytes``: its logits
    dominate); a classifier holds its input batch, two leaf outputs at a time under no_grad (a convolution's several
    times) and the loss's fp32 log-softmax (``classifier_evaluation_bytes``)."""
    if not (cfg.eval.every or cfg.eval.federated_every):
        return 0
    seq = cfg.data.kwargs.get("seq_len")
    if cfg.model.name == "transformers":
        if not isinstance(seq, int):
            return 0
        return decoder_evaluation_bytes(decoder_shape(cfg), batch, seq, itemsize(cfg.model.dtype))
    outputs = leaf_outputs(cfg, shape or {}, batch)
    if not outputs or shape is None:
        return 0
    width = itemsize(cfg.model.dtype)
    return classifier_evaluation_bytes(batch * math.prod(shape["input_shape"]) * width, [n for n, _ in outputs],
                                       width, [conv for _, conv in outputs])


def model_bytes(cfg: Config) -> ModelBytes:
    """Exchanged and frozen bytes of the configured model, from a meta-device build."""
    return size_of(*model_specs(cfg), cfg.model.local)


def estimate(cfg: Config, nranks: int, ranks_per_node: int, server_alone: bool,
             gpus_per_node: int = 0) -> tuple[ModelBytes, MemoryEstimate]:
    """The model's size and the memory model's estimate for ``nranks`` ranks: what ``plan`` and ``pbs`` print
    (``gpus_per_node``: client ranks with ``train.device`` auto train on GPUs where there are some)."""
    from mpifl.aggregation.strategies import make_strategy

    (exchanged, frozen), data, shape = model_data_and_shape(cfg)
    batch = evaluation_batch(cfg, data)
    size = dataclasses.replace(size_of(exchanged, frozen, cfg.model.local), activations=activation_bytes(cfg, shape),
                               cpu_activations=cpu_activation_bytes(cfg),
                               evaluation=evaluation_bytes(cfg, batch, shape), evaluation_batch=batch)
    layout = ExchangeLayout.build(exchanged, cfg.transport, cfg.compression, cfg.strategy.wire_dtype,
                                  cfg.clients.groups > 0)
    return size, memory_estimate(cfg, size, layout, make_strategy(cfg.strategy), nranks, ranks_per_node,
                                 server_alone, data, gpus_per_node)


def planned_config(args: argparse.Namespace, warnings: list[str] | None = None) -> tuple[Config, int]:
    """The config of ``mpifl plan``, ``pbs`` or ``slurm`` and its client ranks (``client_ranks``), checked as ``mpifl
    run`` checks it before MPI starts (plug-ins, data, clock traces, the model built on the meta device:
    ``check_plugins``, ``check_model``), so that a job is not written, queued and started only to stop at once. The
    config's warnings are printed, or added to ``warnings`` where given (a sweep's grid points: said once each)."""
    from mpifl.cli.preflight import check_model, check_plugins

    cfg = load_config(args.config, args.overrides)
    for warning in check_plugins(cfg):
        if warnings is None:
            print(f"warning: {warning}")
        else:
            warnings.append(warning)
    check_model(cfg)
    problem = gpu_less_problem(cfg, getattr(args, "gpus_per_node", None))
    if problem:
        raise ConfigError(problem)
    return cfg, client_ranks(cfg, args)


def gpu_less_problem(cfg: Config, gpus_per_node: int | None) -> str | None:
    """A job planned with ``--gpus-per-node 0`` for a config that asks for a GPU (``train.device`` or
    ``eval.device`` 'cuda'): every rank would refuse it at start-up, after the queue wait. None otherwise (no
    ``--gpus-per-node`` given: ``mpifl plan`` from a login node without GPUs plans a GPU job all the same)."""
    if gpus_per_node != 0:
        return None
    for key, device in (("train.device", cfg.train.device), ("eval.device", cfg.eval.device)):
        if device == "cuda":
            return (f"{key}='cuda' but --gpus-per-node 0 gives the job no GPU, so every rank would refuse it at "
                    f"start-up: ask for the node's GPUs (--gpus-per-node), or set {key}=cpu (or auto)")
    return None


def client_ranks(cfg: Config, args: argparse.Namespace) -> int:
    """--client-ranks, or one client rank per client sampled in a round, or per reduction group where
    clients.groups is set (clients.ranks_per_client each); refused, as ``mpifl run`` would refuse it, where the
    config cannot run on that many (more client ranks than clients.groups, say)."""
    ranks = args.client_ranks or (cfg.clients.groups or cfg.clients_per_round()) * cfg.clients.ranks_per_client
    problem = world_problem(ranks + 1, cfg)
    if problem:
        raise ConfigError(f"{problem} (planned for {ranks} client ranks; --client-ranks sets them)")
    return ranks


def parameters_text(count: int) -> str:
    """A parameter count with its unit spelled out: '8.030 B parameters (8,030,261,248)', '5,130 parameters'."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3f} {unit} parameters ({count:,})"
    return f"{count:,} parameters"


def _print_client_state(cfg: Config, size: ModelBytes, ranks: int) -> None:
    """``mpifl plan``'s lines on per-client state: where each rank keeps it, its loans and its put-back copies."""
    per_client = cfg.clients.ranks_per_client
    state, state_elements = cfg.client_state(), client_state_elements(cfg, size)
    for hosts, hosted, home in client_state_plan(cfg, state_elements, ranks):
        assert state is not None  # a plan has rows only for a run with per-client state
        each = 4 * hosted * state_elements
        names = f"rank {hosts[0]}" if len(hosts) == 1 else f"ranks {hosts[0]}-{hosts[-1]}" \
            if hosts == list(range(hosts[0], hosts[-1] + 1)) else f"ranks {', '.join(map(str, hosts))}" \
            if len(hosts) <= 8 else f"{len(hosts)} ranks"
        if per_client > 1:
            names += f" (every rank of a group, its 1/{per_client} of each vector)" \
                if cfg.clients.sharding == "fsdp" else " (group leaders)"
        where_kept = "in RAM (counted above)" if home == "RAM" else \
            f"on disk, <run dir>/{state.folder}/rank<rank>.h5, read chunk by chunk"
        print(f"  {names}: {state.what} of up to {hosted} clients, {each / MIB:,.1f} MiB {where_kept} "
              f"({state.ram_key}={state.ram_mb:g}); a copy per kept checkpoint")
    host_count = ranks // per_client  # a group of ranks hosts its clients as one rank
    loans = loaned_vectors(cfg, host_count, client_state_plan(cfg, state_elements, ranks)[0][2]) if state else 0
    if loans:
        print(f"  clients.placement per_round: each client's state stays on its home rank (1 + c mod {ranks}) and is "
              f"lent to the rank that trains it for the round; up to {loans} whole vectors "
              f"({4 * loans * state_elements / MIB:,.1f} MiB) beside a rank's own (counted above)")
    undo = undo_vectors(cfg, host_count)
    if undo:
        copies = "copy" if undo == 1 else "copies"
        print(f"  clients.accept_failures: up to {undo} {copies} of a client's put-back state (its strategy's and its "
              f"trainer's vectors, {4 * undo * journaled_elements(cfg, size) / MIB:,.1f} MiB) kept through each round "
              "on a client rank, to put back those of clients dropped past their deadline (counted above)")


def round_traffic(cfg: Config, ranks: int, model_bytes: int, update_bytes: int) -> tuple[int, int]:
    """A round's bytes over every link, and those through the server. The model reaches each training rank once
    (from the server, or from its parent in the broadcast tree of ``transport.dispatch_fanout``), and each update
    or reduction group's sum travels once (to the server, or along the chain of ``transport.reduce: chain``, of
    which only the last hop's sum reaches the server). Only a client group's leader talks to rank 0
    (``clients.ranks_per_client``), and only ranks with a client this round train (as many as there are clients,
    at most: the placement may put two on one rank)."""
    per_round = cfg.clients_per_round()
    leaders = min(max(1, ranks // cfg.clients.ranks_per_client), per_round)  # a rank with no client gets no model
    streams = min(cfg.clients.groups, per_round) if cfg.clients.groups else per_round
    fanout = cfg.transport.dispatch_fanout
    copies_sent = len(broadcast_tree(range(leaders + 1), fanout)[0][1]) if fanout else leaders
    streams_received = 1 if cfg.transport.reduce == "chain" else streams
    return (model_bytes * leaders + update_bytes * streams,
            model_bytes * copies_sent + update_bytes * streams_received)


def step_traffic(cfg: Config, ranks: int, model_bytes: int, update_bytes: int) -> tuple[int, int, str]:
    """An asynchronous server step's bytes, all through rank 0, as (fewest, most, what): the updates the step
    applies come in, and the new version goes out once to each rank that holds a client dispatched in their place
    (one rank at least, and no more ranks than clients dispatched or client ranks). A FedCompass step applies an
    arrival group: at most every client in flight. The first step adds the first dispatch's models, and a failed or
    lost task adds another dispatch."""
    applied = {"fedasync": 1, "fedbuff": cfg.clock.buffer}.get(cfg.clock.mode, cfg.clock.in_flight())
    smallest = 1 if cfg.clock.mode == "fedcompass" else applied  # an arrival group may be one update
    fewest, most = update_bytes * smallest + model_bytes, update_bytes * applied + model_bytes * min(applied, ranks)
    what = {"fedasync": "1 update in, the new version out to its client's rank",
            "fedbuff": f"{counted(applied, 'update')} in (clock.buffer), the new version out to each rank that "
                       "holds a client sent in their place"}.get(
        cfg.clock.mode, f"an arrival group of up to {counted(applied, 'update')} in, the new version out to each "
                        "rank that holds a client sent in their place")
    return fewest, most, what


def plan_main(args: argparse.Namespace) -> int:
    """Entry point of ``mpifl plan``: bytes and expected memory per rank, without allocating the model."""
    rates = load_rates(args.rates) if args.time else None  # a bad --rates is refused before anything is printed
    cfg, ranks = planned_config(args)
    gpus = gpus_per_node(args.gpus_per_node)
    size, plan = estimate(cfg, ranks + 1, args.ranks_per_node, args.server_alone, gpus)
    moved, through_server = round_traffic(cfg, ranks, size.exchanged, plan.update_wire_bytes)
    local = f" ({format_bytes(size.local)} of it model.local, kept per client)" if size.local else ""
    if cfg.clock.asynchronous:  # no trees, chains or groups under an asynchronous clock: all through rank 0
        fewest, most, what = step_traffic(cfg, ranks, size.exchanged, plan.update_wire_bytes)
        amount = format_bytes(most) if fewest == most else f"{format_bytes(fewest)} to {format_bytes(most)}"
        traffic = (f"{cfg.clock.in_flight()} of {counted(cfg.clients.num_clients, 'client')} training at once "
                   f"(clock.concurrency), ~{amount} moved per {cfg.clock.mode} server step ({what}; through rank 0, "
                   "what a record's cost.bytes_moved counts)")
    else:
        traffic = (f"{counted(cfg.clients_per_round(), 'client')} per round, ~{format_bytes(moved)} moved per round "
                   f"(~{format_bytes(through_server)} through rank 0, what a record's cost.bytes_moved counts)")
    print(f"{args.config}: {parameters_text(size.parameters)}, {cfg.model.dtype}; exchanged "
          f"{format_bytes(size.exchanged)}, frozen {format_bytes(size.frozen)}{local}; "
          f"{counted(ranks, 'client rank')}, {traffic}")
    where = ("HDF5 windows, write staging and receive pool (out of core)" if cfg.server.state == "disk"
             else "model + pool + state")
    held_out = "labels + held-out set" + (" + one noisy copy of its inputs (data.feature_noise)"
                                          if cfg.data.feature_noise else "") + reader_note(cfg, server=True)
    on_gpu = bool(plan.server_device_bytes)
    print(f"  rank 0 (server):      ~{plan.server_bytes / GIB:8.2f} GiB  [{where}; receive pool "
          f"{format_bytes(plan.server_pool_bytes)}{data_note(plan.server_data_bytes, held_out)}"
          f"{'' if on_gpu else evaluation_note(cfg, size, plan.server_eval_bytes)}]")
    if plan.kept_updates_bytes:
        print(f"  kept updates ({cfg.strategy.name}): {format_bytes(plan.kept_updates_bytes)} per "
              f"{'server step' if cfg.clock.asynchronous else 'round'}, every participant's whole update as fp32 "
              + ("in an unlinked temporary file in $TMPDIR (disk and page cache, not rank 0's memory)"
                 if plan.kept_on_disk else "in rank 0's RAM (counted above)"))
    _print_clients(cfg, size, plan, ranks)
    fit = fewest_fitting_ranks(cfg, size, args, gpus, plan)
    if fit:
        print(fit.line())
    _print_client_state(cfg, size, ranks)
    if plan.node_data_bytes:
        print(f"  shared data: {format_bytes(plan.node_data_bytes)} once per node, in shared memory that the node's "
              "client ranks map (each counts above the pages it maps around its clients' samples; rank 1 all of them, "
              "and the data twice while it reads it)")
    print(f"  fullest node at {args.ranks_per_node} ranks per node"
          f"{' (server alone)' if args.server_alone else ''}: ~{plan.node_bytes / GIB:.1f} GiB")
    print(binding_line(args.ranks_per_node, args.cores_per_node, args.gpus_per_node))
    for warning in (node_warning(cfg, plan, args.node_memory_gb, args.server_alone,
                                 ranks_per_node=args.ranks_per_node, fit=fit),
                    gpu_warning(cfg, plan, args.gpu_memory_gb, ranks_per_gpu(args.ranks_per_node, gpus, ranks),
                                clients_beside_server(args.ranks_per_node, gpus, ranks + 1, args.server_alone), fit)):
        if warning:
            print(warning)
    for note in (placement_note(cfg, ranks, plan, args), groups_hint(cfg, ranks)):
        if note:
            print(note)
    if args.time:
        assert rates is not None  # loaded with --time
        print_time_model(cfg, size.exchanged, rates)
    return 0


def _print_clients(cfg: Config, size: ModelBytes, plan: MemoryEstimate, ranks: int) -> None:
    """``mpifl plan``'s lines on the client ranks: host memory, GPU memory, and how a group of ranks holds a client."""
    per_client = cfg.clients.ranks_per_client
    gradients = " + the largest gradient (steps inside backward)" if cfg.steps_inside_backward() else " + gradients"
    training = " + CUDA libraries" if plan.client_device_bytes else gradients + " + optimizer"
    apart = plan.reads_apart
    first = 2 if apart and ranks > 1 else 1
    if first == 2:
        print(reader_line(plan, "rank 1 (reads the data)"))
    if cfg.clients.sharding == "fsdp":
        what = sharded_what(cfg, size, bool(plan.client_device_bytes))
        print(f"  {client_ranks_head(ranks, plan.client_bytes, first)}  [{what}"
              f"{data_note(plan.client_data_bytes, client_data_what(cfg))}]")
    elif cfg.train.batched_clients and not plan.client_device_bytes:
        print(f"  {client_ranks_head(ranks, plan.client_bytes, first)}  [model + "
              f"{batched_what(cfg, size)}{data_note(plan.client_data_bytes, client_data_what(cfg))}]")
    else:
        on_gpu = bool(plan.client_device_bytes)
        host_acts = activations_note(replicated_activations(cfg, size), on_gpu,
                                     0 if on_gpu else host_activations(cfg, size) - replicated_activations(cfg, size))
        print(f"  {client_ranks_head(ranks, plan.client_bytes, first)}  [model"
              f"{training if cfg.train.trainer != 'none' else ''}"
              f"{data_note(plan.client_data_bytes, client_data_what(cfg))}; {host_acts}]")
    if apart and first == 1:
        print(reader_line(plan, "rank 1 while it reads"))
    if plan.client_device_bytes and cfg.clients.sharding == "fsdp":
        acts = f"activations {format_bytes(size.activations)}" if size.activations else "activations not included"
        print(f"  GPU of each client rank: ~{format_bytes(plan.client_device_bytes)}  [1/{per_client} of the model, "
              f"its global rows, gradients and optimizer; {gathered_text(size)}; {acts}; cuBLAS workspaces "
              f"{format_bytes(CUDA_WORKSPACE_BYTES)}]")
    elif plan.client_device_bytes and cfg.train.batched_clients:
        print(f"  GPU of each client rank: ~{format_bytes(plan.client_device_bytes)}  [replica + global copy + "
              f"{batched_what(cfg, size)}{' + group sum' if cfg.clients.groups else ''} + cuBLAS workspaces "
              f"{format_bytes(CUDA_WORKSPACE_BYTES)}; cuDNN's workspace not included]")
    elif plan.client_device_bytes:
        rule = state_rule_bytes(cfg, size)
        rule_text = f" + the training client's state {format_bytes(rule)}" if rule else ""
        estimated = replicated_activations(cfg, size)
        acts_text = f" + activations {format_bytes(estimated)}; cuDNN's workspace not included" if estimated \
            else "; activations and cuDNN's workspace not included"
        print(f"  GPU of each client rank: ~{format_bytes(plan.client_device_bytes)}  [replica + global copy"
              f"{gradients} + optimizer{' + group sum' if cfg.clients.groups else ''}{rule_text} + cuBLAS workspaces "
              f"{format_bytes(CUDA_WORKSPACE_BYTES)}{acts_text}; the host "
              f"figure above holds the CUDA libraries, {CUDA_HOST_BYTES / GIB:.2f} GiB, instead of the training "
              "state]")
    if plan.server_device_bytes:
        print(f"  GPU of rank 0 (server): ~{format_bytes(plan.server_device_bytes)}  [the model, for evaluation "
              f"(eval.device){evaluation_note(cfg, size, plan.server_eval_bytes)}]")
    if per_client > 1 and cfg.clients.sharding == "fsdp":
        print(f"  clients.ranks_per_client={per_client}, clients.sharding=fsdp: {groups_of(ranks, per_client)}, "
              f"each rank holding 1/{per_client} of its client's model; {leaders(ranks, per_client)} with rank "
              "0, a chunk at a time")
    elif per_client > 1:
        print(f"  clients.ranks_per_client={per_client}: {groups_of(ranks, per_client)} train one client at a time "
              f"each (DDP, gradient buckets counted above); {leaders(ranks, per_client)} with rank 0")


def groups_of(ranks: int, per_client: int) -> str:
    """'1 group of 2 ranks', '4 groups of 2 ranks'."""
    return f"{counted(ranks // per_client, 'group')} of {per_client} ranks"


def leaders(ranks: int, per_client: int) -> str:
    """Which ranks lead their groups: 'rank 1 leads and exchanges', 'ranks 1, 3, ... lead and exchange'."""
    first = list(range(1, ranks + 1, per_client))
    if len(first) == 1:
        return "rank 1 leads and exchanges"
    who = f"ranks 1 and {first[1]}" if len(first) == 2 else f"ranks 1, {first[1]}, ..."
    return f"{who} lead and exchange"


def client_ranks_head(ranks: int, nbytes: int, first: int = 1) -> str:
    """The start of ``mpifl plan``'s line on the client ranks from ``first`` on: 'ranks 1-4 (clients): ~    0.60 GiB
    each', or 'rank 1 (clients): ~    0.51 GiB' where there is one."""
    return f"{rank_span(first, ranks)} (clients): ~{nbytes / GIB:8.2f} GiB{' each' if ranks > first else ''}"


def reader_line(plan: MemoryEstimate, head: str) -> str:
    """``mpifl plan``'s line on rank 1 (``head``) where it peaks above the other client ranks: it reads the data and
    fills the node's shared copy, so it holds the data twice for a while (planning.memory.reading_rank_bytes)."""
    if plan.reading_bytes >= plan.reader_bytes:
        what = (f"its peak while it reads the data: libraries + the data as read + its copy in shared memory, "
                f"2 x {format_bytes(plan.node_data_bytes)}")
    else:
        what = (f"as a client rank, with every page of the shared data ({format_bytes(plan.node_data_bytes)}): "
                "it wrote them")
    return f"  {head}: ~{plan.reader_bytes / GIB:8.2f} GiB  [{what}]"


def activations_note(estimated: int, on_gpu: bool, cpu: int = 0) -> str:
    """What a replicated client rank's host line says of its activations (``estimated``: 0 when not estimated;
    ``cpu``: what training on the CPU adds to them, ``planning.memory.cpu_decoder_extra_bytes``)."""
    if cpu and not on_gpu:
        return f"activations {format_bytes(estimated + cpu)} on the CPU, backward's logit gradients and heap included"
    if not estimated:
        return "activations not included"
    return "activations on the GPU (below)" if on_gpu else f"activations {format_bytes(estimated)}"


def batched_what(cfg: Config, size: ModelBytes) -> str:
    """What the batched lanes' share of a client rank's figure holds, for its line of ``mpifl plan``."""
    acts = f"activations {format_bytes(size.activations)} a lane" if size.activations else "activations not included"
    return (f"{cfg.train.batched_clients} lanes {format_bytes(batched_lanes_bytes(cfg, size))} (weights, gradients, "
            f"frozen copies, optimizer; {acts})")


def sharded_what(cfg: Config, size: ModelBytes, on_gpu: bool) -> str:
    """What a sharded rank's figure holds, for its line of ``mpifl plan``."""
    parts = cfg.clients.ranks_per_client
    if on_gpu:
        return ("the chunk ring, the CUDA libraries and one block while the model is initialised; the shards and "
                "their global rows on the GPU (below)")
    if cfg.train.trainer == "none":
        return f"1/{parts} of the model and of the global model, the chunk ring"
    acts = f"activations {format_bytes(size.activations)}" if size.activations else "activations not included"
    return (f"1/{parts} of the model, the global model, gradients and optimizer; {gathered_text(size)}; {acts}; "
            "the chunk ring")


def gathered_text(size: ModelBytes) -> str:
    """The FSDP unit gathered whole that a sharded rank's figure counts, with its gradients where it has any."""
    held, gradients = size.gathered_unit
    if not gradients:
        return f"the largest FSDP unit gathered ({format_bytes(held)}, frozen: no gradients)"
    return f"the largest FSDP unit gathered with its gradients ({format_bytes(held)} + {format_bytes(gradients)})"


@dataclasses.dataclass(frozen=True)
class ShardedFit:
    """``fewest_fitting_ranks``' answer: the fewest ranks per client that fit (None: none up to 4096), what they put
    on each GPU (or rank), for the config as it is or for it sharded (``variant``), and where."""

    parts: int | None
    need: int
    variant: bool  # the config holds each client's whole model: the fit is for it sharded (fsdp_variant)
    on_gpu: bool
    what: str  # the memory fitted: "40 GiB GPU", or node memory per rank
    per_node: int  # GPUs (or ranks) per node

    def line(self) -> str:
        """The plan's ``fit:`` line."""
        where = "GPU" if self.on_gpu else "rank"
        if self.parts is None:
            return f"  fit: no clients.ranks_per_client up to 4096{' with fsdp' if self.variant else ''} fits a " \
                   f"{self.what}"
        nodes = f"{counted(-(-self.parts // self.per_node), 'node')} of {self.per_node} {where}s per client"
        if self.variant:
            return (f"  fit: clients.ranks_per_client={self.parts} clients.sharding=fsdp puts ~{self.need / GIB:.2f} "
                    f"GiB on each {where} (within 90% of a {self.what}): {nodes}")
        return (f"  fit: a client needs clients.ranks_per_client >= {self.parts} to fit a {self.what} "
                f"(~{self.need / GIB:.2f} GiB per rank, within 90%): {nodes}")


def fewest_fitting_ranks(cfg: Config, size: ModelBytes, args: argparse.Namespace, gpus: int,
                         plan: MemoryEstimate | None = None) -> ShardedFit | None:
    """For a given GPU (or node) memory: for a sharded config, the fewest ranks per client (powers of two) whose
    share fits in 90% of it, and the nodes that makes per client; for a config whose client holds the whole model
    (``plan``'s figure) and does not fit, the same for it sharded (``fsdp_variant``). Each candidate is re-planned
    by ``planning.memory``, as ``plan`` would plan it. None where nothing is to be fitted or no memory size given."""
    from mpifl.planning.memory import client_device_bytes, sharded_client_bytes, trains_on_gpu

    on_gpu = trains_on_gpu(cfg, gpus)
    per_rank_gb = args.gpu_memory_gb if on_gpu else (
        args.node_memory_gb / max(1, args.ranks_per_node) if args.node_memory_gb else None)
    if not per_rank_gb:
        return None
    limit = 0.9 * per_rank_gb * GIB
    sharded = cfg
    if cfg.clients.sharding != "fsdp":
        whole = (plan.client_device_bytes if on_gpu else plan.client_bytes) if plan is not None else 0
        variant = fsdp_variant(cfg)
        if whole <= limit or variant is None:
            return None
        sharded = variant
    what = f"{args.gpu_memory_gb:g} GiB GPU" if on_gpu else f"{per_rank_gb:.1f} GiB of node memory per rank"
    per_node = gpus if on_gpu and gpus else max(1, args.ranks_per_node)
    found = functools.partial(ShardedFit, variant=sharded is not cfg, on_gpu=on_gpu, what=what, per_node=per_node)
    parts = 1 if sharded is cfg else 2  # a sharded variant needs two ranks or more
    while parts <= 4096:
        shaped = dataclasses.replace(sharded, clients=dataclasses.replace(sharded.clients, ranks_per_client=parts))
        sized = dataclasses.replace(size, activations=activation_bytes(shaped))
        need = client_device_bytes(shaped, sized) if on_gpu else sharded_client_bytes(shaped, sized)
        if need <= limit:
            return found(parts, need)
        parts *= 2
    return found(None, 0)


def fsdp_variant(cfg: Config) -> Config | None:
    """``cfg`` with each client sharded over its ranks (``clients.sharding: fsdp``), or None where the config's
    checks refuse sharding (a trainer or strategy FSDP does not take)."""
    from mpifl.config.checks import check_combinations

    variant = dataclasses.replace(cfg, clients=dataclasses.replace(cfg.clients, sharding="fsdp", ranks_per_client=2))
    try:
        check_combinations(variant)
    except ConfigError:
        return None
    return variant


def placement_note(cfg: Config, ranks: int, plan: MemoryEstimate, args: argparse.Namespace) -> str | None:
    """Where a fixed placement alone lets a round put two participants on one rank (``most_trained_per_rank``),
    the rounds the server's figure above is for, and what deals them one per rank. Such a round's updates from
    that rank arrive one after the other, so the server's accumulator window spans the whole model."""
    hosts = max(1, ranks // cfg.clients.ranks_per_client)
    if cfg.clients.groups or even_spread(cfg.clients_per_round(), hosts) > 1 or \
            most_trained_per_rank(cfg.clients, hosts) <= 1:
        return None
    if takes(cfg, placement="per_round"):
        fix = "with clients.placement=per_round, which deals each round's participants over the client ranks"
        better = dataclasses.replace(cfg, clients=dataclasses.replace(cfg.clients, placement="per_round"))
    else:
        per_client = cfg.clients.ranks_per_client
        fix = f"with {1 + cfg.clients.num_clients * per_client} ranks, a rank (or group of ranks) per client"
        better, ranks = cfg, cfg.clients.num_clients * per_client
    _, alternative = estimate(better, ranks + 1, args.ranks_per_node, args.server_alone, gpus_per_node(
        args.gpus_per_node))
    return (f"  note: clients.placement='{cfg.clients.placement}' fixes each client's rank, so a round may sample "
            f"two clients of one rank; their updates then arrive one after the other and the server's accumulators "
            f"span the whole model: rank 0's figure above is for such a round. {fix[0].upper()}{fix[1:]}: rank 0 "
            f"~{alternative.server_bytes / GIB:.2f} GiB")


def groups_hint(cfg: Config, ranks: int) -> str | None:
    """Where every update travels and several clients a round share a rank, the layout the cross-device
    benchmarks run (one reduction group per client rank, of near-equal work) if this config can take it.

    A hint, not a default: a group count changes the fp32 sums, so results would differ from the config as written
    (still the same on any number of ranks); nothing can choose it from the rank count without tying results to it.
    """
    from mpifl.config import ConfigError
    from mpifl.config.checks import check_combinations
    from mpifl.learning.datasets import client_source

    per_round = cfg.clients_per_round()
    if cfg.clients.groups or ranks < 2 or per_round < 2 * ranks or cfg.clients.ranks_per_client > 1:
        return None
    by_cost = client_source(cfg.data) is None  # a natural split read per rank keeps each client on its rank
    clients = dataclasses.replace(cfg.clients, groups=ranks)
    if by_cost:
        clients = dataclasses.replace(clients, group_by="cost", placement="per_round")
    try:
        check_combinations(dataclasses.replace(cfg, clients=clients))
    except ConfigError:
        return None
    keys = f"clients.groups={ranks}" + (" clients.group_by=cost clients.placement=per_round" if by_cost else "")
    what = "sums each rank's clients before anything travels and evens the ranks' work" if by_cost else \
        "sums each rank's clients before anything travels"
    return (f"  hint: every participant's update travels to rank 0 ({per_round} a round from {ranks} client ranks); "
            f"{keys} {what}: {ranks} messages a round. Results then differ from this config's in fp32 rounding "
            "(other sums) and stay the same on any number of ranks (docs: how-to/cpu-training.md)")


def evaluation_note(cfg: Config, size: ModelBytes, nbytes: int) -> str:
    """The held-out evaluation's working set inside the server's figure, what it is made of and the key that sets
    it, for its line of ``mpifl plan``; that it is not counted where the plan cannot estimate it."""
    from mpifl.planning.memory import server_evaluates

    if not server_evaluates(cfg):
        return ""
    if not nbytes:
        return "; held-out evaluation's working set not included"
    batch = size.evaluation_batch
    if cfg.model.name == "transformers":
        what = f"{batch} x {cfg.data.kwargs.get('seq_len')} x {decoder_shape(cfg).vocab:,} logits and their fp32 " \
            "copies for the loss"
    else:
        what = f"a batch of {batch}"
    whole = " (the whole held-out set)" if batch < cfg.eval.batch_size else ""
    return f"; evaluation {format_bytes(nbytes)}: {what}{whole}, eval.batch_size sets it"


def data_note(nbytes: int, what: str) -> str:
    """The data inside a rank's figure, for its line of ``mpifl plan``."""
    return f"; data {format_bytes(nbytes)}: {what}" if nbytes else ""


def client_data_what(cfg: Config) -> str:
    """What a client rank holds of the data."""
    from mpifl.learning.datasets import client_source

    if client_source(cfg.data) is not None:
        return "every label, its own clients' inputs" + reader_note(cfg)
    if cfg.clients.placement == "per_round":
        return "every client's pages of the shared set, each client copied while it trains"
    return "the shared set's pages around its clients' samples + their copies"


def reader_note(cfg: Config, server: bool = False) -> str:
    """The library that reads the data, where it counts in a rank's data: every rank reads from a client source,
    the ``server`` otherwise not (rank 1 reads it)."""
    from mpifl.learning.datasets import client_source, reader_bytes

    if not reader_bytes(cfg.data) or (server and client_source(cfg.data) is None):
        return ""
    return " + pyarrow, which reads the table"


SLOTS_SHOWN = 8


def gpus_per_node(given: int | None) -> int:
    """--gpus-per-node, else the GPUs this machine shows (counted without starting CUDA)."""
    if given is not None:
        return given
    try:
        return len(binding.node_gpus(os.environ))
    except ValueError as err:  # a bad MPIFL_GPUS_PER_NODE
        raise SystemExit(f"--gpus-per-node not given, and {err}") from None


def binding_line(ranks_per_node: int, cores: int | None, gpus: int | None) -> str:
    """Which cores and GPU each node-local slot takes when the launcher binds nothing (mpifl.planning.binding);
    ``cores``/``gpus`` per node default to this machine's (GPUs counted without starting CUDA)."""
    this_machine = cores is None
    cores = (os.cpu_count() or 1) if cores is None else cores
    gpus = gpus_per_node(gpus)
    if ranks_per_node < 1 or cores < 1:
        return f"  binding: nothing to bind at {ranks_per_node} ranks and {cores} cores per node"
    core_of = binding.thread_siblings(range(cores)) if this_machine else None  # its hardware threads, if known
    slots = binding.node_layout(ranks_per_node, cores, gpus, core_of)
    shown = "; ".join(f"{r}: cores {c}, GPU {g}" for r, (c, g) in enumerate(slots[:SLOTS_SHOWN]))
    more = f"; ... ({len(slots) - SLOTS_SHOWN} more)" if len(slots) > SLOTS_SHOWN else ""
    return (f"  binding at {ranks_per_node} ranks per node, {cores} cores and {gpus} GPUs per node, by local rank "
            f"(unless the launcher bound them): {shown}{more}")


def node_warning(cfg: Config, plan: MemoryEstimate, node_memory_gb: float | None, server_alone: bool,
                 server_alone_offered: bool = True, ranks_per_node: int = 2, fit: ShardedFit | None = None
                 ) -> str | None:
    """A warning when the fullest node would pass 90% of ``node_memory_gb``, with advice that fits the config
    and the command (never what it already does, nor --server-alone where the command has none: ``mpifl
    slurm``); at one rank per node, where no node can hold fewer, what shrinks a rank (``client_gpu_advice``).
    None when it fits or no node size is given."""
    if node_memory_gb is None or plan.node_bytes <= 0.9 * node_memory_gb * GIB:
        return None
    advice = ["use fewer ranks per node (--ranks-per-node)"] if ranks_per_node > 1 else []
    if server_alone_offered and not server_alone:
        advice.append("give the server a node to itself (--server-alone)")
    if cfg.server.state != "disk":
        advice.append("keep the server's model out of core (server.state=disk)")
    if ranks_per_node <= 1:
        advice += client_gpu_advice(cfg, fit) or ["use nodes with more memory (--node-memory-gb counts what one "
                                                  "holds)"]
    return (f"warning: {plan.describe(exchanged_what(cfg))} > 90% of {node_memory_gb:g} GiB per node: "
            f"{', or '.join(advice)}")


def ranks_per_gpu(ranks_per_node: int, gpus_per_node: int, client_ranks: int) -> int:
    """Client ranks on the fullest GPU of a node of client ranks: they take its GPUs by local rank
    (``planning.binding.slot_gpu``), so with fewer GPUs than ranks several share one."""
    return _fullest_gpu_slots(min(ranks_per_node, client_ranks), gpus_per_node)


def clients_beside_server(ranks_per_node: int, gpus_per_node: int, nranks: int, server_alone: bool) -> int:
    """Client ranks on the server's GPU: the server is local rank 0 of the first node and takes its first GPU
    (``planning.binding.slot_gpu``), with the local ranks that map to it (none when it has a node to itself)."""
    if server_alone or gpus_per_node <= 0:
        return 0
    gpus = [str(g) for g in range(gpus_per_node)]
    first = binding.slot_gpu(gpus, 0)
    return sum(binding.slot_gpu(gpus, r) == first for r in range(1, min(ranks_per_node, nranks)))


def _fullest_gpu_slots(slots: int, gpus_per_node: int) -> int:
    """The most of ``slots`` node-local ranks that share one GPU (0 without GPUs)."""
    if gpus_per_node <= 0 or slots <= 0:
        return 0
    gpus = [str(g) for g in range(gpus_per_node)]
    return max(Counter(binding.slot_gpu(gpus, r) for r in range(slots)).values())


def gpu_warning(cfg: Config, plan: MemoryEstimate, gpu_memory_gb: float | None, sharing: int = 1,
                beside_server: int = 0, fit: ShardedFit | None = None) -> str | None:
    """A warning when the fullest GPU would pass 90% of ``gpu_memory_gb`` (activations counted where the plan estimates
    them: a decoder's, batched lanes'): one holding
    ``sharing`` client ranks, or the server's, with its evaluation copy (``eval.device``) and ``beside_server``
    client ranks. Its advice fits the config (never what it already does or cannot do), the ranks per client that
    fit first where more would (``fit``: the plan's fit: line, ``fewest_fitting_ranks``); None when every GPU fits,
    no rank uses a GPU, or no GPU size is given."""
    clients = plan.client_device_bytes * max(sharing, 1)
    servers = plan.server_device_bytes + plan.client_device_bytes * beside_server if plan.server_device_bytes else 0
    if gpu_memory_gb is None or max(clients, servers) <= 0.9 * gpu_memory_gb * GIB:
        return None
    each = f"~{plan.client_device_bytes / GIB:.2f} GiB"
    if servers > clients:
        ranks = f" and {beside_server} client rank{'s' if beside_server > 1 else ''} x {each}" if beside_server else ""
        what = f"the server's GPU holds ~{servers / GIB:.2f} GiB (its evaluation copy{ranks})"
        advice = ["evaluate on the CPU (eval.device=cpu)"]
        if beside_server:
            advice.append("give the server a node to itself (--server-alone)")
    else:
        what = f"the fullest GPU holds {sharing} client ranks x {each}" if sharing > 1 else \
            f"the fullest GPU holds a client rank's {each}"
        advice = ["give each client rank a GPU of its own (fewer ranks per node)"] if sharing > 1 else []
    if plan.client_device_bytes and (servers <= clients or beside_server):
        advice += client_gpu_advice(cfg, fit)
    if not advice:
        advice.append("use a GPU with more memory: a client's whole model trains on one GPU (DDP, no sharding)")
    return f"warning: {what}, > 90% of {gpu_memory_gb:g} GiB: {', or '.join(advice)}"


def client_gpu_advice(cfg: Config, fit: ShardedFit | None = None) -> list[str]:
    """What shrinks a client rank's GPU memory, of what the config does not do yet and can do: first the ranks per
    client that fit (``fit``, the plan's fit: line), where the config shards and more ranks fit or it could shard."""
    advice = []
    fits = fit.parts if fit is not None and fit.on_gpu else None
    if fit is not None and fits and cfg.clients.sharding == "fsdp" and fits > cfg.clients.ranks_per_client:
        advice.append(f"raise clients.ranks_per_client to {fits}, which puts ~{fit.need / GIB:.2f} GiB on each GPU "
                      f"(the fit: line)")
    if cfg.clients.sharding != "fsdp" and fsdp_variant(cfg) is not None:
        shard = f"clients.ranks_per_client={fits} clients.sharding=fsdp, the fit: line" if fits else \
            "clients.sharding=fsdp; the fit: line says how many"
        advice.append(f"shard each client over several GPUs ({shard})")
    if cfg.model.name == "transformers" and not cfg.model.lora.r:
        advice.append("train LoRA adapters only (model.lora.r)")
    if not cfg.model.trainable and not cfg.model.lora.r:  # under LoRA only the adapters train already
        advice.append("train a subset of the tensors (model.trainable)")
    if cfg.model.dtype == "float32":
        advice.append("train in bfloat16 (model.dtype)")
    if cfg.train.optimizer != "sgd":
        advice.append("use SGD, which keeps at most one state per parameter (train.optimizer)")
    with_steps_in_backward = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, step_in_backward=True))
    if not cfg.steps_inside_backward() and with_steps_in_backward.steps_inside_backward():
        advice.append("step inside backward, which frees each gradient at once (train.step_in_backward)")
    return advice


def load_rates(name: str) -> Rates:
    """``--rates``: a preset of mpifl.planning.scale, or a JSON file of Rates fields (e.g. measured by
    profiling/scale_check.py)."""
    presets = {"polaris": POLARIS, "lustre": LUSTRE}
    if name in presets:
        return presets[name]
    path = Path(name)
    if not path.is_file():
        raise UsageError(f"argument --rates: {name!r} is neither a preset ({', '.join(presets)}) nor a JSON file")
    try:
        fields = json.loads(path.read_text())
        return Rates(**{"name": path.stem, **fields, "sources": tuple(fields.get("sources", ()))})
    except (TypeError, AttributeError, ValueError) as err:  # not JSON, not a mapping, or not Rates' fields
        raise UsageError(f"argument --rates: {name}: {err}") from None


def print_time_model(cfg: Config, exchanged: int, rates: Rates) -> None:
    """The scale model's round time for this config: point-to-point against a dispatch tree with a chain
    reduction, in memory against out of core (mpifl.planning.scale)."""
    clients, width = cfg.clients_per_round(), itemsize(cfg.model.dtype)
    print(f"  predicted round, {clients} clients, model-only exchange, rates: {rates.name} "
          f"(link {rates.link / 1e9:g} GB/s, fold {rates.fold / 1e9:g}/{rates.fold_narrow / 1e9:g} G elements/s "
          f"fp32/narrow, disk {rates.disk_read / 1e9:g}/{rates.disk_write / 1e9:g} GB/s read/write)")
    for tree in (False, True):
        for out_of_core in (False, True):
            e = round_estimate(exchanged, width, clients, rates, tree=tree, out_of_core=out_of_core,
                               chunk_bytes=cfg.transport.chunk_bytes)
            kind = ("tree + chain" if tree else "point-to-point") + (", out of core" if out_of_core
                                                                           else ", in memory")
            print(f"    {kind:<38} {e.total:9.1f} s  (dispatch {e.dispatch:.1f} s, return + fold {e.gather:.1f} s; "
                  f"server sends {e.server_out / GIB:,.0f} GiB, receives {e.server_in / GIB:,.0f} GiB)")
