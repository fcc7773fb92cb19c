"""Local trainers behind one small protocol, plus evaluation and losses."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from mpifl.config import ConfigError, EvalConfig, TrainConfig
from mpifl.learning.datasets import ClientData
from mpifl.learning.noise import batch_noise, noise_generator
from mpifl.learning.parallel import GroupParallel, share_of, share_weight
from mpifl.learning.steps import MASTER_OF, split
from mpifl.metrics import OWN_METRIC_PREFIXES, own_metric_names
from mpifl.planning.seeds import SHARD, derive_seed
from mpifl.plugins import call_problem, kwargs_problem, resolve


@dataclass(frozen=True)
class TrainContext:
    """Which logical client trains, in which round of how large a federation: what a trainer needs to key state of
    its own by client, or to scale a rule by the round's participation (SCAFFOLD's P / N). Passed as ``context=``
    to a trainer whose ``train`` names that parameter (``accepts_context``)."""

    client: int  # the logical client's id, 0 .. num_clients - 1: the same on any number of ranks
    round: int  # the federated round, from 1
    participants: int  # the logical clients sampled this round, on every rank together
    num_clients: int  # clients.num_clients
    # the client's own vectors, as the trainer declared them (``client_state``): flat fp32 tensors on the model's
    # device, the trainer's to change in place; mpifl keeps them once the client has trained
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    fresh: Mapping[str, bool] = field(default_factory=dict)  # whether each vector is new: the client never wrote it
    covers: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)  # the model's tensors each covers

    def views(self, name: str) -> list[torch.Tensor]:
        """Vector ``name`` as views shaped like the tensors it covers, in order (writes go to the vector)."""
        return split(self.state[name], self.covers[name])


@dataclass
class TrainResult:
    """What a logical client reports with its update."""

    num_samples: int
    metrics: dict = field(default_factory=dict)
    local_steps: int | None = None  # optimizer steps taken (a combiner may weigh by it, e.g. FedNova-style)

    def __post_init__(self) -> None:
        """A trainer's metric named like mpifl's own records would be read as them (a rank's peak memory, a
        group's costs), and left out of ``client_metrics``: refused here, in the trainer's own call."""
        taken = own_metric_names(self.metrics)
        if taken:
            raise ValueError(f"TrainResult.metrics[{taken[0]!r}]: names starting with "
                             f"{', '.join(OWN_METRIC_PREFIXES)} are mpifl's own records; rename the metric")


class Trainer(Protocol):
    """Trains a model in place on one logical client's data."""

    modifies_weights: bool

    def train(self, model: nn.Module, data: ClientData | None, seed: int) -> TrainResult:
        """Train ``model`` in place on ``data`` (None: the client has no local data), seeded by ``seed``.

        A plug-in may add a keyword parameter ``context`` (a ``TrainContext``): mpifl then passes it.

        A plug-in that keeps a personalised model of its own (APFL's mixture, a personal head) may also define
        ``personalized(model, context)``, a context manager within which ``model`` is the client's personalised
        model: with ``eval.federated_every`` mpifl scores it on the client's validation split right after the
        client trained (``federated_eval.personal_*``), and puts the trained model back bitwise afterwards."""
        ...


@runtime_checkable
class ConfiguredTrainer(Trainer, Protocol):
    """A trainer that reads its TrainConfig on every ``train`` (the built-in ones): a client's own local steps
    can be swapped in."""

    cfg: TrainConfig


@contextlib.contextmanager
def local_steps(trainer: Trainer, steps: int | None) -> Iterator[None]:
    """Let a built-in trainer take ``steps`` local steps for one client (FedCompass), then restore its config."""
    if not steps:
        yield
        return
    if not isinstance(trainer, ConfiguredTrainer):  # config checks allow fedcompass only with built-in trainers
        raise TypeError(f"trainer {type(trainer).__name__} has no TrainConfig 'cfg' to give a client its own "
                        "local steps (fedcompass takes the built-in 'torch' and 'causal_lm' trainers)")
    saved = trainer.cfg
    trainer.cfg = dataclasses.replace(saved, local_steps=steps)
    try:
        yield
    finally:
        trainer.cfg = saved


LOSSES: dict[str, Callable] = {
    "cross_entropy": nn.functional.cross_entropy,
    "mse": nn.functional.mse_loss,
}


def make_loss(name: str) -> Callable:
    """The loss named in the config (built in or import path)."""
    return LOSSES.get(name) or resolve(name)


def make_optimizer(params: Sequence[torch.Tensor], c: TrainConfig) -> torch.optim.Optimizer:
    """The local optimizer named in the config."""
    if c.optimizer == "sgd":
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
    cls = torch.optim.Adam if c.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=c.lr, weight_decay=c.weight_decay)


