"""A plain whole-model numpy reference of a federated run: every client model in memory at once.

It follows the papers' formulas, not mpifl's chunked code; the tests compare the two.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mpifl.config import Config
from mpifl.learning.datasets import client_data, load_dataset
from mpifl.learning.models import build_model
from mpifl.learning.noise import client_noise_std
from mpifl.learning.partitions import partition
from mpifl.learning.trainers import make_trainer
from mpifl.planning.federation import sample_clients
from mpifl.planning.seeds import client_seed
from mpifl.wire.flat import FlatModel


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Train with one thread inside, as every rank does: a GEMM's sums follow the thread count, and rules that
    divide by small steps magnify a last-bit difference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (round to nearest even), returning the 16-bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values rounded once to a model/wire dtype and widened back to fp32 (exact)."""
    if dtype == "bfloat16":
        return bf16_bits_to_fp32(fp32_to_bf16_bits(x))
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


def fma32(acc: np.ndarray, w: float, x: np.ndarray) -> np.ndarray:
    """acc + w*x with a single rounding to fp32, like torch's fused add_(x, alpha=w), exactly.

    In float64 the product of two fp32 values is exact and the sum's error is known (TwoSum), so
    s + e is the exact result. Rounding s to fp32 is the right answer unless s lies exactly halfway
    between two fp32 values and e is not zero: then the exact value lies beyond the midpoint, on e's
    side. (An 80-bit long double sum rounds twice and misses such ties.)"""
    a = np.asarray(acc, dtype=np.float32).astype(np.float64)
    p = np.float64(np.float32(w)) * np.asarray(x, dtype=np.float32).astype(np.float64)
    s = a + p
    b = s - a
    e = (a - (s - b)) + (p - b)
    r = s.astype(np.float32)
    up, down = np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))
    r64 = r.astype(np.float64)
    other = np.where((r64 + up.astype(np.float64)) / 2 == s, up, down)
    tie = ((r64 + other.astype(np.float64)) / 2 == s) & (e != 0)
    return np.where(tie & (e > 0), np.maximum(r, other), np.where(tie & (e < 0), np.minimum(r, other), r))


def weighted_mean(updates: list[tuple[float, np.ndarray]], divisor: float | None = None) -> np.ndarray:
    """Weighted mean in fp32, summed in ascending client id order (weights rounded to fp32, as torch's
    scalars are), divided by the weights' sum or ``divisor``."""
    (w0, x0), rest = updates[0], updates[1:]
    acc = np.float32(w0) * x0
    for w, x in rest:
        acc = fma32(acc, np.float32(w), x)
    return acc / np.float32(sum(w for w, _ in updates) if divisor is None else divisor)


def cost_groups(clients: list[int], work: list[float], groups: int) -> dict[int, int]:
    """clients.group_by 'cost', written out: the heaviest client first (lowest id on ties) joins the group with
    the least work so far (lowest group on ties)."""
    load = [0.0] * groups
    out = {}
    for c in sorted(clients, key=lambda c: (-work[c], c)):
        g = min(range(groups), key=lambda i: (load[i], i))
        load[g] += work[c]
        out[c] = g
    return out


def grouped_weighted_mean(updates: list[tuple[int, float, np.ndarray]], groups: int,
                          divisor: float | None = None, group_of: dict[int, int] | None = None) -> np.ndarray:
    """clients.groups: each group's weighted sum (ascending id, fp32), then the groups' sums in ascending
    group id, divided by the total weight. A client's group is c mod ``groups``, or ``group_of[c]``."""
    sums = {}
    for client, w, x in sorted(updates, key=lambda u: u[0]):
        g = group_of[client] if group_of is not None else client % groups
        sums[g] = np.float32(w) * x if g not in sums else fma32(sums[g], np.float32(w), x)
    acc = None
    for g in sorted(sums):
        acc = np.float32(1.0) * sums[g] if acc is None else fma32(acc, 1.0, sums[g])
    return acc / np.float32(sum(w for _, w, _ in updates) if divisor is None else divisor)


def fednova_divisor(weights_and_steps: list[tuple[float, int]]) -> float:
    """FedNova (Wang et al. 2020, eq. 6, plain local SGD): x += tau_eff * sum_i q_i * delta_i / tau_i with
    q_i = p_i / sum p and tau_eff = sum_i q_i tau_i. As sum_i (p_i / tau_i) delta_i divided by D:
    D = sum p / tau_eff = (sum p)^2 / sum_i p_i tau_i (exact products and sums of integers in float64)."""
    total = sum(p for p, _ in weights_and_steps)
    return total * total / sum(p * tau for p, tau in weights_and_steps)


