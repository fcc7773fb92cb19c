"""One command for a GPU machine: the device tests, runs on the GPU against the same runs on the CPU, two ranks
per client, and client updates per second per GPU for two reference models; one table at the end.

    make gpu-check                                   # on a GPU node: installs into .venv-gpu, then --device cuda
    python profiling/gpu_check.py --device cpu --quick   # the same steps on the CPU (tests/test_gpu_check.py)

Steps (each a row of the table):

1. the device tests (``tests/test_mpi_device.py``);
2. the quick start, and the quick start with reduction groups, trained on ``--device`` against the same run
   trained in the host buffer on the CPU. On the CPU form the device is a separate replica
   (``train.device_copy``), and the result must be bitwise equal. On a GPU, cuBLAS and cuDNN sum in another
   order than the CPU's kernels, so the final model must be within a relative L2 distance of
   ``GPU_TOLERANCE`` of the CPU's after ``COMPARED_ROUNDS``. The full check compares two runs with per-client
   state the same way: SCAFFOLD with the MLP's head kept per client (``model.local``), and Ditto. ``--quick``
   compares the quick start alone;
3. ``clients.ranks_per_client=2`` against one rank per client, within ``GROUP_TOLERANCE`` after
   ``COMPARED_ROUNDS`` (the same gradient, summed in two halves): the quick start's MLP, and with the full check
   also the built-in CNN, whose BatchNorm normalizes over the group's whole batch. NCCL between two GPUs; gloo on
   the CPU form and where the two ranks share the node's only GPU (NCCL refuses a GPU shared by two ranks);
4. the same run on ``--device`` with 2, 3 and 5 ranks (the quick start's MLP, and with the full check also the CNN:
   cuDNN's convolutions), all client ranks sharing the node's first GPU: the final models must be bitwise equal.
   That is mpifl's promise on the CPU, and on a GPU it rests on ``train.deterministic`` (deterministic cuDNN,
   cuBLAS and torch kernels): a client trains to the same bits whichever rank trains it;
5. batched clients (``train.batched_clients``): a round of the MLP's and of the CNN's clients trained as lanes of
   one batched model against one at a time, within ``BATCHED_TOLERANCE``, and 2 and 3 ranks of batched clients
   bitwise equal; then client updates per second per device, one at a time and batched: the quick start's MLP (on
   the digits; at 2,000 clients a round, on 64-feature Gaussian classes) and the LEAF FEMNIST CNN (1.69 M
   parameters) on synthetic 28 x 28 images, at 20, 200 and 2,000 clients per round (``--quick``: 20), one client
   rank per device summing its clients' updates (``clients.groups``); the median of the rounds after the first.
   ``--only batched`` runs this step alone;
6. with ``--llm``: GPT-2 (``configs/gpt2.yaml``) on ``--device`` with 2 and 3 ranks, bitwise equal, and its GPU
   peak against ``mpifl plan``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Rounding differences grow with every local step (the quick start: lr 0.1, momentum 0.9), so the runs that may
# differ in summation order are compared after one round: two ranks per client against one measured 9.2e-5 there
# (and 1.5e-3 after three rounds) on the CPU.
COMPARED_ROUNDS = 1
GPU_TOLERANCE = 1e-3  # relative L2 distance between the GPU's and the CPU's model after COMPARED_ROUNDS
GROUP_TOLERANCE = 1e-3  # relative L2 distance between two ranks per client and one after COMPARED_ROUNDS
# relative L2 between a round of batched clients and of clients one at a time. On the CPU: 2.9e-8 (MLP) measured. On a
# GPU, cuDNN runs convolutions in TF32 by default (torch.backends.cudnn.allow_tf32; 10 mantissa bits, rounding at
# 2^-11 = 4.9e-4 per product), and a grouped convolution sums in another order than one client's: the CNN's round
# measured 1.15e-3 on an H200 (the MLP's, which TF32 does not touch, 2.9e-8).
BATCHED_TOLERANCE = {"cpu": 1e-4, "cuda": 5e-3}
BATCHED_PER_ROUND = (20, 200, 2000)  # clients a round of the batched throughput rows


Launch = Callable[[int, Sequence[str], int], tuple[int, str]]


@dataclass
class Row:
    """One line of the table: what ran, how it came out, and whether that passes (None: skipped)."""

    step: str
    setting: str
    result: str
    passed: bool | None


@dataclass
class Check:
    """Where and how the steps run."""

    device: str  # cuda or cpu
    devices: int  # GPUs on the node (the CPU form: 1)
    rounds: int
    bin: Path
    work: Path
    timeout: int
    done: dict[tuple, Path] = field(default_factory=dict)  # runs already made, by what they ran (run_mpifl)
    # How an ``mpifl`` command runs on ``ranks`` ranks: (ranks, arguments, timeout) -> (exit status, stderr). None:
    # a fresh ``mpiexec`` each time, as on a GPU node; the test suite passes its job pool (tests/conftest.py).
    launch: Launch | None = None

    @property
    def device_overrides(self) -> list[str]:
        """Training on the device: cuda, or the CPU form's separate replica with the same copies."""
        return ["train.device=cuda"] if self.device == "cuda" else ["train.device=cpu", "train.device_copy=true"]