def load_optimizer_machinery() -> None:
    """Build and drop a throwaway optimizer. A process's first torch.optim optimizer imports torch._dynamo (about
    3 s of CPU, far more on a loaded node); a client rank does it at start-up, so that cost never falls inside
    round 1's training, before the first forward pass reports progress to the server's watchdog."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters()), torch.float32)


def _device(model: nn.Module) -> torch.device:
    """Where the model lives (batches go there; data stays on the host)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def seed_model_randomness(seed: int, device: torch.device) -> None:
    """Seed what the model draws while it trains (dropout): the CPU's generator, and the accelerator's it trains on.
    The same seeds ``torch.manual_seed`` sets there, without the rest of what it does: for every accelerator torch
    was built for and has not started (CUDA, XPU, MTIA on a CPU-only rank) it queues the seed together with a
    formatted stack trace, a fraction of a millisecond per client (0.1 ms from a shallow stack, more from a
    client rank's), once per logical client trained."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)  # started by now: applied at once, nothing queued
    elif device.type != "cpu":
        torch.manual_seed(seed)


def model_randomness_seed(seed: int, parallel: GroupParallel | None) -> int:
    """The seed of a rank's in-model randomness (dropout): the training seed alone, and in a client group one derived
    from it and the rank's place in the group (``SHARD``).

    Why: every rank of a group trains with the client's seed, and ranks with shares of one size would draw the same
    dropout masks for different samples. Independent masks make a group's training statistically one rank's (not
    bitwise: one rank draws all the batch's masks from one stream), still bitwise for a fixed group size on any
    number of groups, sharded or replicated."""
    return seed if parallel is None else derive_seed(seed, SHARD, parallel.rank)


def minibatches(num_samples: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Index batches of shuffled passes over the data, without end; the last batch of a pass may be short."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples, batch_size):
            yield order[start:start + batch_size]


def proximal_term(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], mu: float) -> torch.Tensor | float:
    """FedProx (Li et al. 2020): mu/2 * ||w - w_global||^2 over the trained parameters (0.0 with none)."""
    return mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))


def shared_batch(batch: torch.Tensor, parallel: GroupParallel | None) -> tuple[torch.Tensor, float]:
    """The rank's share of a batch's indices and the factor on its mean loss (the whole batch and 1 alone)."""
    if parallel is None:
        return batch, 1.0
    share = share_of(batch, parallel.rank, parallel.size)
    return share, share_weight(len(share), len(batch), parallel.size)


def stand_in(share: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """The rows a rank runs forward and backward: its share, or the batch's first sample for an empty share (a batch
    of fewer samples than the group has ranks: the last of a pass, or ``train.batch_size < ranks_per_client``).

    Why: every rank of the group must join the collectives inside forward and backward (FSDP's gathers and
    reduce-scatters, DDP's all-reduce) or the others wait for it, and a transformers model cannot run on 0 rows
    (its attention reshapes with a -1). The stand-in's loss is weighed by its share's weight, 0, so its gradients
    are exact zeros and the group's step is the weighted mean over the real samples alone."""
    return share if len(share) else batch[:1]


def shared_inputs(data: ClientData, batch: torch.Tensor, share: torch.Tensor, parallel: GroupParallel | None,
                  noise: torch.Generator | None) -> torch.Tensor:
    """The inputs of the rank's ``share`` of ``batch``; with feature noise (``data.noise_std``), plus the share's
    rows of the whole batch's noise, so every sample gets the noise it gets when one rank trains the client."""
    x = data.x[share]
    if noise is None:
        return x
    rows = None if parallel is None else (lambda t: share_of(t, parallel.rank, parallel.size))
    return x.float() + batch_noise(len(batch), tuple(x.shape[1:]), data.noise_std, noise, rows)


def group_mean(total: float, count: int, parallel: GroupParallel | None) -> float:
    """The mean training loss over every rank's shares (or this rank's alone)."""
    summed = parallel.total([total, count]) if parallel is not None else [total, count]
    return summed[0] / max(summed[1], 1)


def global_optimizer_hooks() -> bool:
    """Whether a hook is registered for every optimizer's step (``torch.optim.optimizer``'s global step hooks, as
    SCAFFOLD's correction is): such a hook expects one step over the whole model, so steps must not be split up."""
    from torch.optim import optimizer as optim_module
    return bool(getattr(optim_module, "_global_optimizer_pre_hooks", None)
                or getattr(optim_module, "_global_optimizer_post_hooks", None))


@contextlib.contextmanager
def steps_in_backward(params: Sequence[torch.Tensor], c: TrainConfig) -> Iterator[None]:
    """Inside, each parameter's optimizer step runs as soon as backward has accumulated its gradient, and the
    gradient is freed at once (PyTorch's "optimizer step in backward" recipe, one optimizer per parameter).

    Why: the gradients are never all held at once (a model-sized buffer less at the peak of backward). It is not
    a speed-up: one ``step()`` per parameter costs Python overhead that the cache-warm update does not win back
    on a CPU (cross-device rounds 0.98-1.05x the time of one step after backward over three interleaved
    measurements, ``profiling/step_in_backward.py`` and ``profiling/cross_device.py --step-in-backward``), so
    it is off by default.
    SGD, Adam and AdamW update each parameter from its own gradient and state alone, so the weights are
    bitwise those of one ``optimizer.step()`` after backward (``tests/test_trainers.py``)."""
    optimizers = {p: make_optimizer([p], c) for p in params}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(step) for p in params]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def backward(objective: torch.Tensor, steps_inside: bool) -> None:
    """``objective.backward()``; with steps inside backward, PyTorch's in-place error gets the setting that avoids it
    (a model that saved a detached view of a parameter for its backward pass sees that parameter stepped first)."""
    try:
        objective.backward()
    except RuntimeError as err:
        if steps_inside and "modified by an inplace operation" in str(err):
            raise RuntimeError(f"{err}\n(train.step_in_backward steps each parameter as soon as its gradient is "
                               "accumulated; this model uses a parameter's value later in its backward pass: set "
                               "train.step_in_backward: false)") from err
        raise