def median(stack: np.ndarray) -> np.ndarray:
    s = np.sort(stack, axis=0)
    p = len(s)
    return s[p // 2] if p % 2 else (s[p // 2 - 1] + s[p // 2]) * np.float32(0.5)


def trimmed_mean(stack: np.ndarray, beta: float) -> np.ndarray:
    s = np.sort(stack, axis=0)
    p = len(s)
    k = min(math.floor(beta * p + 1e-9), (p - 1) // 2)
    acc = s[k].copy()
    for row in s[k + 1:p - k]:
        acc += row
    return acc / np.float32(p - 2 * k)


WHOLE_UPDATE_RULES = ("krum", "multi_krum", "geometric_median")  # each a combination sum_i c_i x_i of the updates


def bulyan_selection(s, updates: list[dict[str, np.ndarray]]) -> list[int]:
    """Bulyan's first stage (El Mhamdi et al. 2018, Algorithm 1) on the whole flattened updates, with explicit
    distances: theta = n - 2f times, the Krum choice among the updates not chosen yet (a tie to the lower)."""
    x = np.stack([np.concatenate([u[n].astype(np.float64).ravel() for n in u]) for u in updates])
    f, remaining, chosen = s.byzantine_clients, list(range(len(x))), []
    while len(chosen) < max(1, len(x) - 2 * f):
        m = len(remaining)
        neighbours = max(1, min(m - f - 2, m - 1)) if m > 1 else 0
        scores = [sum(sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in remaining if j != i)[:neighbours])
                  for i in remaining]
        chosen.append(remaining.pop(min(range(m), key=lambda a: (scores[a], a))))
    return sorted(chosen)


def bulyan_coordinates(selected: list[np.ndarray], beta: int) -> np.ndarray:
    """Bulyan's second stage, coordinate by coordinate as the paper writes it: the mean of the beta selected values
    nearest the coordinate's median (a tie to the lower value), summed in ascending order in float64."""
    stack = np.stack([u.astype(np.float64).ravel() for u in selected])
    theta, beta = len(stack), max(1, min(beta, len(stack)))
    out = np.empty(stack.shape[1])
    for k in range(stack.shape[1]):
        values = sorted(stack[:, k])
        median = values[theta // 2] if theta % 2 else (values[theta // 2 - 1] + values[theta // 2]) / 2.0
        acc = 0.0
        for v in sorted(sorted(values, key=lambda v: (abs(v - median), v))[:beta]):
            acc += v
        out[k] = acc / beta
    return out.astype(np.float32).reshape(selected[0].shape)


def whole_update_coefficients(s, weights: list[float], updates: list[dict[str, np.ndarray]]) -> list[float]:
    """What each update counts in Krum / Multi-Krum (Blanchard et al. 2017; El Mhamdi et al. 2018) or the geometric
    median (smoothed Weiszfeld, Pillutla et al. 2022), computed on the whole flattened updates in float64 as the
    papers write them: explicit distances and an explicit median point, no Gram matrix."""
    x = np.stack([np.concatenate([u[n].astype(np.float64).ravel() for n in u]) for u in updates])
    w = np.array(weights)
    n = len(x)
    if s.name == "geometric_median":
        alphas = w / math.fsum(w)
        z = alphas @ x
        objective = float(alphas @ np.linalg.norm(x - z, axis=1))
        coefficients = alphas
        for _ in range(s.geomed_iterations):
            betas = alphas / np.maximum(s.geomed_smoothing, np.linalg.norm(x - z, axis=1))
            coefficients = betas / math.fsum(betas)
            z = coefficients @ x
            value = float(alphas @ np.linalg.norm(x - z, axis=1))
            improved, objective = objective - value, value
            if improved <= s.geomed_tolerance * objective:
                break
        return coefficients.tolist()
    f = s.byzantine_clients
    neighbours = max(1, min(n - f - 2, n - 1)) if n > 1 else 0
    scores = [sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in range(n) if j != i)[:neighbours] for i in range(n)]
    keep = 1 if s.name == "krum" else max(1, min(s.krum_keep or n - f, n))
    chosen = sorted(sorted(range(n), key=lambda i: (sum(scores[i]), i))[:keep])
    total = math.fsum(w[chosen])
    return [float(w[i] / total) if i in chosen else 0.0 for i in range(n)]


def server_step(name: str, delta: np.ndarray, state: dict, cfg) -> np.ndarray:
    """The server optimizer's step for pseudo-gradient delta (Reddi et al. 2021, Algorithm 2)."""
    f = np.float32
    lr = cfg.server_lr if cfg.server_lr is not None else (1.0 if name == "fedavgm" else 0.01)
    if name == "fedavgm":
        state["velocity"] = f(cfg.momentum) * state["velocity"] + delta
        return f(lr) * state["velocity"]
    m = state["m"] = f(cfg.beta1) * state["m"] + f(1 - cfg.beta1) * delta
    d2 = delta * delta
    if name == "fedadam":
        state["v"] = f(cfg.beta2) * state["v"] + f(1 - cfg.beta2) * d2
    elif name == "fedyogi":
        state["v"] = state["v"] - f(1 - cfg.beta2) * d2 * np.sign(state["v"] - d2)
    else:
        state["v"] = state["v"] + d2
    return f(lr) * m / (np.sqrt(state["v"]) + f(cfg.tau))


def statistics_of(module: torch.nn.Module) -> set[str]:
    """The model's floating buffers (BatchNorm's running statistics): server optimizers leave them to the plain
    combined value, as FedAvg would."""
    return {name for name, b in module.named_buffers() if b.is_floating_point()}


def noisy_client_data(cfg: Config, dataset, indices: np.ndarray, client: int):
    """Client ``client``'s training data, read through NIID-Bench's noise level for it (data.feature_noise: scale x
    client / (n - 1)); plain data without feature noise."""
    return client_data(dataset, indices, client_noise_std(cfg.data.feature_noise, client, cfg.clients.num_clients))


def reference_run(cfg: Config, drop: frozenset[int] = frozenset(),
                  dropped_in: dict[int, set[int]] | None = None) -> dict[str, np.ndarray]:
    """Train every sampled client (but those in ``drop``, and in round r those in ``dropped_in[r]``), combine
    whole models, apply the server rule; final tensors as fp32."""
    dataset = load_dataset(cfg.data)
    flat = FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes))
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
    trainer = make_trainer(cfg.train)
    s = cfg.strategy
    dtype = cfg.model.dtype
    wire = s.wire_dtype if s.wire_dtype and dtype == "float32" else dtype
    state: dict[str, dict] = {}
    statistics = statistics_of(flat.module)
    work = [1.0 if cfg.train.local_steps else float(len(p) * cfg.train.local_epochs) for p in parts]  # group_by cost
    for rnd in range(1, cfg.rounds + 1):
        start = flat.buffer.clone()
        old = {n: t.float().numpy().copy() for n, t in flat.tensors()}
        sent, steps = [], []
        sampled = sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round())
        group_of = cost_groups(sampled, work, cfg.clients.groups) if cfg.clients.group_by == "cost" else None
        for c in sampled:
            if c in drop or c in (dropped_in or {}).get(rnd, ()):
                continue
            flat.buffer.copy_(start)
            result = trainer.train(flat.module, noisy_client_data(cfg, dataset, parts[c], c),
                                   client_seed(cfg.seed, rnd, c))
            weight = float(result.num_samples) if s.weighting == "samples" else 1.0
            if s.name == "fednova":
                steps.append((weight, result.local_steps))
                weight /= result.local_steps
            update = {}
            for n, t in flat.tensors():
                x = t.float().numpy()
                if s.update == "delta":  # formed in the model's dtype, then cast to the wire dtype
                    x = round_to(x - old[n], dtype)
                update[n] = round_to(x, wire)
            sent.append((c, weight, update))
        divisor = fednova_divisor(steps) if s.name == "fednova" else None
        whole = whole_update_coefficients(s, [w for _, w, _ in sent], [u for _, _, u in sent]) \
            if s.name in WHOLE_UPDATE_RULES else None
        bulyan = bulyan_selection(s, [u for _, _, u in sent]) if s.name == "bulyan" else None
        for name, tensor in flat.tensors():
            if s.name == "fednova" and name in statistics:  # the fold's weights p_i / tau_i, normalised: convex
                divisor = math.fsum(w for _, w, _ in sent)
            elif s.name == "fednova":
                divisor = fednova_divisor(steps)
            if bulyan is not None:
                beta = max(1, max(1, len(sent) - 2 * s.byzantine_clients) - 2 * s.byzantine_clients)
                combined = bulyan_coordinates([sent[i][2][name] for i in bulyan], beta)
            elif whole is not None:  # sum_i c_i x_i in float64, row by row, rounded once
                combined = np.zeros(old[name].shape)
                for c, (_, _, u) in zip(whole, sent):
                    if c != 0.0:
                        combined += c * u[name].astype(np.float64)
                combined = combined.astype(np.float32)
            elif s.name == "median":
                combined = median(np.stack([u[name] for _, _, u in sent]))
            elif s.name == "trimmed_mean":
                combined = trimmed_mean(np.stack([u[name] for _, _, u in sent]), s.trim_fraction)
            elif cfg.clients.groups:
                combined = grouped_weighted_mean([(c, w, u[name]) for c, w, u in sent], cfg.clients.groups, divisor,
                                                 group_of)
            else:
                combined = weighted_mean([(w, u[name]) for _, w, u in sent], divisor)
            if s.name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad") and name not in statistics:
                delta = combined if s.update == "delta" else combined - old[name]
                tensor_state = state.setdefault(name, {"velocity": np.zeros_like(delta), "m": np.zeros_like(delta),
                                                       "v": np.full_like(delta, np.float32(s.tau) ** 2)})
                new = server_step(s.name, delta, tensor_state, s) + old[name]
            else:
                new = combined + old[name] if s.update == "delta" else combined
            tensor.copy_(torch.from_numpy(round_to(new.astype(np.float32), dtype)))
    return {n: t.float().numpy().copy() for n, t in flat.tensors()}


