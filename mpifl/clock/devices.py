"""Each logical client's device, and the cost model that turns a task into virtual seconds.

A task's virtual duration is ``bytes down / bandwidth + overhead + work x seconds per sample + bytes up /
bandwidth``, where work is the samples it trains on (samples x epochs, or steps x batch size) and the overhead a
task's fixed cost (``clock.task_overhead``; ``mpifl calibrate`` fits both from a measured run).
Devices come from seeded lognormal distributions (compute speed with median 1, bandwidth with
median ``clock.bandwidth_mbps``) or from a device trace in FedScale's layout (Lai et al. 2022,
``client_device_capacity``: ``{client: {"computation": ms per sample, "communication": kbps}}``).
Nothing here reads the machine's clock: durations depend on the config and the seed only.
"""
from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.config import ClockConfig
from mpifl.planning.seeds import CLOCK, derive_seed


@dataclass(frozen=True)
class Devices:
    """Per logical client: virtual seconds per training sample, and link bits per second."""

    seconds_per_sample: np.ndarray
    bits_per_second: np.ndarray
    overhead_seconds: np.ndarray | None = None  # a task's fixed compute cost, per client (None: none)

    def task_seconds(self, client: int, samples: float, bytes_down: int, bytes_up: int) -> float:
        """Virtual seconds for ``client`` to receive the model, train on ``samples`` samples and send its update."""
        link = float(self.bits_per_second[client])
        overhead = float(self.overhead_seconds[client]) if self.overhead_seconds is not None else 0.0
        return (8.0 * bytes_down / link + overhead + samples * float(self.seconds_per_sample[client])
                + 8.0 * bytes_up / link)

    def compute_seconds(self, client: int, samples: float) -> float:
        """Virtual seconds of ``client``'s training alone (its overhead and ``samples`` samples, no transfers): what
        a ``slowdown`` fault multiplies, as it slows the training and not the link."""
        overhead = float(self.overhead_seconds[client]) if self.overhead_seconds is not None else 0.0
        return overhead + samples * float(self.seconds_per_sample[client])


class DataOnlyUnpickler(pickle.Unpickler):
    """Reads a pickle of plain data only: dicts, lists, tuples, strings, numbers, booleans and None, which
    pickle encodes without naming any class. Anything that names a class or function (the way a pickle runs
    code on load) is refused, so a device trace from elsewhere cannot run code here."""

    def find_class(self, module: str, name: str) -> type:
        """Refuse every global: plain data never needs one."""
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a device trace holds plain data only")


def client_id_order(key: object) -> tuple:
    """A trace's client ids in numeric order, whether written as numbers (FedScale's pickles) or as the strings JSON
    keys must be ("10" after "9", not after "1"); ids that are not whole numbers after them, in their own order."""
    if isinstance(key, bool):
        return (1, str(type(key)), key)
    if isinstance(key, int):
        return (0, key, "")
    if isinstance(key, str) and key.strip().lstrip("+-").isdigit():
        return (0, int(key), key)
    return (1, str(type(key)), key)


def read_trace(path: str) -> list[tuple[float, float]]:
    """(ms per sample, kbps) per entry of a FedScale device trace (JSON, or a pickle of plain data), entries
    in client id order (``client_id_order``)."""
    raw = Path(path).read_bytes()
    try:
        table = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        try:  # FedScale ships its traces as pickles: read as data, never as code
            table = DataOnlyUnpickler(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise ValueError(f"clock.trace {path!r}: neither JSON nor a pickle of plain data ({err})") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"clock.trace {path!r}: expected a non-empty mapping client -> {{computation, communication}}")
    entries = []
    for key in sorted(table, key=client_id_order):
        entry = table[key]
        try:
            entries.append((float(entry["computation"]), float(entry["communication"])))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"clock.trace {path!r}: client {key!r} needs numbers 'computation' (ms per sample) and "
                             f"'communication' (kbps), got {entry!r}") from None
        if entries[-1][0] < 0 or entries[-1][1] <= 0:
            raise ValueError(f"clock.trace {path!r}: client {key!r} has a negative computation or a bandwidth <= 0")
    return entries


def devices_for(cfg: ClockConfig, num_clients: int, seed: int) -> Devices:
    """Every logical client's device: client c takes trace entry c (cycling), or seeded lognormal draws."""
    if cfg.trace:
        entries = read_trace(cfg.trace)
        picked = [entries[c % len(entries)] for c in range(num_clients)]
        return Devices(np.array([ms / 1000.0 for ms, _ in picked]), np.array([kbps * 1000.0 for _, kbps in picked]),
                       np.full(num_clients, cfg.task_overhead) if cfg.task_overhead else None)
    rng = np.random.default_rng(derive_seed(seed, CLOCK, 0))
    speed = rng.lognormal(0.0, cfg.speed_sigma, num_clients)
    bandwidth = cfg.bandwidth_mbps * 1e6 * rng.lognormal(0.0, cfg.bandwidth_sigma, num_clients)
    return Devices(cfg.seconds_per_sample / speed, bandwidth, cfg.task_overhead / speed if cfg.task_overhead else None)