def run_mpifl(check: Check, name: str, ranks: int, config: Path, *overrides: str) -> Path:
    """One ``mpifl run`` under ``mpiexec`` with a timeout; its run directory. A run that a step made already (the
    same ranks, config and overrides; step 3's one-rank-per-client baseline is one of step 2's quick-start runs) is
    not made again."""
    key = (ranks, str(config), overrides)
    if key in check.done:
        return check.done[key]
    run_dir = check.work / name
    args = ["run", str(config), "--run-dir", str(run_dir), f"rounds={check.rounds}", "output.progress=false",
            *overrides]
    status, stderr = (check.launch or fresh_mpiexec(check))(ranks, args, check.timeout)
    if status != 0:
        raise RuntimeError(f"mpiexec -n {ranks} mpifl {' '.join(args)} exited {status}:\n{stderr[-2000:]}")
    check.done[key] = run_dir
    return run_dir


def fresh_mpiexec(check: Check) -> Launch:
    """A launcher that starts ``mpiexec -n ranks mpifl ARGS`` with ``check.bin``'s mpifl, the benchmarks' plug-ins
    (profiling/cross_device.py) importable."""
    def launch(ranks: int, args: Sequence[str], timeout: int) -> tuple[int, str]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "profiling"), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([mpiexec(check.bin), "-n", str(ranks), str(check.bin / "mpifl"), *args], env=env,
                              capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stderr
    return launch


def mpiexec(bin_dir: Path) -> str:
    """The venv's mpiexec (PyPI's MPICH), else the system's: a cluster's own MPI."""
    here = bin_dir / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec") or "mpiexec"


def final_weights(run_dir: Path) -> np.ndarray:
    """The run's final exchanged tensors, flattened to one fp64 vector."""
    sys.path.insert(0, str(ROOT))
    from mpifl.storage.hdf5 import load_tensors

    tensors = load_tensors(run_dir / "model.h5")
    return np.concatenate([t.double().numpy().ravel() for _, t in sorted(tensors.items())])


def relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||: how far one run's final model is from another's."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def records(run_dir: Path) -> list[dict]:
    """The run's per-round records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def device_tests(check: Check, selection: str) -> Row:
    """Step 1: the device tests, under pytest."""
    cmd = [str(check.bin / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection.split()]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10 * check.timeout)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return Row("device tests", selection, last, done.returncode == 0)


def versus_cpu(check: Check, name: str, *overrides: str) -> Row:
    """Step 2: the quick start (with ``overrides``) on the device against the CPU's host-buffer training."""
    config = ROOT / "configs" / "quickstart.yaml"
    slug, rounds = name.replace(" ", "-"), f"rounds={COMPARED_ROUNDS}"
    cpu = final_weights(run_mpifl(check, f"{slug}-host", 3, config, "train.device=cpu", *overrides, rounds))
    dev = final_weights(run_mpifl(check, f"{slug}-device", 3, config, *check.device_overrides, *overrides, rounds))
    distance = relative_distance(dev, cpu)
    if check.device == "cpu":
        bitwise = bool(np.array_equal(dev, cpu))
        return Row(f"{name}: replica vs host", " ".join(overrides) or "defaults",
                   "bitwise equal" if bitwise else f"differs, relative L2 {distance:.2e}", bitwise)
    return Row(f"{name}: cuda vs cpu", " ".join(overrides) or "defaults",
               f"relative L2 {distance:.2e} (tolerance {GPU_TOLERANCE:g})", distance <= GPU_TOLERANCE)


def two_ranks_per_client(check: Check, model: str) -> Row:
    """Step 3: each client trained by two ranks against one rank per client: the quick start's MLP, or the
    built-in CNN (BatchNorm over the group's whole batch) on the same digits."""
    backend = "gloo" if check.device == "cpu" else "nccl" if check.devices >= 2 else "gloo, both ranks on one GPU"
    config, device = ROOT / "configs" / "quickstart.yaml", [*check.device_overrides[:1], f"rounds={COMPARED_ROUNDS}"]
    if model == "cnn":
        device += ["model.name=cnn", "model.kwargs={channels: [8, 16]}"]
    single = final_weights(run_mpifl(check, f"single-{model}", 3, config, *device))
    pair_dir = run_mpifl(check, f"pair-{model}", 3, config, *device, "clients.ranks_per_client=2")
    distance = relative_distance(final_weights(pair_dir), single)
    setup = records(pair_dir)[0]["client_group"]["setup"]
    return Row(f"ranks_per_client=2: {model}", backend, f"relative L2 {distance:.2e} vs 1 rank per client "
               f"(tolerance {GROUP_TOLERANCE:g}, {COMPARED_ROUNDS} round); group setup {setup:.2f} s",
               distance <= GROUP_TOLERANCE)


def cnn_config(check: Check) -> Path:
    """The LEAF FEMNIST CNN (1.69 M parameters) on 1,000 synthetic clients of 20 images each (cross_device.py)."""
    config = check.work / "cnn.yaml"
    config.write_text("name: gpu-check-cnn\n"
                      "data: {dataset: 'cross_device:femnist_like', kwargs: {clients: 1000, samples: 20}, "
                      "partition: natural}\nmodel: {name: 'cross_device:leaf_cnn'}\n"
                      "train: {optimizer: sgd, lr: 0.05, batch_size: 10, local_epochs: 1}\n"
                      "clients: {num_clients: 1000, per_round: 20}\n")
    return config


def bitwise_across_ranks(check: Check, model: str, rank_counts: tuple[int, ...]) -> Row:
    """Step 4: the same run with each of ``rank_counts`` ranks, every client rank on the device: bitwise equal."""
    config = ROOT / "configs" / "quickstart.yaml" if model == "mlp" else cnn_config(check)
    runs = [final_weights(run_mpifl(check, f"{model}-ranks-{n}", n, config, *check.device_overrides,
                                    "eval.every=0")) for n in rank_counts]
    differing = [n for n, w in zip(rank_counts[1:], runs[1:]) if not np.array_equal(w, runs[0])]
    counts = ", ".join(map(str, rank_counts))
    if differing:
        worst = max(relative_distance(w, runs[0]) for w in runs[1:])
        return Row(f"bitwise across ranks: {model}", f"{counts} ranks, {check.rounds} rounds",
                   f"{', '.join(map(str, differing))} ranks differ from {rank_counts[0]} (relative L2 up to "
                   f"{worst:.2e})", False)
    return Row(f"bitwise across ranks: {model}", f"{counts} ranks, {check.rounds} rounds",
               f"bitwise equal ({runs[0].size:,} values)", True)


def throughput(check: Check, model: str, per_round: int, *overrides: str) -> Row:
    """Step 5: client updates per second per device: ``per_round`` clients a round, one client rank per device
    summing its clients' updates; the median of the rounds after the first (evaluation excluded)."""
    ranks = check.devices
    if model == "mlp" and per_round <= 200:  # the quick start's digits: 1,437 training images
        config, data = ROOT / "configs" / "quickstart.yaml", [f"clients.num_clients={max(per_round, 8)}",
                                                              "data.partition=iid"]
    elif model == "mlp":  # the quick start's MLP on 64-feature Gaussian classes, 10 samples a client
        config, data = ROOT / "configs" / "quickstart.yaml", [
            f"clients.num_clients={per_round}", "data.partition=iid", "data.dataset=synthetic",
            f"data.kwargs={{num_samples: {per_round * 12}, num_features: 64, test_fraction: 0.1}}"]
    else:
        config, data = cnn_config(check), [f"clients.num_clients={max(per_round, 1000)}",
                                           f"data.kwargs={{clients: {max(per_round, 1000)}, samples: 20}}"]
    run_dir = run_mpifl(check, f"{model}-{per_round}-{len(check.done)}", ranks + 1, config,
                        *check.device_overrides[:1], *data, f"clients.per_round={per_round}",
                        f"clients.groups={ranks}", "eval.every=0", "output.save_model=false", *overrides)
    history = records(run_dir)
    seconds = [r["time"]["round"] - r["time"]["eval"] for r in history[1:]]
    rate = per_round / statistics.median(seconds) / ranks
    unit = "GPU" if check.device == "cuda" else "CPU rank"
    rss = max(r["client_peak_rss_bytes"] for r in history) / 2**20
    memory = f"client rank peak RSS {rss:,.0f} MiB"
    if any("client_peak_device_bytes" in r for r in history):
        memory += f", GPU {max(r.get('client_peak_device_bytes', 0) for r in history) / 2**20:,.0f} MiB"
    setting = f"{per_round} clients/round, {ranks} {unit}{'s' if ranks > 1 else ''}"
    return Row(f"throughput {model}", " ".join((setting, *overrides)),
               f"{rate:,.1f} client updates/s per {unit} (median round {statistics.median(seconds):.3f} s; "
               f"{memory})", True)


def batched_versus_one_at_a_time(check: Check, model: str) -> Row:
    """Batched clients (``train.batched_clients``): one round trained as lanes against one client at a time, on
    the device, within ``BATCHED_TOLERANCE``; then 2 and 3 ranks of batched clients, bitwise equal."""
    config = ROOT / "configs" / "quickstart.yaml" if model == "mlp" else cnn_config(check)
    lanes = "train.batched_clients=10"
    one = final_weights(run_mpifl(check, f"{model}-sequential-1", 2, config, *check.device_overrides,
                                  "eval.every=0", "rounds=1"))
    batched = final_weights(run_mpifl(check, f"{model}-batched-1", 2, config, *check.device_overrides,
                                      "eval.every=0", "rounds=1", lanes))
    distance = relative_distance(batched, one)
    runs = [final_weights(run_mpifl(check, f"{model}-batched-ranks-{n}", n, config, *check.device_overrides,
                                    "eval.every=0", "rounds=3", lanes)) for n in (2, 3)]
    bitwise, tolerance = np.array_equal(runs[0], runs[1]), BATCHED_TOLERANCE[check.device]
    return Row(f"batched clients: {model}", f"{lanes}; 1 round vs one at a time; 2 and 3 ranks, 3 rounds",
               f"relative L2 {distance:.2e} vs one at a time (tolerance {tolerance:g}); 2 and 3 ranks "
               f"{'bitwise equal' if bitwise else 'differ'}", distance <= tolerance and bitwise)


def llm(check: Check) -> Row:
    """Step 6 (``--llm``): ``configs/gpt2.yaml`` (GPT-2, 124 M parameters, bf16 weights, fp32 AdamW state, the
    causal-LM trainer) on ``--device`` with 2 and 3 ranks, which must end bitwise equal, the server evaluating on
    its GPU too (``eval.device``); its held-out perplexity, median round and evaluation, and the client ranks' GPU
    peak against ``mpifl plan``'s figure (which leaves out activations)."""
    sys.path.insert(0, str(ROOT))
    from mpifl.cli.plan import estimate
    from mpifl.config import load_config

    config = ROOT / "configs" / "gpt2.yaml"
    overrides = [*check.device_overrides[:1], *(["eval.device=cuda"] if check.device == "cuda" else [])]
    runs = {n: run_mpifl(check, f"gpt2-ranks-{n}", n, config, *overrides) for n in (2, 3)}
    bitwise = bool(np.array_equal(final_weights(runs[2]), final_weights(runs[3])))
    history = records(runs[3])
    later = history[1:] or history
    seconds = statistics.median(r["time"]["round"] - r["time"]["eval"] for r in later)
    evaluation = statistics.median(r["time"]["eval"] for r in later)
    result = (f"2 and 3 ranks {'bitwise equal' if bitwise else 'DIFFER'}; perplexity "
              f"{history[-1]['eval']['perplexity']:,.1f} after round {len(history)}; median round {seconds:.2f} s "
              f"+ {evaluation:.2f} s evaluating")
    if any("client_peak_device_bytes" in r for r in history):
        peak = max(r.get("client_peak_device_bytes", 0) for r in history)
        cfg = load_config(str(config), [*overrides, f"rounds={check.rounds}"])
        planned = estimate(cfg, 3, 4, False, gpus_per_node=1)[1].client_device_bytes
        result += f"; GPU peak {peak / 2**20:,.0f} MiB, planned {planned / 2**20:,.0f} MiB with its activations"
    return Row("llm: gpt2", f"{check.rounds} rounds, {' '.join(overrides)}", result, bitwise)


def batched_steps(add: Callable[..., None], quick: bool, per_round: Sequence[int] = BATCHED_PER_ROUND,
                  distances: bool = True) -> None:
    """The batched-clients steps: each model's distance and bitwise check (``quick``: the MLP's), then its client
    updates/s one at a time and batched (every client of the round in one batch) at each of ``BATCHED_PER_ROUND``
    clients a round (one at a time only up to 200: 2,000 would take minutes at the same rate per client)."""
    for model in (("mlp",) if quick else ("mlp", "cnn")) if distances else ():
        add(batched_versus_one_at_a_time, model)
    for model in ("mlp", "cnn"):
        for count in per_round[:1] if quick else per_round:
            rounds = "rounds=2" if quick else "rounds=3" if count > 200 else "rounds=4"  # quick: the steps run
            if count <= 200:  # one at a time, a client's rate does not depend on the round's size
                add(throughput, model, count, rounds)
            add(throughput, model, count, rounds, f"train.batched_clients={count}")


def run_step(check: Check, step: Callable[..., Row], *args: object) -> Row:
    """One step's row. A step that raises (an mpifl run that exited non-zero or passed its timeout) is a failed row
    with the error's last line, so the steps after it still run: one broken case hides none of the others."""
    try:
        return step(check, *args)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as error:
        lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        return Row(step.__name__.replace("_", " "), " ".join(map(str, args)) or "-", f"raised: {lines[-1][:300]}",
                   False)


def table(rows: list[Row]) -> str:
    """The rows as one plain-text table."""
    verdict = {True: "ok", False: "FAIL", None: "skip"}
    cells = [("step", "setting", "result", "")] + [(r.step, r.setting, r.result, verdict[r.passed]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells)


def gpus_here() -> int:
    """GPUs this machine shows, without starting CUDA in this process."""
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    return int(found.stdout.strip() or 0) if found.returncode == 0 else 0


def share_site_packages(venv: Path) -> None:
    """Let ``venv`` see this interpreter's packages when this interpreter is itself a venv's.

    ``python -m venv --system-site-packages`` gives the new venv its base interpreter's packages, not those of the
    venv it was made from, and GPU images often keep their CUDA torch in one (``/opt/torch/.venv`` on the H100
    machine of docs/how-to/gpus.md). A ``.pth`` file in the new venv adds them after its own."""
    if sys.prefix == sys.base_prefix:
        return
    import site

    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "outer-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def main(argv: list[str] | None = None, launch: Launch | None = None) -> int:
    """The check; ``launch``: how its ``mpifl`` jobs run (``Check.launch``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="3 rounds, 20 clients per round, each comparison once (the suite's form)")
    p.add_argument("--tests", default="tests/test_mpi_device.py", help="pytest selection of the device tests")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--bin", type=Path, default=Path(sys.executable).parent,
                   help="where mpifl (and, unless the system's is used, mpiexec) are")
    p.add_argument("--timeout", type=int, default=600, help="seconds per mpifl run")
    p.add_argument("--llm", action="store_true", help="also: configs/gpt2.yaml (GPT-2, 124 M parameters) with 2 and "
                   "3 ranks, bitwise equal, and its GPU peak against mpifl plan's (needs the 'hf' extra)")
    p.add_argument("--deterministic-cost", action="store_true",
                   help="also: the CNN's throughput at 200 clients a round with train.deterministic true and false, "
                   "interleaved twice (what deterministic kernels cost)")
    p.add_argument("--only", choices=("batched", "throughput"),
                   help="batched: only the batched-clients steps (train.batched_clients against one at a time: "
                   "distance, bitwise across ranks, and client updates/s at 20, 200 and 2,000 clients a round); "
                   "throughput: only their client updates/s")
    p.add_argument("--per-round", type=int, nargs="+", default=list(BATCHED_PER_ROUND),
                   help="clients a round of the batched throughput rows")
    p.add_argument("--share-site-packages", type=Path, metavar="VENV",
                   help="only let VENV see this interpreter's packages (make gpu-check: the node's CUDA torch when "
                   "it lives in a venv), then exit")
    args = p.parse_args(argv)
    if args.share_site_packages:
        share_site_packages(args.share_site_packages)
        return 0
    devices = gpus_here() if args.device == "cuda" else 1
    if args.device == "cuda" and devices == 0:
        print("gpu_check: no GPU visible to torch (torch.cuda.device_count() is 0): is this torch a CUDA build, "
              "and does this node have a GPU? The CPU form: --device cpu", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        check = Check(args.device, devices, 3 if args.quick else 5, args.bin, Path(work), args.timeout, launch=launch)
        rows: list[Row] = []

        def add(step: Callable[..., Row], *args: object) -> None:
            """Run one step and print its row at once, so a run stopped by a time limit still shows what passed."""
            started = time.perf_counter()
            rows.append(run_step(check, step, *args))
            row = rows[-1]
            print(f"gpu_check: {row.step} ({row.setting}): {row.result} [{time.perf_counter() - started:.0f} s, "
                  f"ended {time.strftime('%H:%M:%S')}]", file=sys.stderr, flush=True)

        if args.only is not None:
            batched_steps(add, quick=args.quick, per_round=args.per_round, distances=args.only == "batched")
            print(table(rows))
            if args.json:
                args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
            return 0 if all(r.passed is not False for r in rows) else 1
        add(device_tests, args.tests)
        add(versus_cpu, "quick start")
        if not args.quick:  # the suite runs these steps' CPU forms in its own job pool (tests/test_mpi_device.py's
            # groups-delta case, tests/test_mpi_ditto.py, ...): its quick form runs the comparison once, the quick start
            add(versus_cpu, "reduction groups", "clients.groups=2", "strategy.update=delta")
            add(versus_cpu, "scaffold with local head", "strategy.name=scaffold", "strategy.update=delta",
                "model.local=['5.*']")
            add(versus_cpu, "ditto", "train.ditto_lambda=0.5", "strategy.update=delta")
        for model in ("mlp",) if args.quick else ("mlp", "cnn"):
            add(two_ranks_per_client, model)
        add(bitwise_across_ranks, "mlp", (2, 3) if args.quick else (2, 3, 5))
        if not args.quick:
            add(bitwise_across_ranks, "cnn", (2, 3, 5))
        batched_steps(add, quick=args.quick, per_round=args.per_round)
        if args.llm:
            add(llm)
        for repeat in range(2) if args.deterministic_cost else ():
            for deterministic in ("true", "false"):
                add(throughput, "cnn", 200, f"train.deterministic={deterministic}", f"name=repeat-{repeat}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