def async_reference(cfg: Config, drop: frozenset[int] = frozenset()) -> dict[str, np.ndarray]:
    """FedAsync / FedBuff in virtual time, by the papers' rules with every model version kept in memory:
    an event loop over virtual arrivals (its own, not mpifl's planner), each client trained on the version
    current at its dispatch, updates applied in arrival order. Devices come from the same cost model.
    ``drop``: clients whose every update fails (clients.accept_failures): a FedBuff buffer's sum is divided by
    the updates it applies, and a step with none applied keeps the model as it was."""
    from mpifl.clock.availability import Availability
    from mpifl.clock.devices import devices_for
    from mpifl.clock.staleness import staleness_weight
    from mpifl.planning.seeds import CLOCK, SAMPLING, derive_seed

    dataset = load_dataset(cfg.data)
    flat = FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes))
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
    trainer, clock, n, f = make_trainer(cfg.train), cfg.clock, cfg.clients.num_clients, np.float32
    devices, online = devices_for(clock, n, cfg.seed), Availability(clock, n, cfg.seed).online
    nbytes = flat.bytes.nbytes
    statistics = statistics_of(flat.module)
    took = [devices.task_seconds(c, len(parts[c]) * cfg.train.local_epochs, nbytes, nbytes) for c in range(n)]
    versions = {0: {name: t.float().numpy().copy() for name, t in flat.tensors()}}
    in_flight, busy, dispatched = [], set(), [0]

    def dispatch(t: float, version: int) -> None:
        idle = [c for c in range(n) if online(t)[c] and c not in busy]
        rng = np.random.default_rng(derive_seed(cfg.seed, SAMPLING, CLOCK, dispatched[0]))
        client = idle[int(rng.choice(len(idle), size=1, replace=False)[0])]
        dispatched[0] += 1
        busy.add(client)
        in_flight.append((t + took[client], client, version))

    def trained(client: int, version: int) -> dict[str, np.ndarray]:
        for name, tensor in flat.tensors():
            tensor.copy_(torch.from_numpy(versions[version][name]))
        trainer.train(flat.module, client_data(dataset, parts[client]), client_seed(cfg.seed, version + 1, client))
        return {name: t.float().numpy().copy() for name, t in flat.tensors()}

    for _ in range(min(clock.concurrency, n)):
        dispatch(0.0, 0)
    version, buffer, size = 0, [], 1 if clock.mode == "fedasync" else clock.buffer
    state: dict[str, dict] = {}
    while version < cfg.rounds:
        arrival = min(in_flight)
        in_flight.remove(arrival)
        buffer.append(arrival)
        if len(buffer) == size:
            old, new = versions[version], {}
            # each trained once, in arrival order
            models = [(trained(client, v), v) for _, client, v in buffer if client not in drop]
            for name in () if models else old:
                new[name] = old[name].copy()  # every update dropped: the step keeps the model
            for name in old if models else ():
                value = name in statistics and cfg.statistics_as_values  # sent as a value, not a change
                if clock.mode == "fedasync":
                    (model, v), = models
                    a = f(clock.alpha * staleness_weight(clock, version - v))
                    since = old if cfg.strategy.update == "weights" or value else versions[v]
                    new[name] = (model[name] - since[name]) * a + old[name]
                    continue
                acc, weights = None, []
                for model, v in models:
                    w = f(staleness_weight(clock, version - v))
                    d = model[name] if value else model[name] - versions[v][name]
                    acc = w * d if acc is None else fma32(acc, w, d)
                    weights.append(staleness_weight(clock, version - v))
                if value:  # the values' own weighted mean: no server step, nothing added
                    new[name] = acc / f(math.fsum(weights))
                    continue
                combined, s = acc / f(len(models)), cfg.strategy
                if s.name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad") and name not in statistics:
                    tensor_state = state.setdefault(name, {"velocity": np.zeros_like(combined),
                                                           "m": np.zeros_like(combined),
                                                           "v": np.full_like(combined, f(s.tau) ** 2)})
                    new[name] = server_step(s.name, combined, tensor_state, s) + old[name]
                else:
                    new[name] = combined + old[name]
            for _, client, _ in buffer:
                busy.discard(client)
            version += 1
            versions[version], buffer = new, []
        dispatch(arrival[0], version)
    return versions[version]


