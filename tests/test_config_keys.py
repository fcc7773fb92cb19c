"""The config's keys are frozen here: adding, renaming or removing one is a deliberate diff of this file
(and of the generated reference, docs/reference/config.md), never a side effect."""
from __future__ import annotations

import dataclasses
import typing

from mpifl.config import Config

KEYS = (
    "checkpoint.every",
    "checkpoint.keep",
    "clients.accept_failures",
    "clients.fraction",
    "clients.groups",
    "clients.min_participants",
    "clients.num_clients",
    "clients.per_round",
    "clients.placement",
    "clients.ranks_per_client",
    "clock.alpha",
    "clock.availability",
    "clock.availability_trace",
    "clock.bandwidth_mbps",
    "clock.bandwidth_sigma",
    "clock.buffer",
    "clock.concurrency",
    "clock.deadline",
    "clock.latest_factor",
    "clock.max_steps",
    "clock.min_steps",
    "clock.mode",
    "clock.online_fraction",
    "clock.over_selection",
    "clock.period",
    "clock.seconds_per_sample",
    "clock.speed_sigma",
    "clock.staleness",
    "clock.staleness_a",
    "clock.staleness_b",
    "clock.trace",
    "compression.block",
    "compression.error_feedback",
    "compression.fraction",
    "compression.method",
    "compression.residual_ram_mb",
    "data.alpha",
    "data.classes_per_client",
    "data.dataset",
    "data.kwargs",
    "data.partition",
    "data.partition_file",
    "data.size_sigma",
    "data.val_fraction",
    "eval.batch_size",
    "eval.every",
    "eval.federated_every",
    "model.dtype",
    "model.exchange",
    "model.init_from",
    "model.kwargs",
    "model.local",
    "model.local_ram_mb",
    "model.lora.alpha",
    "model.lora.dropout",
    "model.lora.r",
    "model.lora.target_modules",
    "model.name",
    "model.trainable",
    "model.transformers.architecture",
    "model.transformers.config",
    "model.transformers.path",
    "model.transformers.pretrained",
    "name",
    "output.dir",
    "output.progress",
    "output.save_model",
    "output.trackers",
    "privacy.accountant",
    "privacy.adaptive_clip",
    "privacy.clip",
    "privacy.clip_lr",
    "privacy.count_noise",
    "privacy.delta",
    "privacy.epsilon_budget",
    "privacy.mode",
    "privacy.noise_multiplier",
    "privacy.sampling",
    "privacy.target_quantile",
    "rounds",
    "secagg.enabled",
    "secagg.fraction_bits",
    "secagg.masking",
    "seed",
    "server.map_windows",
    "server.state",
    "server.window_mb",
    "strategy.alpha",
    "strategy.beta1",
    "strategy.beta2",
    "strategy.control_ram_mb",
    "strategy.kwargs",
    "strategy.momentum",
    "strategy.name",
    "strategy.server_lr",
    "strategy.tau",
    "strategy.trim_fraction",
    "strategy.update",
    "strategy.weighting",
    "strategy.wire_dtype",
    "timeouts.first_update",
    "timeouts.model_delivered",
    "timeouts.sigterm_grace",
    "timeouts.straggler",
    "timeouts.update_complete",
    "train.batch_size",
    "train.device",
    "train.device_copy",
    "train.ditto_lambda",
    "train.grad_accum_steps",
    "train.gradient_checkpointing",
    "train.local_epochs",
    "train.local_steps",
    "train.loss",
    "train.lr",
    "train.max_grad_norm",
    "train.momentum",
    "train.optimizer",
    "train.personal_ram_mb",
    "train.prox_mu",
    "train.threads",
    "train.trainer",
    "train.weight_decay",
    "transport.chunk_mb",
    "transport.dispatch_fanout",
    "transport.inflight",
    "transport.pool_mb",
    "transport.reduce",
)


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a config dataclass, dotted (``clients.num_clients``)."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            out += dotted_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            out.append(f"{prefix}{field.name}")
    return out


def test_the_config_keys_are_exactly_the_frozen_set():
    current = sorted(dotted_keys(Config))
    added, removed = sorted(set(current) - set(KEYS)), sorted(set(KEYS) - set(current))
    assert not added and not removed, (f"config keys changed: added {added}, removed {removed}; if deliberate, "
                                       "update KEYS in tests/test_config_keys.py and regenerate the docs reference")
    assert list(KEYS) == sorted(KEYS), "keep KEYS sorted"