class TorchTrainer:
    """A plain PyTorch loop: shuffled minibatches, epochs or a fixed number of steps (optionally FedProx,
    gradient accumulation and clipping).

    With ``parallel`` (clients.ranks_per_client > 1) it trains the model in DDP, on this rank's share of
    every batch (mpifl.learning.parallel)."""

    modifies_weights = True

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = make_loss(cfg.loss)
        self.parallel: GroupParallel | None = None

    def steps_in_backward(self) -> bool:
        """Whether each parameter steps inside backward (``train.step_in_backward``): not where a step needs every
        gradient first (accumulation over micro-batches, clipping by the global norm), under DDP (which reduces
        the gradients after they accumulate), nor beside a global optimizer hook (SCAFFOLD's correction)."""
        return self.cfg.steps_inside_backward() and self.parallel is None and not global_optimizer_hooks()

    def train(self, model: nn.Module, data: ClientData | None, seed: int) -> TrainResult:
        """``local_steps`` (else ``local_epochs`` worth of) optimizer steps of ``grad_accum_steps`` minibatches
        each; reports the mean training loss."""
        if data is None or len(data) == 0:
            raise ValueError("the torch trainer needs local data; this client has none")
        c = self.cfg
        steps = c.local_steps or c.local_epochs * math.ceil(len(data) / (c.batch_size * c.grad_accum_steps))
        params = [p for p in model.parameters() if p.requires_grad]
        in_backward = self.steps_in_backward()
        optimizer = None if in_backward else make_optimizer(params, c)
        anchors = [p.detach().clone() for p in params] if c.prox_mu else []  # the received global model
        dtype, device = _param_dtype(model), _device(model)
        net = self.parallel.wrap(model) if self.parallel else model
        net.train()
        total, count = 0.0, 0
        stepping = steps_in_backward(params, c) if in_backward else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[]), stepping:
            seed_model_randomness(model_randomness_seed(seed, self.parallel), device)  # dropout and the like
            batches = minibatches(len(data), c.batch_size, seed)
            noise = noise_generator(seed) if data.noise_std else None  # data.feature_noise
            for _ in range(steps):
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                for k in range(c.grad_accum_steps):
                    batch = next(batches)
                    share, weight = shared_batch(batch, self.parallel)
                    x = shared_inputs(data, batch, share, self.parallel, noise).to(device=device, dtype=dtype)
                    y = data.y[share].to(device)
                    last = k == c.grad_accum_steps - 1  # DDP all-reduces on the last micro-batch only
                    with contextlib.nullcontext() if last or net is model else net.no_sync():  # type: ignore[operator]
                        output = net(x)
                        # an empty share (weight 0) still joins the group's backward: DDP waits for every rank
                        loss = self.loss_fn(output, y) if len(share) else output.sum()
                        objective = loss * weight
                        if anchors:
                            objective = objective + proximal_term(params, anchors, c.prox_mu)
                        if c.grad_accum_steps > 1:  # each step's gradient: the mean over its micro-batches
                            objective = objective / c.grad_accum_steps
                        backward(objective, in_backward)
                    total += loss.item() * len(share) if len(share) else 0.0
                    count += len(share)
                if optimizer is not None:
                    if c.max_grad_norm:
                        nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                    optimizer.step()
        return TrainResult(len(data), {"loss": group_mean(total, count, self.parallel)}, local_steps=steps)