def scaffold_reference(cfg: Config, dropped_in: dict[int, set[int]] | None = None,
                       controls: bool = False) -> dict[str, np.ndarray]:
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) on whole models, every c_i in memory: each
    sampled client trains from x, every optimizer step followed by y -= lr (c - c_i) (outside any momentum, as
    NIID-Bench does; for plain SGD the paper's step), forms delta_c_i = (x - y) / (K lr) - c,
    keeps c_i + delta_c_i, and sends y - x and its control delta over its weight w_i, as (c + delta_c_i / w_i) - c
    (how the control section's delta is formed in fp32); then x += eta_g * sum w_i (y_i - x) / sum w_i and
    c += sum w_i * (delta_c_i / w_i) / N, the sums in ascending client id. The final tensors, and c as
    ``control.<parameter>``. Trained with one thread, as every rank trains (a GEMM's sums follow the
    thread count, and the control delta magnifies a last-bit difference in y by 1 / (K lr)). The clients in
    ``dropped_in[r]`` are skipped in round r, as if never sampled: their c_i stays, and nothing of theirs is summed;
    a round with every client skipped leaves x and c as they were. ``controls``: each client's c_i too (the
    trainable parameters' in order, one vector), as ``client.<id>``, for the clients that kept one."""
    with one_thread():
        return _scaffold_reference(cfg, dropped_in or {}, controls)


def _scaffold_reference(cfg: Config, dropped_in: dict[int, set[int]], controls: bool = False) -> dict[str, np.ndarray]:
    dataset = load_dataset(cfg.data)
    flat = FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes))
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
    trainer, s, lr = make_trainer(cfg.train), cfg.strategy, cfg.train.lr
    local = LocalTensors(cfg, flat)
    params = [(n, p) for n, p in flat.module.named_parameters() if p.requires_grad and not local.named(n)]
    c = {n: torch.zeros(p.shape) for n, p in params}
    own: dict[int, dict[str, torch.Tensor]] = {}
    eta = np.float32(s.server_lr if s.server_lr is not None else 1.0)
    statistics = statistics_of(flat.module)
    work = [float(len(p) * cfg.train.local_epochs) for p in parts]  # clients.group_by cost
    ditto = DittoModels(cfg, flat, trainer) if cfg.train.ditto_lambda else None
    c_with_personal: dict[int, list[torch.Tensor]] = {}  # c when each personal model was first kept
    for rnd in range(1, cfg.rounds + 1):
        start = flat.buffer.clone()
        old = {n: t.detach().clone() for n, t in flat.tensors()}
        sent = []
        sampled = sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round())
        group_of = cost_groups(sampled, work, cfg.clients.groups) if cfg.clients.group_by == "cost" else None
        for client in sampled:
            if client in dropped_in.get(rnd, ()):
                continue
            if ditto is not None:
                ditto.train(client, rnd, client_data(dataset, parts[client]), start, old)
                c_with_personal.setdefault(client, [v.clone() for v in c.values()])
            flat.buffer.copy_(start)
            local.load(client)
            c_i = own.get(client) or {n: torch.zeros(p.shape) for n, p in params}
            correction = {id(p): c[n] - c_i[n] for n, p in params}

            def corrected(optimizer, args, kwargs, correction=correction):  # y -= lr (c - c_i) after each step
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for p in group["params"]:
                            if id(p) in correction:  # model.local tensors are not corrected
                                p.add_(correction[id(p)], alpha=-group["lr"])

            hook = register_optimizer_step_post_hook(corrected)
            result = trainer.train(flat.module, client_data(dataset, parts[client]), client_seed(cfg.seed, rnd, client))
            hook.remove()
            local.keep(client)
            w = float(result.num_samples) if s.weighting == "samples" else 1.0
            delta_c = {n: (old[n] - p.detach()).div_(result.local_steps * lr).sub_(c[n]) for n, p in params}
            own[client] = {n: c_i[n] + delta_c[n] for n in c}
            sent.append((client, w, {n: (t.detach() - old[n]).numpy() for n, t in flat.tensors() if not local.named(n)},
                         {n: ((c[n] + delta_c[n] / w) - c[n]).numpy() for n in c}))

        def mean(values: list[tuple[int, float, np.ndarray]], divisor: float | None = None,
                 group_of: dict[int, int] | None = group_of) -> np.ndarray:
            if cfg.clients.groups:
                return grouped_weighted_mean(values, cfg.clients.groups, divisor, group_of)
            return weighted_mean([(w, v) for _, w, v in values], divisor)

        for n, t in flat.tensors():
            if local.named(n) or not sent:
                t.copy_(old[n])  # the server's copy is never updated; nothing sent, nothing changes
                continue
            step = mean([(client, w, dy[n]) for client, w, dy, _ in sent])
            scaled = step * eta if eta != 1 and n not in statistics else step  # eta_g steps the parameters only
            t.copy_(torch.from_numpy(scaled + old[n].numpy()))
        for n in c if sent else ():
            c[n] = c[n] + torch.from_numpy(mean([(client, w, dc[n]) for client, w, _, dc in sent],
                                                divisor=cfg.clients.num_clients))
    out = {n: t.float().numpy().copy() for n, t in flat.tensors() if not local.named(n)}
    out.update({f"control.{n}": t.numpy().copy() for n, t in c.items()})
    if controls:
        out.update({f"client.{k}": torch.cat([v.flatten() for v in own[k].values()]).numpy() for k in own})
    if cfg.model.local:  # each client's one vector: its c_i, then its local tensors and their mark
        out.update({f"client.{k}": np.concatenate([torch.cat([v.flatten() for v in own[k].values()]).numpy(),
                                                   local.vector(k)]) for k in local.kept})
    if ditto is not None:  # its c_i, then its personal model as it travels, and 1
        out.update({f"client.{k}": np.concatenate([torch.cat([v.flatten() for v in own[k].values()]).numpy(),
                                                   _with_control_section(flat, ditto.models[k][0], c_with_personal[k]),
                                                   np.ones(1, np.float32)]) for k in ditto.models})
    return out


