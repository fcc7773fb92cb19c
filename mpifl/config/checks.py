"""Checks across sections, after each section is valid on its own."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from mpifl.config.automatic import automatic_concurrency
from mpifl.config.capabilities import BUILTIN_CAPABILITIES, KRUM_SELECTIONS, STRATEGY_KEYS, Capabilities, reads_key
from mpifl.config.client_state import RULE_VECTORS, declared_vectors
from mpifl.config.schema import ConfigError
from mpifl.config.sections import ASYNCHRONOUS_MODES, UPDATE_FAULTS, Config, FaultConfig, LoraConfig
from mpifl.plugins import is_import_path, resolve


def check_combinations(cfg: Config) -> None:
    """Refuse combinations of valid values that cannot run together, naming the key."""
    if cfg.model.name == "blob" and (cfg.train.trainer == "torch" or cfg.eval.every):
        raise ConfigError("model.name: 'blob' is a benchmark payload with no data: it needs eval.every=0 and a "
                          "trainer other than 'torch' (e.g. train.trainer='none')")
    _check_transformers(cfg)
    if cfg.model.init_from is not None and not Path(cfg.model.init_from).is_file():
        raise ConfigError(f"model.init_from: checkpoint file {cfg.model.init_from!r} does not exist")
    if cfg.eval.federated_every and cfg.data.val_fraction == 0:
        raise ConfigError("eval.federated_every: federated evaluation needs local validation splits; "
                          "set data.val_fraction (e.g. 0.1)")
    if cfg.train.kwargs and not is_import_path(cfg.train.trainer):
        raise ConfigError(f"train.kwargs: the built-in trainer {cfg.train.trainer!r} takes its settings from the train "
                          "section's own keys; train.kwargs is for a plug-in (train.trainer: package.module:Trainer)")
    if cfg.clients.min_participants > cfg.clients_per_round():
        raise ConfigError(f"clients.min_participants: {cfg.clients.min_participants} is more than the "
                          f"{cfg.clients_per_round()} clients sampled per round")
    _check_strategy(cfg)
    _check_groups(cfg)
    _check_reduce(cfg)
    _check_clock(cfg)
    _check_privacy(cfg)
    _check_secagg(cfg)
    _check_compression(cfg)
    _check_local(cfg)
    _check_ditto(cfg)
    _check_declared_vectors(cfg)
    _check_ranks_per_client(cfg)
    _check_sharding(cfg)
    _check_batched_clients(cfg)
    _check_per_round_placement(cfg)
    _check_feature_noise(cfg)
    for i, fault in enumerate(cfg.faults):
        _check_fault(cfg, fault, f"faults[{i}]")
    if (cfg.data.partition == "file") != (cfg.data.partition_file is not None):
        raise ConfigError("data.partition_file: set it exactly when data.partition is 'file'")
    if cfg.data.partition_file is not None and not Path(cfg.data.partition_file).is_file():
        raise ConfigError(f"data.partition_file: {cfg.data.partition_file!r} does not exist")
    if cfg.server.state == "disk" and cfg.eval.every:
        raise ConfigError("eval.every: the out-of-core server (server.state='disk') never holds the whole model, "
                          "so it cannot evaluate it; set eval.every=0")


FEDASYNC = "clock.mode: 'fedasync' mixes each client's trained weights into the model (x = (1 - a) x + a x_client)"
DECLARE = ("declare it on the combiner, e.g. `capabilities = Capabilities(summable=True, needs_every_row=False)` "
           "(from mpifl.api) when its fold is acc += w * x")


def _check_strategy(cfg: Config) -> None:
    """A built-in strategy's run modes, by its capabilities (a plug-in's are checked once it is imported:
    mpifl.aggregation.compatibility); strategy.kwargs is for plug-ins only."""
    caps = BUILTIN_CAPABILITIES.get(cfg.strategy.name)
    if caps is None:
        return
    if cfg.strategy.kwargs:
        raise ConfigError(f"strategy.kwargs: the built-in strategy {cfg.strategy.name!r} takes its settings from "
                          "strategy's own keys (weighting, server_lr, momentum, beta1, beta2, tau, trim_fraction, "
                          "byzantine_clients, krum_keep, geomed_*); "
                          "strategy.kwargs is for a plug-in (strategy.name: package.module:name)")
    problem = capability_problem(cfg, caps)
    if problem:
        raise ConfigError(problem)
    f, n = cfg.strategy.byzantine_clients, cfg.updates_per_step()
    selection = KRUM_SELECTIONS.get(cfg.strategy.name)
    if selection and f >= n:
        rule, factor = selection
        raise ConfigError(f"strategy.byzantine_clients: f={f} is not below the {n} updates per server step "
                          f"({cfg.updates_per_step_key()}): no update could be trusted; {rule}'s guarantee needs "
                          f"n >= {factor}f + 3")



def capability_problem(cfg: Config, caps: Capabilities, declared: bool = True) -> str | None:
    """The first run mode the configured strategy cannot take, judged by what it is (never by its name), or None.

    ``declared=False``: the strategy declares nothing, ``caps`` is the safe assumption, and the message says
    how to declare what it is.
    """
    name = cfg.strategy.name
    problem = (caps.own_total and _own_total_problem(cfg, name)) or \
        (caps.client_state and _client_state_problem(cfg, name))
    if problem:
        return problem
    if caps.equal_weights and cfg.strategy.weighting != "equal":
        return (f"strategy.weighting: strategy {name!r} averages the participants equally, and its server state "
                "assumes it (Capabilities.equal_weights): set strategy.weighting='equal'")
    if caps.summable:
        if cfg.clock.mode == "fedasync" and caps.server_state:
            return (f"{FEDASYNC}: it needs strategy.name='fedavg' or another strategy without server state "
                    f"(Capabilities.server_state=False), and strategy.update='weights'; strategy {name!r} keeps "
                    "server state, which the mixing would drop")
        return None
    what = _not_summable(name, caps, declared)
    remedy = f"; {DECLARE}, or " if not declared else "; "
    if cfg.clients.groups:
        return f"clients.groups: strategy {what}, so it cannot be summed on the ranks first{remedy}set clients.groups=0"
    if cfg.transport.reduce == "chain":
        return f"transport.reduce: 'chain' adds partial sums, but strategy {what}{remedy}set transport.reduce='direct'"
    if cfg.privacy.mode != "off":
        return (f"strategy.name: privacy.mode {cfg.privacy.mode!r} needs a mean (fedavg, fedavgm, the adaptive ones): "
                f"noise calibrated to a sum; strategy {what}{remedy}choose a summable strategy")
    if cfg.secagg.enabled:
        return (f"strategy.name: secagg.enabled needs a sum-based strategy: the server sees only the sum; strategy "
                f"{what}{remedy}choose a summable strategy")
    if cfg.compression.method == "topk" and caps.needs_every_row and (caps.coordinate_wise or not caps.whole_update):
        return (f"compression.method: 'topk' sends each client's update as its largest fraction of coordinates, zeros "
                f"elsewhere, and strategy {what}: a coordinate-wise order statistic (median, trimmed mean, Bulyan's "
                f"values nearest the median) of sparse "
                f"updates is mostly zeros, a coordinate being 0 wherever fewer than half the participants kept it"
                f"{remedy}set compression.method to 'int8', 'int4' or 'none', or choose a summable strategy.name")
    if cfg.clock.mode == "fedasync":
        return (f"{FEDASYNC}: it needs strategy.name='fedavg' or another summable strategy, and "
                f"strategy.update='weights'; strategy {what}{remedy}choose a summable strategy")
    return None


def _own_total_problem(cfg: Config, name: str) -> str | None:
    """Why a strategy that divides by a total of its own (Capabilities.own_total) cannot take this config."""
    why = f"strategy {name!r} divides the weighted sum of deltas by its own total (Capabilities.own_total)"
    if cfg.strategy.update != "delta":
        return f"strategy.update: {why}, so clients must send deltas: set strategy.update='delta'"
    if cfg.privacy.mode != "off":
        return (f"privacy.mode: DP-FedAvg divides by a fixed expected count, which would replace it; {why}: "
                "set privacy.mode='off' or choose fedavg")
    if cfg.clock.mode in ASYNCHRONOUS_MODES:
        return (f"clock.mode: {cfg.clock.mode!r} weighs updates by staleness instead; {why}: choose a synchronous "
                "clock.mode ('off' or 'sync') or fedavg")
    return None


def _client_state_problem(cfg: Config, name: str) -> str | None:
    """Why a strategy that keeps state per logical client (Capabilities.client_state) cannot take this config."""
    why = (f"strategy {name!r} keeps a vector per client, updated from the client's own delta "
           "(Capabilities.client_state)")
    state = RULE_VECTORS.get(cfg.client_rule, "state")
    if cfg.strategy.update != "delta":
        return f"strategy.update: {why}, and it works on deltas: set strategy.update='delta'"
    if cfg.privacy.mode != "off":
        return (f"privacy.mode: clipping and noising the update would make the delta the server sums differ from the "
                f"one each client folds into its own {state}; {why}: set privacy.mode='off' or choose fedavg")
    if cfg.secagg.enabled:
        masked = ("the summed streams a client half appends to each update (SCAFFOLD's control variates)"
                  if cfg.summed_streams else "strategies that keep a vector per client")
        return (f"secagg.enabled: masked fixed-point updates are not implemented for {masked}; "
                f"{why}: set secagg.enabled=false or choose fedavg")
    if cfg.compression.method != "none":
        return (f"compression.method: a compressed update would lose parts of the delta that the client has "
                f"already folded into its own {state}; {why}: set compression.method='none' or choose fedavg "
                "(which takes int8, int4 and top-k)")
    if cfg.strategy.wire_dtype in ("bfloat16", "float16") and cfg.model.dtype not in ("bfloat16", "float16"):
        return (f"strategy.wire_dtype: a {cfg.strategy.wire_dtype} update loses low bits of the delta that the client "
                f"has already folded into its own {state} at full precision, so the server's state drifts from the "
                f"clients'; {why}: unset strategy.wire_dtype or choose fedavg")
    if cfg.clock.mode in ASYNCHRONOUS_MODES:
        return (f"clock.mode: {cfg.clock.mode!r} applies stale updates one by one; {why} and needs synchronous "
                "rounds: choose clock.mode 'off' or 'sync'")
    if cfg.train.trainer not in ("torch", "causal_lm") and name in BUILTIN_CAPABILITIES:  # a plug-in's is its own
        return (f"train.trainer: {why}, and the built-in trainers ('torch', 'causal_lm') are the ones whose steps it "
                f"corrects; {cfg.train.trainer!r} is not supported: set train.trainer='torch' or 'causal_lm'")
    return None


def _not_summable(name: str, caps: Capabilities, declared: bool) -> str:
    """Why strategy ``name`` is not summable, naming the capability."""
    if not declared:
        return (f"{name!r} declares no Capabilities, so mpifl assumes it is not summable (summable=False) and "
                "needs every participant's own update")
    if caps.needs_every_row:
        return f"{name!r} needs every participant's own update (summable=False, needs_every_row=True)"
    return f"{name!r} is not summable (summable=False)"


def _check_clock(cfg: Config) -> None:
    """clock.*: the traces exist (clock.queue_trace is read whole where a job is checked before it starts:
    mpifl.clock.queue.queue_trace_problem), and an asynchronous mode has what it needs (``_check_asynchronous``)."""
    clock = cfg.clock
    for key in ("trace", "availability_trace"):
        if getattr(clock, key) is not None and not Path(getattr(clock, key)).is_file():
            raise ConfigError(f"clock.{key}: {getattr(clock, key)!r} does not exist")
    if clock.availability == "trace" and clock.availability_trace is None:
        raise ConfigError("clock.availability: 'trace' needs clock.availability_trace "
                          "(a JSON file of online intervals)")
    if clock.mode == "off":
        return
    if cfg.server.state == "disk":
        raise ConfigError(f"clock.mode: {clock.mode!r} runs with the in-memory server only; set server.state='memory'")
    if clock.mode != "sync":
        _check_asynchronous(cfg)


def _check_asynchronous(cfg: Config) -> None:
    """An asynchronous clock.mode (fedasync, fedbuff, fedcompass): each update applied at its own virtual arrival."""
    clock = cfg.clock
    if cfg.clients.groups:
        raise ConfigError(f"clients.groups: clock.mode {clock.mode!r} applies each update at its own virtual arrival, "
                          "so updates cannot be summed on the ranks first; set clients.groups=0")
    if clock.mode == "fedasync" and cfg.strategy.update != "weights":
        raise ConfigError(f"{FEDASYNC}: it needs strategy.update='weights'")
    if clock.mode in ("fedbuff", "fedcompass") and cfg.strategy.update != "delta":
        raise ConfigError(f"clock.mode: {clock.mode!r} averages the buffered clients' deltas, each against the "
                          "version it trained on: set strategy.update='delta'")
    if clock.mode == "fedcompass":
        if clock.min_steps > clock.max_steps:
            raise ConfigError(f"clock.min_steps: {clock.min_steps} is more than clock.max_steps={clock.max_steps}")
        if cfg.train.trainer not in ("torch", "causal_lm"):
            raise ConfigError("train.trainer: 'fedcompass' gives each client its own number of local steps, which "
                              "only the built-in 'torch' and 'causal_lm' trainers take")
    if clock.in_flight() > cfg.clients.num_clients:
        raise ConfigError(f"clock.concurrency: {clock.concurrency} is more than the {cfg.clients.num_clients} clients")
    if clock.mode == "fedcompass":
        return
    buffer = 1 if clock.mode == "fedasync" else clock.buffer
    if cfg.clients.min_participants > buffer:
        raise ConfigError(f"clients.min_participants: {cfg.clients.min_participants} is more than the {buffer} "
                          f"update(s) each {clock.mode} step applies")


def _check_privacy(cfg: Config) -> None:
    privacy = cfg.privacy
    if privacy.mode == "off":
        return
    needs = [("strategy.update", cfg.strategy.update == "delta", "'delta' (clients clip their delta)"),
             ("strategy.weighting", cfg.strategy.weighting == "equal",
              "'equal' (a sample-weighted mean lets one client move the model by more than the clip bound)"),
             ("clients.groups", not cfg.clients.groups, "0 (each update is clipped on its own)"),
             ("strategy.wire_dtype", cfg.strategy.wire_dtype is None, "unset (updates are clipped in fp32)"),
             ("clock.mode", cfg.clock.mode == "off", "'off' (the accountant assumes uniform sampling)")]
    for key, fine, what in needs:
        if not fine:
            raise ConfigError(f"{key}: privacy.mode {privacy.mode!r} needs {what}")
    if privacy.accountant == "pld" and privacy.mode == "central" and privacy.sampling == "fixed":
        raise ConfigError("privacy.accountant: 'pld' accounts Poisson sampling; use privacy.sampling='poisson' or "
                          "the 'rdp' accountant for fixed-size sampling")
    sigma_b = privacy.count_noise if privacy.count_noise is not None else cfg.clients_per_round() / 20
    if privacy.adaptive_clip and privacy.mode == "central" and 2 * sigma_b <= privacy.noise_multiplier:
        raise ConfigError(f"privacy.count_noise: adaptive clipping takes (2 sigma_b)^-2 out of z^-2, so it needs "
                          f"2 x count_noise ({2 * sigma_b:g}) > noise_multiplier ({privacy.noise_multiplier}); raise "
                          "privacy.count_noise or clients.per_round")


def _check_secagg(cfg: Config) -> None:
    if not cfg.secagg.enabled:
        return
    needs = [("model.dtype", cfg.model.dtype == "float32",
              "'float32' (fixed-point ring values travel in fp32's bytes)"),
             ("strategy.wire_dtype", cfg.strategy.wire_dtype is None,
              "strategy.wire_dtype unset (masked updates travel as fixed-point ring values in fp32's bytes, which "
              f"{cfg.strategy.wire_dtype} cannot hold): unset strategy.wire_dtype, or set secagg.enabled=false to "
              "keep it"),
             ("clients.groups", not cfg.clients.groups, "0 (each client masks its own update)"),
             ("clock.mode", cfg.clock.mode in ("off", "sync"), "'off' or 'sync' (a cohort shares its masks)"),
             ("privacy.mode", cfg.privacy.mode != "local", "'off' or 'central' (local DP needs no secure sum)")]
    for key, fine, what in needs:
        if not fine:
            raise ConfigError(f"{key}: secagg.enabled needs {what}")
    cohort, least = cfg.clients_per_round(), cfg.secagg.min_cohort
    if cohort < least:
        expected = " (the expected cohort under Poisson sampling)" if cfg.privacy.sampling == "poisson" and \
            cfg.privacy.mode != "off" else ""
        raise ConfigError(f"secagg.min_cohort: {least} is more than the {cohort} clients sampled per round"
                          f"{expected}: the masked sum of fewer than {least} reveals what they sent (one client's "
                          f"update, exactly); raise clients.per_round to {least} or more (secagg.min_cohort=1 "
                          "accepts a cohort of one, and reveals its update)")


def _check_compression(cfg: Config) -> None:
    if cfg.compression.method == "none":
        return
    needs = [("strategy.wire_dtype", cfg.strategy.wire_dtype is None, "unset (one encoding at a time)"),
             ("clients.groups", not cfg.clients.groups or cfg.compression.method != "topk",
              "clients.groups=0 (top-k sparsifies each client's own update and error feedback keeps a residual "
              "per client, while a group sends one sum; int8 and int4 quantize group sums)"),
             ("transport.reduce", cfg.transport.reduce == "direct", "'direct' (the chain adds fp32 sums)"),
             ("secagg.enabled", not cfg.secagg.enabled,
              "secagg.enabled=false (secure aggregation sends its own fixed-point values, one encoding at a time); "
              "or set compression.method='none' to keep secure aggregation"),
             ("privacy.mode", cfg.privacy.mode != "local", "'off' or 'central'")]
    if cfg.compression.method == "topk":
        needs.append(("strategy.update", cfg.strategy.update == "delta", "'delta' (a sparse update is a change)"))
        if cfg.compression.error_feedback:
            needs.append(("clock.mode", cfg.clock.mode in ("off", "sync"), "'off' or 'sync' with "
                          "compression.error_feedback (an asynchronous resume retrains clients, which would add "
                          "their residuals twice); or set compression.error_feedback=false"))
    for key, fine, what in needs:
        if not fine:
            raise ConfigError(f"{key}: compression.method {cfg.compression.method!r} needs {what}")


def _check_local(cfg: Config) -> None:
    """model.local (FedBN, FedPer): tensors kept per client on its rank, beside what would keep other state. With
    SCAFFOLD, FedDyn or top-k error feedback both live in each client's one vector (Config.client_state); their
    rule then covers only the tensors that travel."""
    if not cfg.model.local:
        return
    why = "model.local keeps each client's own copy of those tensors on the rank that hosts it"
    problem = _synchronous_problem(cfg, "model.local", why)
    if problem:
        raise ConfigError(problem)


def _check_declared_vectors(cfg: Config) -> None:
    """A plug-in trainer's declared per-client vectors (``client_state``): a well-formed declaration, kept between
    synchronous rounds (a client trained again before its last update is applied would start from a vector its
    server never saw the effect of)."""
    if not is_import_path(cfg.train.trainer):
        return
    try:
        vectors = declared_vectors(resolve(cfg.train.trainer))
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from None
    if not vectors:
        return
    local = [name for name, vector in vectors.items() if vector.covers == "local"]
    if local and not cfg.model.local:  # it would be a vector of no elements, silently
        raise ConfigError(f"train.trainer: the client_state {local[0]!r} of {cfg.train.trainer!r} covers 'local', the "
                          "model.local tensors, but model.local names none: set model.local, or cover 'trainable'")
    why = f"{cfg.train.trainer!r} keeps {', '.join(vectors)} per client (its client_state) on the rank that hosts it"
    problem = _synchronous_problem(cfg, "train.trainer", why)
    if problem:
        raise ConfigError(problem)


def _check_ditto(cfg: Config) -> None:
    """train.ditto_lambda (Ditto): a personal model per client on the rank that hosts it."""
    if not cfg.train.ditto_lambda:
        return
    why = "train.ditto_lambda keeps a personal model per client on the rank that hosts it"
    if cfg.model.local and cfg.clients.ranks_per_client > 1:
        raise ConfigError(f"train.ditto_lambda: {why}, with model.local its own local tensors too, which a group "
                          "of ranks (clients.ranks_per_client) does not train yet: set clients.ranks_per_client=1")
    if cfg.train.trainer not in ("torch", "causal_lm"):
        raise ConfigError(f"train.trainer: {why}, trained by a built-in trainer ('torch', 'causal_lm'); "
                          f"{cfg.train.trainer!r} is not supported with it yet: set train.trainer='torch'")
    if cfg.train.prox_mu:
        raise ConfigError(f"train.prox_mu: {why}, pulled towards the global model by its own lambda; FedProx's "
                          "term would pull it towards where it started instead: set train.prox_mu=0")
    problem = _synchronous_problem(cfg, "train.ditto_lambda", why)
    if problem:
        raise ConfigError(problem)


def _synchronous_problem(cfg: Config, key: str, why: str) -> str | None:
    """What per-client state (``key``, because ``why``) cannot run with yet: an asynchronous clock, where a client
    may train again before its last update is applied."""
    if cfg.clock.mode in ASYNCHRONOUS_MODES:
        return (f"{key}: {why}; with clock.mode {cfg.clock.mode!r} a client may train again before its last "
                "update is applied: choose clock.mode 'off' or 'sync'")
    return None


def _check_ranks_per_client(cfg: Config) -> None:
    """A client trained by several ranks: the built-in trainers shard their batches (per-client state stays with
    the group's leader, which sends the members their part: ``ClientState``)."""
    if cfg.clients.ranks_per_client == 1:
        return
    why = f"clients.ranks_per_client={cfg.clients.ranks_per_client} trains each client on a group of ranks"
    if cfg.train.trainer not in ("torch", "causal_lm"):
        raise ConfigError(f"train.trainer: {why}, each rank on its share of every batch, which the built-in "
                          f"'torch' and 'causal_lm' trainers do; {cfg.train.trainer!r} does not: set "
                          "clients.ranks_per_client=1")


def _check_sharding(cfg: Config) -> None:
    """``clients.sharding: fsdp``: what a sharded client group runs today (mpifl.roles.sharded). Each refusal names
    its key; none of these is refused for a reason of principle, only because the sharded path does not carry it yet."""
    if cfg.clients.sharding != "fsdp":
        return
    why = "clients.sharding: 'fsdp' shards each client's model over its group of ranks"
    if cfg.clients.ranks_per_client == 1:
        raise ConfigError(f"clients.ranks_per_client: {why}, and with 1 rank per client there is nothing to shard: "
                          "set clients.ranks_per_client=2 or more, or clients.sharding='replicate'")
    if cfg.model.name != "transformers":
        raise ConfigError(f"model.name: {why}, building it on the meta device and initialising it module by module, "
                          f"which it does for transformers models; {cfg.model.name!r} is small enough to replicate: "
                          "set clients.sharding='replicate'")
    state = cfg.client_state()
    not_yet = [
        ("model.init_from", cfg.model.init_from is None, "unset (each rank would read its rows of the checkpoint)"),
        ("per-client state (model.local, declared vectors)", state is None or not (state.local or state.vectors),
         "none but a strategy's client half (SCAFFOLD's c_i, FedDyn's g_i), Ditto's personal models and top-k's "
         "error-feedback residuals, which each rank keeps over its rows"),
        ("train.ditto_lambda", not (cfg.train.ditto_lambda and cfg.compression.method != "none"),
         "0 with compression.method (a rank keeps its rows of Ditto's v_i or of the residuals, not both yet)"),
        ("clients.placement", state is None or not cfg.lends_client_state,
         "'round_robin' with per-client state (per_round lends each client's state to another rank)"),
        ("clock.mode", cfg.clock.mode not in ASYNCHRONOUS_MODES, "'off' or 'sync'"),
        ("clients.groups", cfg.clients.groups == 0, "0"),
        ("privacy.mode", cfg.privacy.mode == "off", "'off'"),
        ("secagg.enabled", not cfg.secagg.enabled, "false"),
        ("strategy.wire_dtype", cfg.strategy.wire_dtype is None, "unset (updates travel in the model's dtype)"),
        ("transport.dispatch_fanout", cfg.transport.dispatch_fanout == 0, "0"),
        ("transport.reduce", cfg.transport.reduce == "direct", "'direct'"),
        ("eval.federated_every", cfg.eval.federated_every == 0, "0"),
    ]
    for key, fine, what in not_yet:
        if not fine:
            raise ConfigError(f"{key}: {why}, which does not carry it yet: it needs {what}, or "
                              "clients.sharding='replicate'")


def _check_batched_clients(cfg: Config) -> None:
    """``train.batched_clients: K``: what lanes of one batched model can train (mpifl.learning.batched). The client
    rules need a lane's own form: FedProx's term and SCAFFOLD's corrected steps have one; the others are refused by
    name, as is what trains a client other than the built-in loop. A plug-in client half must be a
    ``LaneCorrections``, which only its imported class tells (mpifl.algorithms.lanes_problem)."""
    if not cfg.train.batched_clients:
        return
    why = f"train.batched_clients={cfg.train.batched_clients} trains a rank's clients as lanes of one batched model"
    not_yet = [
        ("train.trainer", cfg.train.trainer == "torch", "'torch' (the built-in loop, whose steps it batches)"),
        ("train.optimizer", cfg.train.optimizer in ("sgd", "adam", "adamw"), "sgd, adam or adamw"),
        ("train.step_in_backward", not cfg.train.step_in_backward, "false (a lane steps after its backward)"),
        ("clients.ranks_per_client", cfg.clients.ranks_per_client == 1, "1"),
        ("strategy.name", cfg.client_rule != "dynamic_regularizer",
         "a strategy whose client half corrects steps (scaffold) or has none; FedDyn's rule has no lane form yet"),
        ("model.local", not cfg.model.local, "empty"),
        ("train.ditto_lambda", cfg.train.ditto_lambda == 0, "0 (Ditto's personal models train one at a time)"),
        ("clock.mode", cfg.clock.mode not in ASYNCHRONOUS_MODES, "'off' or 'sync' (an asynchronous step gives "
         "each client its own step count)"),
        ("faults", not cfg.faults, "empty (a fault strikes one client's training)"),
    ]
    for key, fine, what in not_yet:
        if not fine:
            raise ConfigError(f"{key}: {why}, which needs {what}; or set train.batched_clients=0")


def _check_per_round_placement(cfg: Config) -> None:
    """``clients.placement: per_round`` moves clients between ranks from round to round, so nothing about a
    client, nor the order of a sum, may depend on the rank that trains it (per-client state is lent to that rank
    for the round: ``mpifl.roles.lending``)."""
    if cfg.clients.placement != "per_round":
        return
    why = "clients.placement: 'per_round' trains a client on a different rank from round to round"
    needs = [("clock.mode", cfg.clock.mode == "off", "'off' (held updates and virtual clocks follow a client's "
                                                     "home rank)"),
             ("clients.ranks_per_client", cfg.clients.ranks_per_client == 1, "1"),
             ("secagg.enabled", not cfg.secagg.enabled, "false")]
    for key, fine, what in needs:
        if not fine:
            raise ConfigError(f"{key}: {why}, which needs {what}; or use clients.placement='balanced'")


def _check_reduce(cfg: Config) -> None:
    if cfg.transport.reduce != "chain":
        return
    if not cfg.clients.groups:
        raise ConfigError("transport.reduce: 'chain' adds the ranks' partial sums, which needs clients.groups > 0 "
                          "(set it to the number of client ranks for one sum per rank)")


def _check_groups(cfg: Config) -> None:
    groups = cfg.clients.groups
    if cfg.clients.group_by == "cost" and not (groups and cfg.clients.placement == "per_round"):
        raise ConfigError("clients.group_by: 'cost' forms each round's reduction groups anew, which needs "
                          "clients.groups > 0 and clients.placement 'per_round' (any rank may then train any "
                          f"client); got groups={groups}, placement={cfg.clients.placement!r}")
    if not groups:
        return
    if groups > cfg.clients.num_clients:
        raise ConfigError(f"clients.groups: {groups} groups for {cfg.clients.num_clients} clients would leave groups "
                          "empty; use at most clients.num_clients")
    if cfg.strategy.wire_dtype is not None:
        raise ConfigError("strategy.wire_dtype: with clients.groups the ranks send fp32 partial sums, never single "
                          "updates; unset strategy.wire_dtype")


def _check_feature_noise(cfg: Config) -> None:
    """data.feature_noise adds noise to inputs read as numbers: the built-in torch trainer's minibatches."""
    if not cfg.data.feature_noise:
        return
    if cfg.model.name == "transformers" or cfg.data.dataset == "text":
        raise ConfigError("data.feature_noise: noise is added to numeric inputs; token ids take none (set it to 0)")
    if cfg.train.trainer != "torch":
        raise ConfigError(f"data.feature_noise: the built-in 'torch' trainer adds the noise to its minibatches; "
                          f"train.trainer {cfg.train.trainer!r} would train on clean inputs (set it to 0)")
    if cfg.clients.num_clients < 2:
        raise ConfigError("data.feature_noise: the levels run from 0 (client 0) to feature_noise (the last client); "
                          "set clients.num_clients to 2 or more")


def _check_lora_settings(lora: LoraConfig) -> None:
    """With ``r: 0`` there are no adapters and every parameter trains: another LoRA key set means the user wanted
    adapters and forgot the rank, which would otherwise run full fine-tuning without a word."""
    if lora.r:
        return
    defaults = LoraConfig()
    set_keys = [f"model.lora.{k}" for k in ("alpha", "dropout", "target_modules")
                if getattr(lora, k) != getattr(defaults, k)]
    if set_keys:
        raise ConfigError(f"{', '.join(set_keys)}: set, but model.lora.r is 0 (no LoRA: every parameter would "
                          "train); set model.lora.r (e.g. 8) for adapters, or remove them for full fine-tuning")


def _check_transformers(cfg: Config) -> None:
    model, hf = cfg.model, cfg.model.transformers
    _check_lora_settings(model.lora)
    if model.name != "transformers":
        if model.lora.r:
            raise ConfigError("model.lora.r: LoRA adapters need model.name='transformers'")
        if cfg.train.trainer == "causal_lm":
            raise ConfigError("train.trainer: 'causal_lm' needs model.name='transformers'")
        return
    if model.kwargs:
        raise ConfigError("model.kwargs: a transformers model takes its settings from model.transformers.config")
    if hf.architecture is None and hf.path is None:
        raise ConfigError("model.transformers: name an architecture (e.g. gpt2, llama) or a local path with a "
                          "config.json")
    if hf.path is not None and not Path(hf.path).is_dir():
        raise ConfigError(f"model.transformers.path: {hf.path!r} is not a local folder (nothing is downloaded: "
                          "hub names are not accepted)")
    if hf.path is not None and hf.architecture is None and not (Path(hf.path) / "config.json").is_file():
        raise ConfigError(f"model.transformers.path: {hf.path!r} has no config.json; "
                          "set model.transformers.architecture")
    if hf.pretrained and (hf.path is None or not any(Path(hf.path).glob("*.safetensors"))):
        raise ConfigError(f"model.transformers.pretrained: no *.safetensors files in model.transformers.path "
                          f"({hf.path!r})")
    if hf.pretrained and model.init_from:
        raise ConfigError("model.init_from: choose one source of weights: a pretrained folder or an mpifl checkpoint")
    if cfg.train.trainer == "torch":
        raise ConfigError("train.trainer: a transformers model trains with 'causal_lm' (or 'none' for model-only "
                          "exchange), not 'torch'")
    _check_text_data(cfg)


def _check_text_data(cfg: Config) -> None:
    """A transformers model's data: token blocks where it trains or is scored, split without labels."""
    reads_text = cfg.train.trainer == "causal_lm" or cfg.eval.every or cfg.eval.federated_every
    if reads_text and cfg.data.dataset != "text" and not is_import_path(cfg.data.dataset):
        raise ConfigError(f"data.dataset: causal-LM training and perplexity read token blocks; use 'text', not "
                          f"{cfg.data.dataset!r} (or set eval.every=0 with train.trainer='none')")
    if cfg.data.dataset == "text" and cfg.data.partition in ("dirichlet", "shards", "labels"):
        raise ConfigError(f"data.partition: {cfg.data.partition!r} splits by label; text blocks have none "
                          "(use iid or unbalanced)")


NOISY_EVALUATIONS_WARNED = 20  # data.feature_noise: more clients than this make each held-out evaluation 20x or more


# At or below this learning rate, full fine-tuning of a bf16/fp16 global model is warned about (config_warnings):
# AdamW moves a weight by about lr a step, and a few steps a round at 2e-5 fall under half a bf16 step of a
# typical weight (0.02 x 2^-9 = 3.9e-5).
NARROW_GLOBAL_LR = 1e-4


def config_warnings(cfg: Config) -> list[str]:
    """Legal values that are surely a mistake: each warning names its key."""
    found = _clock_warnings(cfg) + _switched_off_warnings(cfg) + _partition_warnings(cfg) + _group_warnings(cfg) + \
        _ditto_warnings(cfg) + _thread_warnings(cfg) + _quorum_warnings(cfg) + _robust_rule_warnings(cfg) + \
        _fault_warnings(cfg)
    if cfg.clients.per_round is not None and cfg.clients.per_round > cfg.clients.num_clients:
        found.append(f"clients.per_round: {cfg.clients.per_round} is more than clients.num_clients="
                     f"{cfg.clients.num_clients}: every client takes part in every round")
    if cfg.data.feature_noise and cfg.eval.every and cfg.clients.num_clients > NOISY_EVALUATIONS_WARNED:
        found.append(f"data.feature_noise: each held-out evaluation scores the held-out set at every client's noise "
                     f"level, {cfg.clients.num_clients} evaluations in one (NIID-Bench's protocol has 10 clients); "
                     f"with eval.every={cfg.eval.every} that may take longer than the training: raise eval.every, or "
                     "evaluate on the clients' own noisy validation splits (eval.federated_every)")
    caps = BUILTIN_CAPABILITIES.get(cfg.strategy.name)  # a plug-in's are read once it is imported
    if cfg.train.optimizer != "sgd" and caps is not None and caps.sgd_steps:
        found.append(f"train.optimizer: strategy {cfg.strategy.name!r} reads the local steps as plain SGD steps of "
                     f"size lr (Capabilities.sgd_steps: SCAFFOLD's control variates (x - y) / (K lr), FedNova's "
                     f"normaliser); with {cfg.train.optimizer!r} a step is not lr times a gradient, so its rule is "
                     "scaled wrongly: set train.optimizer='sgd' (momentum is fine)")
    narrow = cfg.model.dtype in ("bfloat16", "float16")
    if narrow and cfg.train.trainer != "none" and not cfg.model.lora.r and cfg.train.lr <= NARROW_GLOBAL_LR:
        found.append(f"model.dtype: the global model is rounded to {cfg.model.dtype} after every round (8 "
                     "significant bits for bfloat16), so a weight that a round moves by less than half its step "
                     f"(about 2^-9 of it) keeps its old value; at train.lr={cfg.train.lr:g}, most may not move (a tiny "
                     "Llama at 2e-05: 72% of its elements unchanged by a round, 11% in float32; "
                     "profiling/bf16_rounding.py). Keep model.dtype='float32' for full fine-tuning at such rates, or "
                     "train LoRA adapters (fp32)")
    if cfg.transport.chunk_bytes < 64 * 1024:
        found.append(f"transport.chunk_mb: {cfg.transport.chunk_bytes}-byte chunks make the exchange slow (per-message "
                     "overhead dominates); 4-64 MiB are best")
    return found


# Each partition setting and the data.partition values that read it.
PARTITION_SETTINGS = {"alpha": ("dirichlet",), "classes_per_client": ("shards", "labels"),
                      "size_sigma": ("unbalanced",)}


def _partition_warnings(cfg: Config) -> list[str]:
    """data.alpha, data.classes_per_client or data.size_sigma set (away from its default) beside a data.partition
    that does not read it."""
    data, defaults = cfg.data, type(cfg.data)()
    found = []
    for key, readers in PARTITION_SETTINGS.items():
        if getattr(data, key) != getattr(defaults, key) and data.partition not in readers:
            found.append(f"data.{key}: {getattr(data, key)} is read only by data.partition {' or '.join(readers)}, "
                         f"and data.partition is {data.partition!r}: ignored")
    return found


def _group_warnings(cfg: Config) -> list[str]:
    """A train.batch_size below clients.ranks_per_client: legal (a rank with an empty share joins the group's
    collectives on a stand-in weighed 0), but every step leaves ranks of each client group without a sample."""
    ranks, batch = cfg.clients.ranks_per_client, cfg.train.batch_size
    if cfg.train.trainer == "none" or batch >= ranks:
        return []
    return [f"train.batch_size: {batch} is less than clients.ranks_per_client={ranks}: every step leaves "
            f"{ranks - batch} of each client group's {ranks} ranks without a sample (they join the group's "
            "collectives and add nothing): raise train.batch_size to a multiple of clients.ranks_per_client, or "
            "lower clients.ranks_per_client"]


def _quorum_warnings(cfg: Config) -> list[str]:
    """clients.below_quorum='keep' where nothing leaves a round below quorum: without clients.accept_failures a
    failed client ends the job itself (a virtual clock keeps such rounds whatever the key says)."""
    if cfg.clients.below_quorum != "keep" or cfg.clients.accept_failures or cfg.clock.mode != "off":
        return []
    return ["clients.below_quorum: 'keep' acts on a round left with too few usable updates, which only "
            "clients.accept_failures=true leaves (without it a failed client ends the job itself): set "
            "clients.accept_failures=true"]


def _thread_warnings(cfg: Config) -> list[str]:
    """train.threads other than 1 on the CPU: legal, but the only setting whose results depend on the layout of the
    ranks, so that a comparison across rank counts (or a resume on another count) is not a surprise."""
    threads = cfg.train.threads
    if threads == 1 or cfg.train.device == "cuda":  # "auto": the CPU where no GPU is seen
        return []
    auto = ", which 'auto' takes from the cores per rank, and so on the number of ranks per node" \
        if threads == "auto" else ""
    return [f"train.threads={threads!r}: training on the CPU, torch's kernels split their sums by thread, so the "
            f"results depend on the thread count{auto}; train.threads=1 keeps them bitwise equal on any number of "
            "ranks"]


def _ditto_warnings(cfg: Config) -> list[str]:
    """train.lr x (train.ditto_lambda + train.weight_decay) at or past the bound where SGD's step on the personal
    model's two quadratic terms alone stops shrinking them: Ditto's lambda/2 ||v - w||^2 and the optimiser's weight
    decay wd/2 ||v||^2 together multiply v by 1 - lr (lambda + wd) (towards lambda w / (lambda + wd)), stable
    below 2; with heavy-ball momentum beta, below 2 (1 + beta). Past it the personal models grow until they are
    NaN/Inf. The loss's own curvature adds to it: the bound is necessary, not sufficient."""
    train = cfg.train
    if not train.ditto_lambda or train.optimizer != "sgd" or train.trainer not in ("torch", "causal_lm"):
        return []
    bound = ditto_stability_bound(train.momentum)
    curvature = train.ditto_lambda + train.weight_decay
    product = train.lr * curvature
    if product < bound:
        return []
    with_momentum = f" with train.momentum={train.momentum:g}" if train.momentum else ""
    if train.weight_decay:
        terms = (f"train.lr x (train.ditto_lambda + train.weight_decay) = {train.lr:g} x ({train.ditto_lambda:g} + "
                 f"{train.weight_decay:g})")
        stable, lower = "lr x (lambda + weight_decay)", "train.lr, train.ditto_lambda or train.weight_decay"
    else:
        terms = f"train.lr x train.ditto_lambda = {train.lr:g} x {train.ditto_lambda:g}"
        stable, lower = "lr x lambda", "train.lr or train.ditto_lambda"
    return [f"train.ditto_lambda: {terms} = {product:g} is at or past {bound:g}, where SGD's step on Ditto's "
            f"regulariser is unstable{with_momentum} (stable while {stable} < 2"
            f"{' x (1 + momentum)' if train.momentum else ''}): the personal models will diverge to NaN/Inf and not "
            f"be kept. Lower {lower}"]


def ditto_stability_bound(momentum: float) -> float:
    """The largest stable lr x curvature of SGD with heavy-ball momentum on a quadratic: 2 (1 + momentum)
    (Goh, "Why Momentum Really Works", Distill 2017: convergence for 0 < lr x curvature < 2 + 2 beta)."""
    return 2 * (1 + momentum)


# What a clock.queue_trace replaces: its jobs' own waits, run times and ends (mpifl.clock.queue draws none).
TRACE_REPLACES = ("queue_wait", "queue_wait_sigma", "walltime", "preemption_rate")


def changed_settings(section: object, name: str, skip: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys of ``section`` (called ``name``) set away from their defaults, but those in ``skip`` (or
    only those in ``only``): what a switched-off feature would ignore."""
    defaults = type(section)()
    return [f"{name}.{f.name}" for f in dataclasses.fields(section)  # type: ignore[arg-type]
            if f.name not in skip and (not only or f.name in only)
            and getattr(section, f.name) != getattr(defaults, f.name)]


def _switched_off_warnings(cfg: Config) -> list[str]:
    """Settings of privacy, secure aggregation and compression left set while the feature that reads them is off
    (a forgotten switch: the run goes on without the feature, and nothing else would say so)."""
    found = []
    for section, name, switch, off, turn_on in (
            (cfg.privacy, "privacy", "mode", "off", "set privacy.mode (central or local)"),
            (cfg.secagg, "secagg", "enabled", False, "set secagg.enabled=true"),
            (cfg.compression, "compression", "method", "none", "set compression.method (int8, int4 or topk)")):
        if getattr(section, switch) == off:
            ignored = changed_settings(section, name, skip=(switch,))
            if ignored:
                found.append(f"{', '.join(ignored)}: read only with {name}.{switch} set, and it is {off!r}: ignored; "
                             f"{turn_on} to use them")
    adaptive = changed_settings(cfg.privacy, "privacy", only=("adaptive_clip", "target_quantile", "clip_lr",
                                                               "count_noise"))
    if cfg.privacy.mode == "local" and adaptive:
        found.append(f"{', '.join(adaptive)}: adaptive clipping is central DP's (the server learns the clipped count "
                     "from the clients' noised bits); under privacy.mode 'local' it is ignored and every client "
                     "clips at privacy.clip for the whole run")
    topk_only = changed_settings(cfg.compression, "compression", only=("fraction", "error_feedback", "residual_ram_mb"))
    if cfg.compression.method in ("int8", "int4") and topk_only:
        found.append(f"{', '.join(topk_only)}: read only with compression.method 'topk', not "
                     f"{cfg.compression.method!r}: ignored")
    return found


def _clock_warnings(cfg: Config) -> list[str]:
    """clock.* settings that are legal but read by nothing: any beside clock.mode off, a queue trace beside another
    availability, the batch-queue model's settings beside the trace that replaces them; and the wall-clock
    straggler deadline, which virtual time does not apply."""
    clock, defaults = cfg.clock, type(cfg.clock)()
    if clock.mode == "off":
        ignored = changed_settings(clock, "clock", skip=("mode", "concurrency")) + _set_concurrency(cfg)
        return [f"{', '.join(ignored)}: read only under virtual time, and clock.mode is 'off' (rounds in real time): "
                "ignored; set clock.mode (sync, fedasync, fedbuff or fedcompass) to use them"] if ignored else []
    found = _other_mode_warnings(cfg)
    if clock.mode == "fedcompass" and cfg.clients.num_clients > clock.in_flight():
        idle = cfg.clients.num_clients - clock.in_flight()
        found.append(f"clock.concurrency: clock.mode 'fedcompass' keeps the same {clock.in_flight()} clients "
                     f"(clock.concurrency) in the federation for the whole run, so {idle} of the "
                     f"clients.num_clients={cfg.clients.num_clients} never train and their data is never seen: raise "
                     f"clock.concurrency to {cfg.clients.num_clients}, or lower clients.num_clients")
    if cfg.timeouts.straggler is not None:
        found.append("timeouts.straggler: a wall-clock straggler deadline is not applied under virtual time "
                     f"(clock.mode {clock.mode!r}), where the virtual clock decides who is a straggler "
                     "(clock.deadline, "
                     "over_selection), so that a result does not depend on the machine: unset it")
    if clock.queue_trace is None:
        return found
    if clock.availability != "queue":
        return [*found, f"clock.queue_trace: read only with clock.availability 'queue', not {clock.availability!r}: "
                        f"{clock.queue_trace!r} is ignored"]
    replaced = [f"clock.{key}={getattr(clock, key)}" for key in TRACE_REPLACES
                if getattr(clock, key) != getattr(defaults, key)]
    if replaced:
        found.append(f"{', '.join(replaced)}: ignored beside clock.queue_trace, whose jobs' own waits and run times "
                     "(their walltimes and preemptions) replace the model's; unset one or the other")
    return found


# clock.* keys read by some virtual-time modes only (clock.mode 'off' reads none of them: _clock_warnings).
MODE_SETTINGS = {"deadline": ("sync",), "over_selection": ("sync",), "buffer": ("fedbuff",),
                 "concurrency": ASYNCHRONOUS_MODES}


def _set_concurrency(cfg: Config) -> list[str]:
    """``clock.concurrency`` where the user set it: load_config fills it in when unset (``automatic_concurrency``),
    so only a value other than that one is known to be the user's."""
    return ["clock.concurrency"] if cfg.clock.concurrency != automatic_concurrency(cfg) else []


def _other_mode_warnings(cfg: Config) -> list[str]:
    """clock.deadline or clock.over_selection beside an asynchronous mode, clock.buffer beside another mode than
    fedbuff, clock.concurrency beside sync: each set, and read by no step of this clock.mode."""
    mode = cfg.clock.mode
    ignored = changed_settings(cfg.clock, "clock", only=tuple(k for k, modes in MODE_SETTINGS.items()
                                                              if mode not in modes and k != "concurrency"))
    if mode not in MODE_SETTINGS["concurrency"]:
        ignored += _set_concurrency(cfg)
    return [f"{key}: read only under clock.mode {' or '.join(map(repr, MODE_SETTINGS[key.split('.')[1]]))}, and "
            f"clock.mode is {mode!r}: ignored" for key in ignored]


def _fault_warnings(cfg: Config) -> list[str]:
    """Faults legal but surely not what was meant: rounds beside a range, a scale by 1 or noise of std 0 (each the clean
    end of a sweep, so warned, not refused), a round past the run's last."""
    found: list[str] = []
    for i, fault in enumerate(cfg.faults):
        if fault.rounds and (fault.from_round, fault.to_round) != (1, 0):  # FaultConfig.strikes_in reads rounds alone
            found.append(f"faults[{i}]: rounds {fault.rounds} decide when it strikes; from_round={fault.from_round} "
                         f"and to_round={fault.to_round} are ignored beside them: set one or the other")
    for i, fault in enumerate(cfg.faults):  # legal, so that a sweep over the factor can hold the clean baseline
        if fault.kind == "scale" and fault.factor == 1:
            found.append(f"faults[{i}].factor: a scale fault with factor 1 changes nothing: the run is the clean "
                         "baseline; -1 flips the update's sign")
    for i, fault in enumerate(cfg.faults):  # legal: a free rider, and a sweep over std's clean end
        if fault.kind == "noise" and fault.std == 0:
            found.append(f"faults[{i}].std: a noise fault with std 0 sends no change at all (a free rider); give "
                         "std > 0 for Gaussian updates")
    for i, fault in enumerate(cfg.faults):  # a run stopped early (rounds=2) and resumed with more still strikes later
        late = [r for r in (fault.rounds or (fault.from_round, fault.to_round)) if r > cfg.rounds]
        if late:
            found.append(f"faults[{i}]: round {late[0]} is past the run's last (rounds={cfg.rounds}): it strikes only "
                         "if a resume raises rounds")
    return found


def _robust_rule_warnings(cfg: Config) -> list[str]:
    """A strategy key (capabilities.STRATEGY_KEYS) set beside a built-in strategy that does not read it (plug-ins may
    read any key of their StrategyConfig); Krum with fewer updates per server step than its guarantee needs (n >= 2f +
    3, Blanchard et al. 2017); Multi-Krum asked to keep more updates than a step has."""
    name = cfg.strategy.name
    if name not in BUILTIN_CAPABILITIES:
        return []
    found = [f"{key}: read only by strategy.name "
             f"{' or '.join(map(repr, STRATEGY_KEYS[key.split('.')[1]]))}, and strategy.name is {name!r}: ignored"
             for key in changed_settings(cfg.strategy, "strategy", only=tuple(STRATEGY_KEYS))
             if not reads_key(name, key.split(".")[1])]
    f, n, per = cfg.strategy.byzantine_clients, cfg.updates_per_step(), cfg.updates_per_step_key()
    rule, factor = KRUM_SELECTIONS.get(name, ("", 0))
    if factor and f and n < factor * f + 3:
        scored = max(1, n - f - 2)
        found.append(f"strategy.byzantine_clients: {rule}'s guarantee needs n >= {factor}f + 3 updates per server "
                     f"step, and {per} gives {n} for f={f} (each update scored over its {scored} nearest "
                     f"other{'s' if scored > 1 else ''}): a Byzantine update may be kept; raise {per} to "
                     f"{factor * f + 3} or lower f")
    if reads_key(name, "krum_keep") and cfg.strategy.krum_keep > n:
        found.append(f"strategy.krum_keep: {cfg.strategy.krum_keep} is more than the {n} updates per server step "
                     f"({per}): every update is kept, as FedAvg would")
    return found


# The keys that mean something only for some kinds of fault, and their defaults: set on another kind, a mistake.
FAULT_PARAMETERS = {"seconds": (("stall",), 0.0), "factor": (("slowdown", "scale"), 1.0), "bits": (("corrupt",), 1),
                    "std": (("noise",), 0.0),
                    "code": (("exit",), 1), "via": (("exit",), "sys")}


def _check_fault(cfg: Config, fault: FaultConfig, key: str) -> None:
    """One fault: exactly one target, ids and rounds within the run, each parameter on a kind that reads it."""
    targets = [name for name, given in (("clients", bool(fault.clients)), ("ranks", bool(fault.ranks)),
                                        ("fraction", fault.fraction is not None)) if given]
    if len(targets) != 1:
        raise ConfigError(f"{key}: name exactly one target: clients (ids), ranks (client ranks) or fraction "
                          f"(of each round's clients); got {', '.join(targets) or 'none'}")
    too_high = [c for c in fault.clients if c >= cfg.clients.num_clients]
    if too_high:
        raise ConfigError(f"{key}.clients: {too_high} not below clients.num_clients={cfg.clients.num_clients}")
    if fault.to_round and fault.to_round < fault.from_round:
        raise ConfigError(f"{key}.to_round: {fault.to_round} is before from_round={fault.from_round}")
    for name, (kinds, default) in FAULT_PARAMETERS.items():
        if getattr(fault, name) != default and fault.kind not in kinds:
            raise ConfigError(f"{key}.{name}: only a fault of kind {' or '.join(map(repr, kinds))} reads it, "
                              f"not {fault.kind!r}")
    if fault.kind in UPDATE_FAULTS and fault.stage != "train":
        raise ConfigError(f"{key}.stage: a {fault.kind!r} fault acts on the client's training or update, at stage "
                          f"'train', not {fault.stage!r}")
    if fault.kind == "lose" and fault.stage != "send":
        raise ConfigError(f"{key}.stage: a 'lose' fault loses the client's update as it leaves, at stage 'send', not "
                          f"{fault.stage!r}")
    if fault.kind == "slowdown" and fault.factor <= 1:
        raise ConfigError(f"{key}.factor: a slowdown needs a factor above 1, got {fault.factor}")
    if fault.stage == "send" and (cfg.clients.groups or cfg.transport.reduce == "chain"):
        raise ConfigError(f"{key}.stage: 'send' strikes after a client's first chunk, and with clients.groups or "
                          "transport.reduce='chain' a rank sends its group's sum instead; use stage 'train' or "
                          "'receive'")
    if fault.kind in ("noise", "label_flip"):
        _check_poisoning(cfg, fault, key)
    if cfg.clients.ranks_per_client > 1 and fault.ranks:
        raise ConfigError(f"{key}.ranks: names client ranks, and with clients.ranks_per_client="
                          f"{cfg.clients.ranks_per_client} each client is trained by a group of ranks, not by one: "
                          f"name the clients ({key}.clients) or a fraction ({key}.fraction) instead")
    _check_hang_in_virtual_time(cfg, fault, key)


def _check_poisoning(cfg: Config, fault: FaultConfig, key: str) -> None:
    """A ``noise`` or ``label_flip`` fault where one rank trains its client (a group of ranks trains elsewhere; batched
    clients take no faults at all); ``label_flip`` with class labels to flip (not a causal LM's tokens)."""
    if cfg.clients.ranks_per_client > 1:
        raise ConfigError(f"{key}.kind: a {fault.kind!r} fault acts where one rank trains its client, and with "
                          f"clients.ranks_per_client={cfg.clients.ranks_per_client} a group of ranks trains each: "
                          "use 'scale' (a group scales its rows) or one rank per client")
    if fault.kind == "label_flip" and cfg.train.trainer == "causal_lm":
        raise ConfigError(f"{key}.kind: 'label_flip' flips class labels, and train.trainer 'causal_lm' predicts "
                          "tokens: use 'noise' or 'scale' to attack a language model's updates")


def _check_hang_in_virtual_time(cfg: Config, fault: FaultConfig, key: str) -> None:
    """A stall for ever under a virtual clock: its task never arrives, so a synchronous round can only close
    without it at ``clock.deadline`` (where it is a straggler), and an asynchronous mode, which waits for no task,
    would keep the client in flight for ever with nothing in any step's record to say so."""
    if fault.kind != "stall" or fault.seconds > 0:
        return
    if cfg.clock.mode in ASYNCHRONOUS_MODES:
        raise ConfigError(f"{key}.seconds: a stall for ever (0) never ends in virtual time, and clock.mode "
                          f"{cfg.clock.mode!r} would keep its client in flight unrecorded; give the stall seconds, "
                          "which delay the client's task in virtual time")
    if cfg.clock.mode == "sync" and cfg.clock.deadline is None:
        raise ConfigError(f"{key}.seconds: a stall for ever (0) never arrives in virtual time, so a round waits for it "
                          "for ever; set clock.deadline (it is then a straggler) or give the stall seconds")