class CausalLMTrainer:
    """Causal-LM fine-tuning of a transformers model on token blocks: next-token loss, the
    configured optimizer (AdamW in the presets), gradient accumulation, optional gradient
    checkpointing and clipping. bf16/fp16 weights train through fp32 master copies of the
    trainable tensors, so the optimizer's steps and state are fp32; the result is written back
    into the (flat-buffer) weights at every step."""

    modifies_weights = True

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._checkpointing = False
        self.parallel: GroupParallel | None = None  # clients.ranks_per_client > 1: DDP on shares of each batch

    def train(self, model: nn.Module, data: ClientData | None, seed: int) -> TrainResult:
        """Optimizer steps of ``grad_accum_steps`` batches each; reports the mean loss and its perplexity."""
        if data is None or len(data) == 0:
            raise ValueError("the causal_lm trainer needs local token blocks; this client has none")
        c = self.cfg
        if c.gradient_checkpointing and not self._checkpointing:
            from mpifl.learning.hf import enable_gradient_checkpointing
            enable_gradient_checkpointing(model)
            self._checkpointing = True
        params = [p for p in model.parameters() if p.requires_grad]
        masters = [p if p.dtype == torch.float32 else master_copy(p) for p in params]
        mixed = any(m is not p for m, p in zip(masters, params))
        anchors = [m.detach().clone() for m in masters] if c.prox_mu else []
        optimizer = make_optimizer(masters, c)
        per_step = c.batch_size * c.grad_accum_steps
        steps = c.local_steps or c.local_epochs * math.ceil(len(data) / per_step)
        net = self.parallel.wrap(model) if self.parallel else model
        net.train()
        total, count = 0.0, 0
        with torch.random.fork_rng(devices=[]):
            seed_model_randomness(model_randomness_seed(seed, self.parallel), _device(model))  # dropout
            batches = minibatches(len(data), c.batch_size, seed)
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                for k in range(c.grad_accum_steps):
                    batch = next(batches)
                    share, weight = shared_batch(batch, self.parallel)
                    ids = data.x[stand_in(share, batch)].to(_device(model))
                    last = k == c.grad_accum_steps - 1  # DDP all-reduces on the last micro-batch only
                    with contextlib.nullcontext() if last or net is model else net.no_sync():  # type: ignore[operator]
                        loss = net(input_ids=ids, labels=ids).loss
                        (loss * weight / c.grad_accum_steps).backward()  # an empty share's stand-in: weight 0
                    total += loss.item() * len(share) if len(share) else 0.0
                    count += len(share)
                _master_gradients(params, masters, anchors, c.prox_mu, mixed)
                if c.max_grad_norm:
                    nn.utils.clip_grad_norm_(masters, c.max_grad_norm)
                optimizer.step()
                if mixed:
                    with torch.no_grad():
                        for m, p in zip(masters, params):
                            p.copy_(m)
        mean = group_mean(total, count, self.parallel)
        return TrainResult(len(data), {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}, local_steps=steps)