def client_state_reference(cfg: Config) -> dict[str, np.ndarray]:
    """The reference of the configured rule with per-client vectors: SCAFFOLD's or FedDyn's."""
    return scaffold_reference(cfg) if cfg.strategy.name == "scaffold" else feddyn_reference(cfg)


def _with_control_section(flat: FlatModel, model: torch.Tensor, control: list[torch.Tensor]) -> np.ndarray:
    """A personal model as a SCAFFOLD run keeps it: the exchanged buffer of the model with the control section
    appended (mpifl.algorithms.scaffold), laid out and zero-padded as mpifl lays it out, the section holding the c
    of the round the model was first kept (Ditto copies the whole received model, c included, and never trains
    c)."""
    import copy

    from mpifl.algorithms.scaffold import attach_control_variates

    keep = flat.buffer.clone()
    flat.buffer.copy_(model)
    shaped = FlatModel(attach_control_variates(copy.deepcopy(flat.module)))
    flat.buffer.copy_(keep)
    controls = iter(control)
    for name, t in shaped.tensors():
        if name.startswith("scaffold_control."):
            t.copy_(next(controls))
    return np.concatenate([shaped.buffer[seg.offset:seg.offset + seg.nbytes].view(torch.float32).numpy()
                           for seg in shaped.spec.segments])  # the chunks' elements: no alignment padding


def every_tensor(flat: FlatModel) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``flat``: those that travel, then those kept in its second buffer (with the ranks' layout:
    ``model.local``), each in its buffer's order."""
    return [*flat.tensors(), *flat.frozen_tensors()]


def ranks_layout(cfg: Config, dataset) -> FlatModel:
    """The model as a client rank lays it out: the ``model.local`` tensors in a second buffer. A kernel's result can
    depend on where its operands sit (vectorised loops peel to an alignment), so a reference that must equal a run
    bit for bit trains on the same layout."""
    return FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes),
                     local=cfg.model.local)


class LocalTensors:
    """``model.local`` (FedBN, FedPer) beside another rule in a reference: each client's own values of the tensors
    the patterns name, the built ones until it first trains, loaded before it trains and kept after."""

    def __init__(self, cfg: Config, flat: FlatModel):
        import fnmatch

        self.patterns, self.flat = cfg.model.local, flat
        self.named = lambda name: any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
        self.built = {n: t.detach().clone() for n, t in every_tensor(flat) if self.named(n)}
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def load(self, client: int) -> None:
        tensors = dict(every_tensor(self.flat))
        for n, value in self.kept.get(client, self.built).items():
            tensors[n].copy_(value)

    def keep(self, client: int) -> None:
        if self.patterns:
            self.kept[client] = {n: t.detach().clone() for n, t in every_tensor(self.flat) if self.named(n)}

    def vector(self, client: int) -> np.ndarray:
        """The client's local tensors as mpifl keeps them beside a c_i or g_i: flattened in order, then 1 (kept)."""
        return np.concatenate([torch.cat([v.flatten().float() for v in self.kept[client].values()]).numpy(),
                               np.ones(1, np.float32)])


def once_per_step(term: torch.Tensor, cfg: Config) -> torch.Tensor:
    """A regulariser's gradient as one backward pass adds it: its 1/A share with train.grad_accum_steps = A
    passes per optimizer step (each micro-batch's loss is divided by A), so that each step holds it once."""
    steps = cfg.train.grad_accum_steps
    return term.div_(steps) if steps > 1 else term


class DittoModels:
    """Ditto's personal models (Li et al. 2021, Algorithm 1) beside any rule for the global model in a reference:
    before a sampled client trains the global model, it trains its personal model v (the round's global model the
    first time) with every gradient plus lambda (v - w), w the round's global model, seeded by its personal seed,
    and keeps it. The global training is independent of it given w."""

    def __init__(self, cfg: Config, flat: FlatModel, trainer):
        self.cfg, self.flat, self.trainer, self.lam = cfg, flat, trainer, cfg.train.ditto_lambda
        self.params = [(name, p) for name, p in flat.module.named_parameters() if p.requires_grad]
        self.models: dict[int, torch.Tensor] = {}
        self.first_round: dict[int, int] = {}  # the round each client first kept a personal model

    def train(self, client: int, rnd: int, data, start: torch.Tensor, old: dict[str, torch.Tensor]) -> None:
        """Train and keep ``client``'s personal model; leaves the flat model holding it (the caller resets)."""
        from mpifl.planning.seeds import personal_seed

        lam = self.lam
        if client in self.models:  # its own, else the round's model, with the local tensors the caller loaded
            self.flat.buffer.copy_(self.models[client][0])
            self.flat.frozen.copy_(self.models[client][1])
        else:
            self.flat.buffer.copy_(start)
        hooks = [p.register_hook(lambda grad, p=p, w=old[n]: grad + once_per_step((p.detach() - w).mul_(lam).sub_(0.0),
                                                                                    self.cfg))
                 for n, p in self.params]
        self.trainer.train(self.flat.module, data, personal_seed(self.cfg.seed, rnd, client))
        for hook in hooks:
            hook.remove()
        self.models[client] = self.flat.buffer.clone(), self.flat.frozen.clone()
        self.first_round.setdefault(client, rnd)

    def flattened(self, client: int, local: LocalTensors | None = None) -> np.ndarray:
        """The client's personal model, every tensor flattened in the model's order, as fp32; with ``local``, the
        tensors that travel first and then the local ones, as mpifl keeps a personal model beside local tensors."""
        keep = self.flat.buffer.clone(), self.flat.frozen.clone()
        self.flat.buffer.copy_(self.models[client][0])
        self.flat.frozen.copy_(self.models[client][1])
        tensors = every_tensor(self.flat)
        if local is not None:
            tensors = [(n, t) for n, t in tensors if not local.named(n)] + [(n, t) for n, t in tensors
                                                                             if local.named(n)]
        out = torch.cat([t.detach().float().flatten() for _, t in tensors]).numpy()
        self.flat.buffer.copy_(keep[0])
        self.flat.frozen.copy_(keep[1])
        return out