def master_copy(param: torch.Tensor) -> torch.Tensor:
    """An fp32 master copy of a narrow parameter, for the optimizer to step in full precision; it names the
    parameter it stands for (``MASTER_OF``), so a hook on the optimizer's steps that acts on that parameter
    (``mpifl.learning.steps.corrected_steps``: SCAFFOLD's correction) acts on its master, which is copied back."""
    master = param.detach().float().requires_grad_()
    setattr(master, MASTER_OF, param)
    return master


def _master_gradients(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
                      prox_mu: float, mixed: bool) -> None:
    """The fp32 master weights' gradients before a step: each parameter's own, moved to its master where they differ
    (mixed precision), plus FedProx's mu (w - w_global) where ``anchors`` are given."""
    if mixed:
        for m, p in zip(masters, params):
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
    if anchors:
        with torch.no_grad():
            for m, a in zip(masters, anchors):  # gradient of mu/2 ||w - w_global||^2
                if m.grad is not None:
                    m.grad.add_(m - a, alpha=prox_mu)


class NoTrainer:
    """Model-only exchange: receive and send back, no computation (communication benchmarks)."""

    modifies_weights = False

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def train(self, model: nn.Module, data: ClientData | None, seed: int) -> TrainResult:
        """Nothing: the weights go back as received, weighted by the client's sample count (1 without data)."""
        return TrainResult(len(data) if data is not None else 1, {}, local_steps=0)


BUILTIN_TRAINERS: dict[str, Callable[[TrainConfig], Trainer]] = {
    "torch": TorchTrainer, "causal_lm": CausalLMTrainer, "none": NoTrainer}


def make_trainer(cfg: TrainConfig) -> Trainer:
    """The trainer named in the config; an import path is called as ``attr(cfg, **train.kwargs)``."""
    builtin = BUILTIN_TRAINERS.get(cfg.trainer)
    if builtin:
        return builtin(cfg)
    try:
        trainer = resolve(cfg.trainer)(cfg, **cfg.kwargs)
    except Exception as err:  # a setting the plug-in refuses: named as the config key it came from
        raise ConfigError(construction_problem(cfg, err)) from err
    problem = members_problem(cfg, trainer)  # what the check before MPI cannot see: a builder's trainer, and an
    # attribute the trainer's __init__ sets
    if problem:
        raise ConfigError(problem)
    return trainer


def members_problem(cfg: TrainConfig, trainer: object, built: bool = True) -> str | None:
    """What a trainer lacks of the members mpifl calls, or None: its class (``built`` False, before MPI starts) has
    no ``train``; the object built has no ``train`` or no ``modifies_weights`` (which its ``__init__`` may set)."""
    if not callable(getattr(trainer, "train", None)):
        return (f"train.trainer: {cfg.trainer!r} has no train method; a trainer defines train(self, model, data, "
                "seed[, context]) returning mpifl.api.TrainResult")
    train = trainer.train  # type: ignore[attr-defined]
    given = ("context",) if accepts_context(trainer) else ()  # type: ignore[arg-type] # mpifl passes it where taken
    called = call_problem(train, "train(model, data, seed" + (", context=...)" if given else ")"),
                          ("model", "data", "seed") if built else ("self", "model", "data", "seed"), given)
    if called:
        return f"train.trainer: {cfg.trainer!r}: {called}"
    if built and not hasattr(trainer, "modifies_weights"):
        return (f"train.trainer: {cfg.trainer!r} has no modifies_weights; a trainer class sets it: True (training "
                "changes the model) or False (a model-only exchange)")
    personalized = getattr(trainer, "personalized", None)
    if personalized is not None and not callable(personalized):
        return (f"train.trainer: {cfg.trainer!r} has a personalized that is not a method; define "
                "personalized(self, model, context) returning a context manager")
    if personalized is not None and not accepts_context(trainer):  # type: ignore[arg-type]
        return (f"train.trainer: {cfg.trainer!r} defines personalized(model, context), which reads the client's "
                "state from the TrainContext of its training: give train a keyword parameter context")
    return None