def personal_reference(cfg: Config, dropped_in: dict[int, set[int]] | None = None,
                       unapplied: frozenset[int] = frozenset()) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """FedBN / FedPer (``model.local``) on whole models: every sampled client trains from the global shared
    tensors and its own local ones (the built values until it first trains), keeps its local ones, and sends
    the rest; the server averages only the rest (weighted mean, ascending client id; by groups with
    clients.groups). Returns the final shared tensors and each trained client's local tensors, flattened in the
    ranks' order. Trained with one thread, on the ranks' layout, as every rank trains. ``dropped_in`` and
    ``unapplied`` as for ``_fedavg_with_personalisation``."""
    shared, local, _ = _fedavg_with_personalisation(cfg, dropped_in, unapplied)
    return shared, {c: torch.cat([v.flatten() for v in d.values()]).float().numpy() for c, d in local.kept.items()}


def _fedavg_with_personalisation(cfg: Config, dropped_in: dict[int, set[int]] | None = None,
                                 unapplied: frozenset[int] = frozenset(),
                                 ) -> tuple[dict[str, np.ndarray], LocalTensors, DittoModels]:
    """FedAvg (weights or deltas, by groups with clients.groups) with each client's ``model.local`` tensors and,
    with ``train.ditto_lambda``, its Ditto personal model trained first from and towards (w, l_i). Returns the
    final tensors that travel, every client's local tensors and every personal model. One thread, on the ranks'
    layout. The clients in ``dropped_in[r]`` are skipped in round r, as if never sampled. In the rounds of
    ``unapplied`` the clients train and keep their local tensors and personal models, and the model that travels
    stays as it was (a round a virtual clock leaves out)."""
    with one_thread():
        dataset = load_dataset(cfg.data)
        flat = ranks_layout(cfg, dataset)
        parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
        trainer, s = make_trainer(cfg.train), cfg.strategy
        personal, local = DittoModels(cfg, flat, trainer), LocalTensors(cfg, flat)
        for rnd in range(1, cfg.rounds + 1):
            start = flat.buffer.clone()
            old = {n: t.detach().clone() for n, t in flat.tensors()}
            sent = []
            for client in sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round()):
                if client in (dropped_in or {}).get(rnd, ()):
                    continue
                data = client_data(dataset, parts[client])
                flat.buffer.copy_(start)
                local.load(client)  # the global model this client trains: w with its own l_i
                if cfg.train.ditto_lambda:
                    personal.train(client, rnd, data, start, {n: t.detach().clone() for n, t in every_tensor(flat)})
                    flat.buffer.copy_(start)
                    local.load(client)
                result = trainer.train(flat.module, data, client_seed(cfg.seed, rnd, client))
                local.keep(client)
                w = float(result.num_samples) if s.weighting == "samples" else 1.0
                sent.append((client, w, {n: (t.float().numpy() - old[n].numpy() if s.update == "delta"
                                             else t.float().numpy().copy()) for n, t in flat.tensors()}))
            if rnd in unapplied:
                flat.buffer.copy_(start)
                continue
            for n, t in flat.tensors():
                values = [(c, w, u[n]) for c, w, u in sent]
                combined = (grouped_weighted_mean(values, cfg.clients.groups) if cfg.clients.groups
                            else weighted_mean([(w, v) for _, w, v in values]))
                t.copy_(torch.from_numpy(combined + old[n].numpy() if s.update == "delta" else combined))
        return {n: t.float().numpy().copy() for n, t in flat.tensors()}, local, personal


def feddyn_reference(cfg: Config, dropped_in: dict[int, set[int]] | None = None) -> dict[str, np.ndarray]:
    """FedDyn (Acar et al. 2021, Algorithm 1) on whole models, every g_i in memory: each sampled client trains
    from x with every gradient plus alpha (y - x) - g_i, then g_i -= alpha (y - x); with d the participants'
    mean delta (equal weights, ascending client id; by groups with clients.groups), P of N clients:
    h -= alpha (P / N) d and x += d - h / alpha (torch's fused ops, as the server's). Trained with one thread.
    The clients in ``dropped_in[r]`` are skipped in round r, as if never sampled (P counts those summed)."""
    with one_thread():
        dataset = load_dataset(cfg.data)
        flat = FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes))
        parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
        trainer, alpha, n = make_trainer(cfg.train), cfg.strategy.alpha, cfg.clients.num_clients
        local = LocalTensors(cfg, flat)
        params = [(name, p) for name, p in flat.module.named_parameters() if p.requires_grad and not local.named(name)]
        g: dict[int, dict[str, torch.Tensor]] = {}
        h = {name: torch.zeros(t.shape) for name, t in flat.tensors()}
        statistics = statistics_of(flat.module)
        ditto = DittoModels(cfg, flat, trainer) if cfg.train.ditto_lambda else None
        for rnd in range(1, cfg.rounds + 1):
            start = flat.buffer.clone()
            old = {name: t.detach().clone() for name, t in flat.tensors()}
            sent = []
            for client in sample_clients(cfg.seed, rnd, n, cfg.clients_per_round()):
                if client in (dropped_in or {}).get(rnd, ()):
                    continue
                if ditto is not None:
                    ditto.train(client, rnd, client_data(dataset, parts[client]), start, old)
                flat.buffer.copy_(start)
                local.load(client)
                g_i = g.get(client) or {name: torch.zeros(p.shape) for name, p in params}
                hooks = [p.register_hook(lambda grad, p=p, x=old[name], s=g_i[name]:
                                         grad + once_per_step((p.detach() - x).mul_(alpha).sub_(s), cfg))
                         for name, p in params]
                trainer.train(flat.module, client_data(dataset, parts[client]), client_seed(cfg.seed, rnd, client))
                for hook in hooks:
                    hook.remove()
                local.keep(client)
                g[client] = {name: g_i[name].clone().sub_(p.detach() - old[name], alpha=alpha) for name, p in params}
                sent.append((client, 1.0, {name: (t.detach() - old[name]).numpy() for name, t in flat.tensors()
                                           if not local.named(name)}))
            for name, t in flat.tensors():
                if local.named(name):
                    t.copy_(old[name])  # the server's copy is never updated
                    continue
                values = [(c, w, u[name]) for c, w, u in sent]
                mean = torch.from_numpy(grouped_weighted_mean(values, cfg.clients.groups) if cfg.clients.groups
                                        else weighted_mean([(w, v) for _, w, v in values]))
                if name not in statistics:  # the regulariser is on the parameters; statistics take the mean delta
                    h[name].sub_(mean, alpha=alpha * len(sent) / n)
                    mean.sub_(h[name], alpha=1 / alpha)
                t.copy_(mean.add_(old[name]))
        out = {name: t.float().numpy().copy() for name, t in flat.tensors() if not local.named(name)}
        if cfg.model.local:  # each client's one vector: its g_i, then its local tensors and their mark
            out.update({f"client.{k}": np.concatenate([torch.cat([v.flatten() for v in g[k].values()]).numpy(),
                                                       local.vector(k)]) for k in local.kept})
        if ditto is not None:  # its g_i, then its personal model and 1
            out.update({f"client.{k}": np.concatenate([torch.cat([v.flatten() for v in g[k].values()]).numpy(),
                                                       ditto.flattened(k), np.ones(1, np.float32)])
                        for k in ditto.models})
        return out


def ditto_reference(cfg: Config, dropped_in: dict[int, set[int]] | None = None,
                    unapplied: frozenset[int] = frozenset()) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """Ditto (Li et al. 2021, Algorithm 1) over FedAvg on whole models, every personal model in memory: each
    sampled client first trains its personal model (``DittoModels``), then trains w as FedAvg does. With
    ``model.local`` (FedBN, FedPer) a client trains w with its own local tensors l_i (``LocalTensors``), its
    personal model starts from and is pulled towards (w, l_i), and only the rest is averaged. Returns the final
    tensors that travel and each trained client's personal model, flattened in the model's order (with
    model.local: as mpifl keeps each client's vector, its l_i and 1, then its personal model, the tensors that
    travel first, and 1). One thread, on the ranks' layout. The clients in ``dropped_in[r]`` are skipped in round
    r, as if never sampled: their personal models stay as they were. The rounds of ``unapplied`` train every
    personal model and leave the model that travels as it was."""
    final, local, personal = _fedavg_with_personalisation(cfg, dropped_in, unapplied)
    if not cfg.model.local:
        return final, {client: personal.flattened(client) for client in personal.models}
    return final, {client: np.concatenate([local.vector(client), personal.flattened(client, local),
                                           np.ones(1, np.float32)]) for client in personal.models}