def trainer_name(trainer: Trainer) -> str:
    """A trainer as errors name it: its class's import path."""
    return f"{type(trainer).__module__}.{type(trainer).__qualname__}"


def result_problem(name: str, result: object) -> str | None:
    """Why what trainer ``name``'s ``train`` returned cannot be used, or None (a ``TrainResult``)."""
    if isinstance(result, TrainResult):
        return None
    return (f"trainer {name}: train() returned {type(result).__name__} {reprlib.repr(result)}; it must return "
            "mpifl.api.TrainResult(num_samples, metrics, local_steps)")


def construction_problem(cfg: TrainConfig, err: Exception) -> str:
    """Why a plug-in trainer could not be built from ``train.kwargs``, naming both."""
    return f"train.kwargs: building train.trainer {cfg.trainer!r} with {cfg.kwargs} failed: {type(err).__name__}: {err}"


def trainer_problem(cfg: TrainConfig) -> str | None:
    """What is wrong with ``train.kwargs`` for a plug-in trainer's signature ``attr(cfg, **kwargs)``, or None."""
    if cfg.trainer in BUILTIN_TRAINERS:
        return None
    build = resolve(cfg.trainer)
    try:
        first = next(iter(inspect.signature(build).parameters), None)  # the TrainConfig, which mpifl passes
    except (TypeError, ValueError):  # no signature to check against
        return None
    problem = kwargs_problem(build, cfg.kwargs, "train.kwargs", supplied=(first,) if first else ())
    if problem is None and inspect.isclass(build):  # a builder function's trainer is checked once it is built
        problem = members_problem(cfg, build, built=False)
    declares = bool(getattr(build, "client_state", None))
    train = getattr(build, "train", None)
    if problem is None and declares and train is not None and "context" not in inspect.signature(train).parameters:
        return (f"train.trainer: {cfg.trainer!r} declares per-client vectors (client_state), which reach it as "
                "TrainContext.state: its train() must take a keyword parameter 'context'")
    return problem


def accepts_context(trainer: Trainer) -> bool:
    """Whether ``trainer.train`` takes a ``context`` (a ``TrainContext``): the built-in trainers do not need one,
    and a plug-in written before it existed keeps its three-argument ``train``."""
    try:
        return "context" in inspect.signature(trainer.train).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, batch_size: int) -> dict:
    """Accuracy and mean loss of a classifier on held-out data."""
    model.eval()
    dtype, device = _param_dtype(model), _device(model)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size].to(device=device, dtype=dtype), y[start:start + batch_size].to(device)
        out = model(xb)
        loss_sum += float(loss_fn(out.float(), yb, reduction="sum"))
        correct += int((out.argmax(dim=1) == yb).sum())
    return {"accuracy": correct / len(y), "loss": loss_sum / len(y)}


@torch.no_grad()
def evaluate_language_model(model: nn.Module, tokens: torch.Tensor, batch_size: int) -> dict:
    """Mean next-token loss and perplexity of a causal LM on held-out token blocks."""
    model.eval()
    loss_sum, predicted = 0.0, 0
    for start in range(0, len(tokens), batch_size):
        ids = tokens[start:start + batch_size].to(_device(model))
        n = ids.numel() - len(ids)  # every position but the first of each block is predicted
        loss_sum += float(model(input_ids=ids, labels=ids).loss.float()) * n
        predicted += n
    loss = loss_sum / predicted
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


Evaluator = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict]


def make_evaluator(cfg: EvalConfig, loss: str, language_model: bool) -> Evaluator:
    """How held-out data is scored: perplexity for causal LMs (``language_model``), accuracy and ``loss``
    (``train.loss``) otherwise, in batches of ``eval.batch_size``."""
    if language_model:
        return lambda model, x, y: evaluate_language_model(model, x, cfg.batch_size)
    loss_fn = make_loss(loss)
    return lambda model, x, y: evaluate(model, x, y, loss_fn, cfg.batch_size)
