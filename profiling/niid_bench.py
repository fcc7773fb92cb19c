"""NIID-Bench's Fashion-MNIST rows (FedAvg, FedProx, SCAFFOLD, FedNova), run with mpifl, beside the paper's figures.

Li, Diao, Chen and He, "Federated Learning on Non-IID Data Silos: An Experimental Study" (ICDE 2022,
arXiv:2102.02079; code github.com/Xtra-Computing/NIID-Bench). Its settings (``--setting``):

- ``labeldir`` (the default): label skew, p_k ~ Dir(0.5) (its ``noniid-labeldir`` partition);
- ``label1``, ``label2``, ``label3``: label-quantity skew, each party holding #C=k labels (``noniid-#label<k>``);
- ``quantity``: quantity skew, party sizes q ~ Dir(0.5) with IID labels (``iid-diff-quantity``);
- ``iid``: an even random split (``homo``);
- ``noise``: noise-based feature imbalance, an even split (its ``homo`` partition) with party k of 10 reading its
  images through Gaussian noise of std 0.1 * k / 9 (mpifl's ``data.feature_noise``).

This script runs ``configs/niid_bench/fmnist_<setting>_<algorithm>.yaml`` for each algorithm and seed, one after
another (never in parallel), each under ``mpiexec -n RANKS``, reads the global model's test accuracy after the last
round from each run's metrics.jsonl, and prints a markdown table against the paper. From the repository root (the
full protocol takes hours on a laptop; see the estimate it prints):

    python profiling/niid_bench.py                       # 4 algorithms x seeds 0 1 2, 50 rounds each
    python profiling/niid_bench.py --setting noise --algorithms fedavg    # the row with a published figure
    python profiling/niid_bench.py --rounds 1 --epochs 1 --seeds 0 --algorithms fedavg fednova   # smoke
    python profiling/niid_bench.py --work runs/niid_bench-20261125-020000   # go on with a stopped reproduction

The protocol lives here once (PROTOCOL, SETTINGS, ALGORITHMS); the configs must say the same, which
tests/test_niid_bench_harness.py checks. Unless ``--partition mpifl``, each run gets NIID-Bench's own split of its
seed (``niid_labeldir``, ``niid_label_quantity``, ``niid_quantity`` or ``niid_homo``: the same draws as
NIID-Bench's ``partition_data`` after ``np.random.seed(init_seed)`` and ``random.seed(init_seed)``), written as a
``data.partition: file`` JSON; ``--partition mpifl`` keeps the configs' own ``data.partition``.
Needs Fashion-MNIST in /usr/share/datasets/fashion-mnist (``apt-get install dataset-fashion-mnist``).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script, profiling/ is on the path, not the package

from mpifl.learning.partitions import deal_label_runs, label_sets  # noqa: E402  (NIID-Bench's #C=k, shared)
from profiling.niid_records import (  # noqa: E402
    FLOWER_SPLIT_RECORDS,
    RECORDS,
    RunRecord,
    algorithm_of,
    describe,
    describe_cell,
    find_record,
    grid_table,
    mean_std,
    plot_grid,
    read_records,
    record_from_curve,
    run_name,
    write_record,
)

CONFIGS = ROOT / "configs" / "niid_bench"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                       "t10k-labels-idx1-ubyte")

# The protocol, as config keys. Sources: NIID-Bench (commit 61b901a) scripts/image-data-without-noise.sh runs
# `experiments.py --model=simple-cnn --lr=0.01 --batch-size=64 --epochs=10 --n_parties=10 --rho=0.9
# --comm_round=50 --partition=noniid-labeldir --beta=0.5 --init_seed=$init_seed` for init_seed in 0 1 2 (fedprox
# also --mu in 0.001 0.01 0.1 1); experiments.py's defaults give --sample=1 (every party, every round) and
# --reg=1e-5 (SGD weight_decay); utils.get_dataloader reads fmnist with ToTensor() only ([0, 1], no
# normalisation), which is what mpifl's fashion_mnist gives.
PROTOCOL: dict[str, object] = {
    "rounds": 50,                                    # --comm_round=50
    "clients.num_clients": 10,                       # --n_parties=10
    "clients.fraction": 1.0,                         # --sample=1 (default)
    "data.dataset": "fashion_mnist",                 # --dataset=fmnist
    "model.name": "profiling.niid_bench_model:simple_cnn_mnist",  # --model=simple-cnn -> SimpleCNNMNIST
    "train.optimizer": "sgd",                        # --optimizer=sgd (default)
    "train.lr": 0.01,                                # --lr=0.01
    "train.momentum": 0.9,                           # --rho=0.9
    "train.weight_decay": 1e-5,                      # --reg=1e-5 (default)
    "train.local_epochs": 10,                        # --epochs=10
    "train.batch_size": 64,                          # --batch-size=64
    "strategy.weighting": "samples",                 # fed_avg_freqs / n_list: local sample counts
    "eval.every": 1,                                 # the global model on the whole test set after every round
}
SEEDS = (0, 1, 2)                                    # the script's `for init_seed in 0 1 2`
FEDPROX_MU_GRID = (0.001, 0.01, 0.1, 1.0)            # the script's `for mu in 0.001 0.01 0.1 1`
FEDPROX_MU = 0.01                                    # the configs' choice; the paper reports the best of the grid
NIID_MIN_REQUIRE_SIZE = 10                           # utils.partition_data, noniid-labeldir

# Per algorithm: its config's own keys (on top of PROTOCOL).
ALGORITHMS: dict[str, dict[str, object]] = {
    "fedavg": {"strategy.name": "fedavg", "strategy.update": "weights"},
    "fedprox": {"strategy.name": "fedavg", "strategy.update": "weights", "train.prox_mu": FEDPROX_MU},
    "scaffold": {"strategy.name": "scaffold", "strategy.update": "delta"},
    "fednova": {"strategy.name": "fednova", "strategy.update": "delta"},
}



@dataclass(frozen=True)
class Setting:
    """One of the paper's FMNIST rows: its partition, its config keys on top of PROTOCOL, and the published
    figures with their sources. ``paper`` holds (mean %, std %) per algorithm, None where no source we could read
    gives it: the table then prints "not found", never a number from memory."""

    title: str                         # the row, as the paper's Table III names it
    prefix: str                        # configs/niid_bench/<prefix>_<algorithm>.yaml
    keys: dict[str, object]            # its config keys (on top of PROTOCOL)
    niid_partition: str                # NIID-Bench's --partition
    paper: dict[str, tuple[float, float] | None]
    paper_source: str
    other: dict[str, float]            # another reproduction, for orientation only (it is not the paper)
    other_label: str                   # its column's header
    other_source: str
    test_set: str                      # what the accuracy is measured on


SETTINGS: dict[str, Setting] = {
    # The paper's Table III (top-1 accuracy, mean +- std over its runs; Flower's baseline README calls it "Table 3")
    # holds these numbers, but none of the sources we could read gives them: the stored copies of the paper stop at
    # its abstract, NIID-Bench's README leaderboard lists CIFAR-10 only, and its issues and other repositories
    # quote other rows. Flower's NIID-Bench baseline ran the row once, with dataset_seed 42 (its README's "Expected
    # Results" table, row FMNIST / Dirichlet (0.5); github.com/adap/flower, baselines/niid_bench/README.md, commit
    # 1599d01c2f76a4139abe231b7e294f828ba62048). Its FedProx mu is "tuned from values {0.001, 0.01, 0.1, 1.0}"; the
    # README does not say which one it shows.
    "labeldir": Setting(
        title="p_k ~ Dir(0.5)", prefix="fmnist_dir05",
        keys={"data.partition": "dirichlet",         # --partition=noniid-labeldir (see niid_labeldir)
              "data.alpha": 0.5},                    # --beta=0.5
        niid_partition="noniid-labeldir",
        paper={"fedavg": None, "fedprox": None, "scaffold": None, "fednova": None},
        paper_source="Li et al., ICDE 2022, Table III (FMNIST, p_k ~ Dir(0.5)): values not found in any readable "
                     "source",
        other={"fedavg": 88.4, "fedprox": 88.6, "scaffold": 88.4, "fednova": 88.1},
        other_label="Flower's reproduction (1 run)",
        other_source="Flower baselines/niid_bench/README.md (adap/flower@1599d01c), \"Expected Results\", one run, "
                      "dataset_seed 42, FedProx's mu tuned in {0.001, 0.01, 0.1, 1} (which one is not stated)",
        test_set="the 10,000 test images"),
    # NIID-Bench's scripts/image-data-with-noise.sh: the same protocol with --partition=homo --noise=0.1; party k
    # adds noise of std 0.1 * k / 9 (experiments.py: noise_level = args.noise / (args.n_parties - 1) * net_id) to
    # its training and its local test images, and the global model is scored on the concatenation of every
    # party's noisy test set (10 x 10,000 images). The paper's FedAvg figure, 89.1% +- 0.3%, is quoted by FedLab's
    # reproduction of this row (github.com/SMILELab-FL/FedLab-benchmarks,
    # fedlab_benchmarks/feature-skew-fedavg/README.md, commit 274fb361c74d95c9bb7c4379143ca1e0bde530df: "Top-1
    # accuracy for FMNIST in paper: 89.1% +- 0.3%"; its own run, 89.37% +- 0.14% over 5 runs).
    "noise": Setting(
        title="noise-based feature imbalance (noise 0.1)", prefix="fmnist_noise01",
        keys={"data.partition": "iid",               # --partition=homo (see niid_homo)
              "data.feature_noise": 0.1},            # --noise=0.1: party k's std 0.1 * k / 9
        niid_partition="homo",
        paper={"fedavg": (89.1, 0.3), "fedprox": None, "scaffold": None, "fednova": None},
        paper_source="Li et al., ICDE 2022, Table III (FMNIST, noise-based feature imbalance): FedAvg 89.1% ± 0.3% as "
                     "quoted by SMILELab-FL/FedLab-benchmarks fedlab_benchmarks/feature-skew-fedavg/README.md; the "
                     "other algorithms' values not found in any readable source",
        other={"fedavg": 89.37},
        other_label="FedLab's reproduction (5 runs)",
        other_source="FedLab's reproduction of the FedAvg row (FedLab-benchmarks "
                      "feature-skew-fedavg/README.md), 89.37% ± 0.14% over 5 runs",
        test_set="the 10,000 test images at each of the 10 parties' noise levels (100,000 scored images)"),
}

# Flower's NIID-Bench baseline (github.com/adap/flower baselines/niid_bench/README.md, commit
# 1599d01c2f76a4139abe231b7e294f828ba62048, "Expected Results", row FMNIST): one run each, `run_exp.py --seed 42`,
# FedProx's mu tuned in {0.001, 0.01, 0.1, 1.0} (which one is not stated). Its IID is NIID-Bench's `homo`, its
# "Sort and Partition (k)" NIID-Bench's `noniid-#label<k>`; it has no quantity-skew row.
FLOWER = "Flower's reproduction (1 run)"
FLOWER_SOURCE = ("Flower baselines/niid_bench/README.md (adap/flower@1599d01c), \"Expected Results\", one run, "
                 "seed 42, FedProx's mu tuned in {0.001, 0.01, 0.1, 1} (which one is not stated)")
FLOWER_FMNIST = {"iid": {"fedavg": 89.0, "scaffold": 89.5, "fedprox": 89.5, "fednova": 89.3},
                 "label1": {"fedavg": 10.0, "scaffold": 10.0, "fedprox": 38.0, "fednova": 11.1},
                 "label2": {"fedavg": 81.0, "scaffold": 10.0, "fedprox": 78.8, "fednova": 70.5},
                 "label3": {"fedavg": 83.2, "scaffold": 84.2, "fedprox": 82.5, "fednova": 83.2}}
NOT_FOUND = {"fedavg": None, "fedprox": None, "scaffold": None, "fednova": None}
PAPER_NOT_FOUND = "Li et al., ICDE 2022, Table III (FMNIST, {row}): values not found in any readable source"
TEST_SET = "the 10,000 test images"

# scripts/image-data-without-noise.sh's other partitions: `for partition in noniid-labeldir noniid-#label1
# noniid-#label2 noniid-#label3 iid-diff-quantity homo`, all with --beta=0.5.
for _k in (1, 2, 3):
    SETTINGS[f"label{_k}"] = Setting(
        title=f"#C={_k} (each party holds {_k} label{'s' if _k > 1 else ''})", prefix=f"fmnist_label{_k}",
        keys={"data.partition": "shards", "data.classes_per_client": _k},  # --partition=noniid-#label<k>
        niid_partition=f"noniid-#label{_k}", paper=dict(NOT_FOUND),
        paper_source=PAPER_NOT_FOUND.format(row=f"#C={_k}"), other=FLOWER_FMNIST[f"label{_k}"], other_label=FLOWER,
        other_source=FLOWER_SOURCE, test_set=TEST_SET)
SETTINGS["quantity"] = Setting(
    title="quantity skew, q ~ Dir(0.5)", prefix="fmnist_quantity",
    keys={"data.partition": "unbalanced"},           # --partition=iid-diff-quantity --beta=0.5 (see niid_quantity)
    niid_partition="iid-diff-quantity", paper=dict(NOT_FOUND),
    paper_source=PAPER_NOT_FOUND.format(row="quantity skew"), other={}, other_label="another reproduction",
    other_source="none found (Flower's baseline has no quantity-skew row)", test_set=TEST_SET)
SETTINGS["iid"] = Setting(
    title="homogeneous (IID)", prefix="fmnist_iid",
    keys={"data.partition": "iid"},                  # --partition=homo
    niid_partition="homo", paper=dict(NOT_FOUND), paper_source=PAPER_NOT_FOUND.format(row="homogeneous"),
    other=FLOWER_FMNIST["iid"], other_label=FLOWER, other_source=FLOWER_SOURCE, test_set=TEST_SET)


def config_path(algorithm: str, setting: str = "labeldir") -> Path:
    """The shipped config of ``algorithm`` in ``setting``."""
    return CONFIGS / f"{SETTINGS[setting].prefix}_{algorithm}.yaml"


def expected_keys(algorithm: str, setting: str = "labeldir") -> dict[str, object]:
    """Every protocol key ``algorithm``'s config in ``setting`` must hold, and its value."""
    return {**PROTOCOL, **SETTINGS[setting].keys, **ALGORITHMS[algorithm]}


def dataset_problem(folder: Path | None = None) -> str | None:
    """Why Fashion-MNIST cannot be read from ``folder`` (default FASHION_MNIST; plain or .gz IDX files), or None."""
    folder = folder or FASHION_MNIST
    missing = [n for n in FASHION_MNIST_FILES if not ((folder / n).is_file() or (folder / f"{n}.gz").is_file())]
    if not missing:
        return None
    return (f"Fashion-MNIST is not in {folder} (missing {', '.join(missing)}): install Debian's package with "
            "`sudo apt-get install dataset-fashion-mnist` (the runs read nothing from the network)")


def train_labels(folder: Path | None = None):
    """The 60,000 training labels, in file order (the order torchvision's FashionMNIST reads them in)."""
    import numpy as np

    folder = folder or FASHION_MNIST
    name = "train-labels-idx1-ubyte"
    path = folder / name if (folder / name).is_file() else folder / f"{name}.gz"
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    count = int.from_bytes(raw[4:8], "big")
    if raw[:4] != b"\x00\x00\x08\x01" or len(raw) != 8 + count:
        raise ValueError(f"{path}: not an IDX label file")
    return np.frombuffer(raw, dtype=np.uint8, offset=8).astype(np.int64)


def niid_labeldir(labels, n_parties: int, beta: float, seed: int,
                  min_require_size: int = NIID_MIN_REQUIRE_SIZE) -> list[list[int]]:
    """NIID-Bench's ``noniid-labeldir`` split (utils.partition_data), draw for draw: after
    ``np.random.seed(seed)`` it shuffles each class and draws Dir(beta) proportions, zeroes the share of
    parties that already hold N / n_parties samples (the balance rule), cuts the class by the cumulative
    shares, and redraws the whole split until every party holds at least ``min_require_size`` samples; then
    shuffles each party's indices. Returns each party's indices in NIID-Bench's order."""
    import numpy as np

    rng = np.random.RandomState(seed)  # the legacy global stream np.random.seed(seed) sets
    labels = np.asarray(labels)
    n, num_classes = len(labels), int(labels.max()) + 1  # NIID-Bench: K = 10 for fmnist
    min_size = 0
    while min_size < min_require_size:
        idx_batch: list[list[int]] = [[] for _ in range(n_parties)]
        for k in range(num_classes):
            idx_k = np.where(labels == k)[0]
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.repeat(beta, n_parties))
            proportions = np.array([p * (len(idx_j) < n / n_parties) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, cuts))]
            min_size = min(len(idx_j) for idx_j in idx_batch)
    for j in range(n_parties):
        rng.shuffle(idx_batch[j])
    return idx_batch


def niid_homo(num_samples: int, n_parties: int, seed: int) -> list[list[int]]:
    """NIID-Bench's ``homo`` split (utils.partition_data): after ``np.random.seed(seed)``, one permutation of the
    training samples cut into ``n_parties`` near-equal runs (``np.array_split``)."""
    import numpy as np

    order = np.random.RandomState(seed).permutation(num_samples)
    return [part.tolist() for part in np.array_split(order, n_parties)]


def niid_label_quantity(labels, n_parties: int, num: int, seed: int, num_classes: int = 10) -> list[list[int]]:
    """NIID-Bench's ``noniid-#label<num>`` split (utils.partition_data), draw for draw. Its experiments.py seeds
    both streams with the seed (``np.random.seed``, ``random.seed``). Party i holds label i mod K and ``num - 1``
    more labels drawn with Python's ``random.randint`` until distinct; then each label's samples, shuffled by numpy
    in label order, are cut into near-equal runs (``np.array_split``), one per party holding it, in party order.
    A party's indices are its labels' runs in label order, unshuffled. ``num`` = K gives every party an even share
    of every label."""
    import random

    import numpy as np

    rng, draws = np.random.RandomState(seed), random.Random(seed)
    contain = ([list(range(num_classes))] * n_parties if num == num_classes  # every label, nothing drawn
               else label_sets(n_parties, num, num_classes, lambda: draws.randint(0, num_classes - 1)))
    return deal_label_runs(labels, contain, rng.shuffle, num_classes)


def niid_quantity(num_samples: int, n_parties: int, beta: float, seed: int,
                  min_require_size: int = NIID_MIN_REQUIRE_SIZE) -> list[list[int]]:
    """NIID-Bench's ``iid-diff-quantity`` split (utils.partition_data): after ``np.random.seed(seed)``, one
    permutation of the training samples, then Dir(beta) party shares drawn until every party would hold at least
    ``min_require_size`` samples, and the permutation cut by the cumulative shares."""
    import numpy as np

    rng = np.random.RandomState(seed)
    order = rng.permutation(num_samples)
    smallest = 0.0
    while smallest < min_require_size:
        proportions = rng.dirichlet(np.repeat(beta, n_parties))
        proportions = proportions / proportions.sum()
        smallest = float(np.min(proportions * len(order)))
    cuts = (np.cumsum(proportions) * len(order)).astype(int)[:-1]
    return [part.tolist() for part in np.split(order, cuts)]


# Flower's baseline draws every split from np.random.default_rng(42): load_datasets() takes a `seed` argument that
# defaults to 42 and main.py never passes the config's dataset_seed to it (niid_bench/dataset.py, main.py).
FLOWER_SEED = 42
FLOWER_SPLITS = ("label1", "label2", "label3")  # the settings whose Flower split flower_label_quantity draws


def flower_label_quantity(labels, n_parties: int, num: int, seed: int = FLOWER_SEED,
                          num_classes: int = 10) -> list[list[int]]:
    """Flower's NIID-Bench baseline's #C=k split (``partition_data_label_quantity`` in
    baselines/niid_bench/niid_bench/dataset_preparation.py), draw for draw: NIID-Bench's rule, but every draw comes
    from one ``np.random.default_rng(seed)``. Party i holds label i mod K and ``num - 1`` more labels drawn with
    ``rng.choice(K, 1)`` until distinct; then each label's samples, shuffled by the same generator in label order,
    are cut into near-equal runs, one per party holding it, in party order. Flower's published Fashion-MNIST row
    was trained on this split of seed 42, so mpifl can be run on the very parties Flower's figure came from."""
    import numpy as np

    rng = np.random.default_rng(seed)
    contain = label_sets(n_parties, num, num_classes, lambda: int(rng.choice(num_classes, 1)[0]))
    return deal_label_runs(labels, contain, rng.shuffle, num_classes)


NIID_BETA = 0.5  # scripts/image-data-without-noise.sh: --beta=0.5 for every partition


def niid_split(setting: str, labels, seed: int) -> list[list[int]]:
    """NIID-Bench's split of ``seed`` for ``setting``."""
    parties = int(PROTOCOL["clients.num_clients"])  # type: ignore[call-overload]
    partition = SETTINGS[setting].niid_partition
    if partition == "homo":
        return niid_homo(len(labels), parties, seed)
    if partition == "iid-diff-quantity":
        return niid_quantity(len(labels), parties, NIID_BETA, seed)
    if partition.startswith("noniid-#label"):
        return niid_label_quantity(labels, parties, int(partition.removeprefix("noniid-#label")), seed)
    return niid_labeldir(labels, parties, float(SETTINGS[setting].keys["data.alpha"]), seed)  # type: ignore[arg-type]


def write_partition(path: Path, seed: int, folder: Path | None = None, setting: str = "labeldir",
                    flower: bool = False) -> Path:
    """NIID-Bench's split of ``seed`` (with ``flower``, Flower's baseline's split of seed 42) as a
    ``data.partition: file`` JSON (a list of per-client index lists)."""
    if flower and setting not in FLOWER_SPLITS:
        raise ValueError(f"--partition flower: Flower's split is written for label1, label2 and label3 only, not "
                         f"{setting!r}")
    labels = train_labels(folder)
    parts = (flower_label_quantity(labels, int(PROTOCOL["clients.num_clients"]),  # type: ignore[call-overload]
                                   int(setting.removeprefix("label")))
             if flower else niid_split(setting, labels, seed))
    path.write_text(json.dumps([[int(i) for i in p] for p in parts]))
    return path


def read_run(run_dir: Path) -> dict:
    """From a run's metrics.jsonl: the last evaluated round's test accuracy, the best, every evaluated round's
    (``curve``), and round timings."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r for r in records if "eval" in r]
    if not evaluated:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no round was evaluated")
    curve = [r["eval"]["accuracy"] for r in evaluated]
    return {"accuracy": curve[-1], "round": evaluated[-1]["round"], "best": max(curve), "rounds": len(records),
            "curve": curve,
            "round_seconds": [r["time"]["round"] for r in records],
            "eval_seconds": [r["time"]["eval"] for r in records],
            "num_samples": [r["num_samples"] for r in records]}


def percent(accuracies: Sequence[float]) -> str:
    """Accuracies (fractions, one per seed) as "mean% ± std% (n=...)"."""
    mean, std = mean_std(accuracies)
    return f"{100 * mean:.1f}%" + (f" ± {100 * std:.1f}%" if std is not None else "") + f" (n={len(accuracies)})"


def format_table(results: dict[str, list[float]], errors: dict[str, str] | None = None,
                 setting: str = "labeldir", best: dict[str, list[float]] | None = None) -> str:
    """The comparison as markdown: one row per label (an algorithm, or "fedprox (mu=...)"), with mpifl's test
    accuracies (fractions, one per seed) as mean +- sample std in %, after the last round and, from ``best``, the
    best over rounds (the convention of most such tables), the paper's mean +- std, the difference of the
    last-round means in percentage points, and another reproduction for orientation."""
    errors, best = errors or {}, best or {}
    published, others = SETTINGS[setting].paper, SETTINGS[setting].other
    lines = ["| algorithm | mpifl, last round (mean ± std over seeds) | mpifl, best round | paper's accuracy "
             f"(Table III) | difference | {SETTINGS[setting].other_label} |",
             "|---|---|---|---|---|---|"]
    for label in [*results, *(k for k in errors if k not in results)]:
        accs = results.get(label, [])
        mean = mean_std(accs)[0] if accs else None
        ours = percent(accs) if accs else "no run finished"
        if label in errors:
            ours += f"; failed: {errors[label]}"
        top = percent(best[label]) if best.get(label) else "n/a"
        paper = published.get(algorithm_of(label))
        paper_text = f"{paper[0]:.1f}% ± {paper[1]:.1f}%" if paper else "not found"
        diff = f"{100 * mean - paper[0]:+.1f} pp" if paper and mean is not None else "n/a"
        other = others.get(algorithm_of(label))
        lines.append(f"| {label} | {ours} | {top} | {paper_text} | {diff} | "
                     f"{f'{other:.1f}%' if other is not None else 'not found'} |")
    return "\n".join(lines)


def git_commit() -> str:
    """The checkout's commit, with "+ uncommitted changes" when a tracked file differs from it (new files, such as
    the records a grid writes, are not changes to the code that ran)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + (" + uncommitted changes" if dirty.strip() else "")


def machine() -> str:
    """CPU model, cores, OS and Python."""
    model = platform.processor() or "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


# Which client rank trains which party. Placement never changes mpifl's results, only a round's time, and a resume
# may change it. Round robin gives party c to rank 1 + c mod N, far from even under quantity skew: seed 0's
# Dir(0.5) sizes put 48,654 of the 60,000 samples on one of two client ranks, and its rounds took 74 s where an
# even split takes about 50. Balanced homes the parties heaviest first on the least loaded rank (30,212 / 29,788).
PLACEMENT = "balanced"


def run_one(args: argparse.Namespace, algorithm: str, seed: int, run_dir: Path, overrides: list[str],
            setting: str = "labeldir") -> dict:
    """One ``mpiexec -n RANKS mpifl run`` of ``algorithm``'s config; its read-out, or {"error": ...}.

    The run goes on from ``run_dir``'s newest checkpoint when there is one (``--resume``): run with the same
    ``--work`` again, a reproduction stopped part way (a job's walltime, a reboot) keeps every round already
    done, a finished run is only read, and a resumed run ends bitwise where an uninterrupted one would. A
    checkpoint after every round (the simple CNN's 44,426 parameters: 174 KiB) loses at most one round to a kill;
    SIGTERM (a walltime) stops at the round's end with its checkpoint."""
    cmd = [str(Path(args.bin) / "mpiexec"), "-n", str(args.ranks), str(Path(args.bin) / "mpifl"), "run",
           str(config_path(algorithm, setting)), "--run-dir", str(run_dir), "--resume", f"seed={seed}",
           "checkpoint.every=1", "output.progress=false", f"clients.placement={PLACEMENT}", *overrides]
    env = dict(os.environ)  # the plug-in model is profiling.niid_bench_model: the repository root goes on the path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    log = run_dir.with_name(run_dir.name + ".log")  # not with_suffix: "mu0.01" would make every seed "mu0.log"
    print(f"  {shlex.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "a") as out:  # appended: a resumed run's log follows the interrupted one's
        out.write(f"# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}: {shlex.join(cmd)}\n")
        out.flush()
        rc = run_with_time_limit(cmd, env, out, args.run_timeout)
    wall = time.perf_counter() - start
    if rc is None:
        return {"error": f"still running after --run-timeout {args.run_timeout:g} s: stopped with SIGTERM (it "
                         f"checkpoints at the round's end); the same --work goes on from there (log: {log})",
                "wall": wall}
    if rc != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
        if diverged(why) and (run_dir / "metrics.jsonl").is_file():
            read = read_run(run_dir)
            return {**read, "wall": wall, "diverged_round": read["rounds"] + 1, "why": why.strip()[:300]}
        return {"error": f"exit {rc}: {why.strip()[:300]} (log: {log})", "wall": wall}
    return {**read_run(run_dir), "wall": wall}


def diverged(error_line: str) -> bool:
    """Whether a run ended because a client's update held NaN/Inf (``clients.accept_failures: false``, the
    protocol's: NIID-Bench drops no client), its training having diverged: a result of the algorithm on that
    split, recorded as such, not a failure of the harness. The line is the client rank's: "update contains N NaN/Inf
    values (clients.accept_failures=false)", without ", put there by faults[i]" (an injected fault's)."""
    return "NaN/Inf values" in error_line and "accept_failures=false" in error_line and "put there by" not in error_line


def run_with_time_limit(cmd: list[str], env: dict[str, str], out, seconds: float) -> int | None:
    """``cmd``'s exit status, or None when it ran past ``seconds``. An MPI job that hangs would hold the
    reproduction (and a batch allocation) forever: past the limit the job gets SIGTERM, as a walltime would give
    it, so mpifl checkpoints the round it is in and exits; SIGKILL follows a minute later if it has not. The job
    runs in a session of its own (a terminal's Ctrl-C is the harness's to pass on): a harness stopped by Ctrl-C or
    SIGTERM stops its job the same way before it goes, instead of leaving it running orphaned."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        stop_job(proc)
        return None
    except BaseException:  # Ctrl-C, or SIGTERM to the harness
        stop_job(proc)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_job(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (each rank checkpoints its round and exits), SIGKILL a minute later."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()



def variants(algorithm: str, mus: Sequence[float]) -> list[tuple[str, list[str]]]:
    """The grid rows an algorithm runs as, each with its overrides: FedProx once per mu ("fedprox (mu=0.01)")."""
    if algorithm == "fedprox":
        return [(f"fedprox (mu={mu:g})", [f"train.prox_mu={mu}"]) for mu in mus]
    return [(algorithm, [])]


def describe_records(setting: str, label: str, seeds: Sequence[int], root: Path = RECORDS) -> list[str]:
    """``describe`` of each recorded seed of one cell, against FedAvg's record of the same seed, then the cell over
    every seed recorded; says which seeds have no record."""
    lines = []
    for seed in seeds:
        record = find_record(setting, label, seed, root)
        if record is None:
            lines.append(f"{setting} {label} seed {seed}: no record")
            continue
        fedavg = find_record(setting, "fedavg", seed, root) if algorithm_of(label) != "fedavg" else None
        lines.extend(describe(record, fedavg))
    cell = [r for r in read_records(root) if r.setting == setting and r.label == label]
    if cell:
        lines.append(describe_cell(cell))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3, help="MPI ranks per run: 1 server + RANKS-1 client ranks")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds per run (protocol: {PROTOCOL['rounds']})")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"local epochs (protocol: {PROTOCOL['train.local_epochs']}; fewer only for smoke runs)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (the paper's init_seed 0 1 2)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--mu", type=float, nargs="+", default=[FEDPROX_MU],
                   help=f"FedProx mu, one row each (the paper's grid: {' '.join(map(str, FEDPROX_MU_GRID))})")
    p.add_argument("--setting", choices=list(SETTINGS), default="labeldir",
                   help="labeldir: label skew, p_k ~ Dir(0.5); noise: an even split, party k's images through noise "
                        "of std 0.1 k / 9 (the row whose FedAvg figure is published in a readable source); label1, "
                        "label2, label3: each party holds #C=k labels; quantity: q ~ Dir(0.5) sizes; iid: homo")
    p.add_argument("--partition", choices=("niid", "mpifl", "flower"), default="niid",
                   help="niid: NIID-Bench's split of each seed (its partition_data's draws, as a partition file); "
                        "mpifl: the configs' data.partition (dirichlet, shards, unbalanced or iid); flower: Flower's "
                        "baseline's split of seed 42, the one its published figures were trained on (label1-3; "
                        "--seeds then sets mpifl's training seed only)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides for every run")
    p.add_argument("--work", type=Path, default=None,
                   help="where runs go (default runs/niid_bench-<time>); give an earlier --work to go on with it: "
                        "finished runs are read, unfinished ones resume from their newest checkpoint")
    p.add_argument("--bin", default=str(Path(sys.executable).parent), help="folder holding mpiexec and mpifl")
    p.add_argument("--run-timeout", type=float, default=4 * 3600,
                   help="seconds one run may take before it is stopped with SIGTERM (the full protocol: about "
                   "27 minutes a run on 2 cores)")
    p.add_argument("--records", type=Path, default=None,
                   help="where finished full-protocol runs are kept, one JSON record each (default "
                        "profiling/results/niid_bench, and profiling/results/niid_bench_flower_split for "
                        "--partition flower): a recorded cell is read, not run again")
    p.add_argument("--rerun", action="store_true", help="run recorded cells again (and replace their records)")
    p.add_argument("--start-before", type=datetime.datetime.fromisoformat, default=None, metavar="TIME",
                   help="start no run after this local time (e.g. 2026-11-30T09:40): a grid given a session or an "
                        "allocation then ends before it with no run cut off half way")
    p.add_argument("--grid", action="store_true",
                   help="print the grid table (every setting and algorithm beside Flower's runs) from the records "
                        "alone and exit; runs nothing")
    p.add_argument("--describe", action="store_true",
                   help="print what the benchmarks page says of each recorded run of --setting, --algorithms and "
                        "--seeds (last and best, the range and largest change from round 10, the last 10 rounds' "
                        "mean, against FedAvg on the same seed) and of the cell over its recorded seeds; runs "
                        "nothing")
    p.add_argument("--plot", type=Path, default=None, metavar="FOLDER",
                   help="with --grid: also draw one figure per setting into FOLDER (niid_grid-<setting>.png): each "
                        "algorithm's accuracy per round, mean ± std over seeds, from the records' curves")
    args = p.parse_args(argv)
    args.records = args.records or (FLOWER_SPLIT_RECORDS if args.partition == "flower" else RECORDS)

    if args.describe:
        for algorithm in args.algorithms:
            for label, _ in variants(algorithm, args.mu):
                print("\n".join(describe_records(args.setting, label, args.seeds, args.records)))
        return 0
    if args.grid:
        kept = read_records(args.records)
        print(grid_table(kept, FLOWER_FMNIST))
        split = f"Flower's split of seed {FLOWER_SEED}" if args.records.resolve() == FLOWER_SPLIT_RECORDS else ""
        for figure in plot_grid(kept, args.plot, split=split) if args.plot else []:
            print(f"wrote {figure}", file=sys.stderr)
        return 0
    if args.partition == "flower" and args.setting not in FLOWER_SPLITS:
        p.error(f"--partition flower: Flower's split is written for {', '.join(FLOWER_SPLITS)} only, not "
                f"--setting {args.setting}")
    problem = dataset_problem()
    if problem:
        print(f"niid_bench: {problem}", file=sys.stderr)
        return 2
    started = datetime.datetime.now().astimezone()
    work = args.work or ROOT / "runs" / f"niid_bench-{started:%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    common = [*([f"rounds={args.rounds}"] if args.rounds else []),
              *([f"train.local_epochs={args.epochs}"] if args.epochs else []), *args.set]
    partitions: dict[int, list[str]] = {}
    for seed in args.seeds:
        if args.partition == "niid":
            path = write_partition(work / f"partition-{args.setting}-seed{seed}.json", seed, setting=args.setting)
            partitions[seed] = ["data.partition=file", f"data.partition_file={path}"]
        elif args.partition == "flower":
            path = write_partition(work / f"partition-{args.setting}-flower{FLOWER_SEED}.json", seed,
                                   setting=args.setting, flower=True)
            partitions[seed] = ["data.partition=file", f"data.partition_file={path}"]
        else:
            partitions[seed] = []

    results: dict[str, list[float]] = {}
    best: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    timings: list[tuple[str, int, dict]] = []
    not_started: list[str] = []
    # Only a run of the whole protocol on NIID-Bench's own split is kept as a record (and read back for a cell).
    full = (args.rounds in (None, PROTOCOL["rounds"]) and args.epochs in (None, PROTOCOL["train.local_epochs"])
            and args.partition in ("niid", "flower") and not args.set)
    for algorithm in args.algorithms:  # one run at a time
        for label, extra in variants(algorithm, args.mu):
            for seed in args.seeds:
                print(f"niid_bench: {label}, seed {seed}", file=sys.stderr, flush=True)
                recorded = find_record(args.setting, label, seed, args.records) if full and not args.rerun else None
                if recorded is not None:
                    results.setdefault(label, []).append(recorded.last)
                    best.setdefault(label, []).append(recorded.best)
                    print(f"  recorded: {recorded.last:.4f} after round {recorded.rounds}, finished {recorded.date} "
                          f"at {recorded.commit[:7]} (--rerun runs it again)", file=sys.stderr, flush=True)
                    continue
                if args.start_before and datetime.datetime.now(args.start_before.tzinfo) >= args.start_before:
                    not_started.append(f"{label}, seed {seed}")
                    print(f"  not started: past --start-before {args.start_before:%Y-%m-%d %H:%M}", file=sys.stderr)
                    continue
                prefix = "" if args.setting == "labeldir" else f"{args.setting}-"  # labeldir: the first layout's names
                out = run_one(args, algorithm, seed, work / f"{prefix}{run_name(label)}-seed{seed}",
                              [*partitions[seed], *common, *extra], args.setting)
                if "error" in out:
                    errors[label] = out["error"]
                    print(f"  failed: {out['error']}", file=sys.stderr)
                    continue
                results.setdefault(label, []).append(out["accuracy"])
                best.setdefault(label, []).append(out["best"])
                timings.append((label, seed, out))
                print(f"  test accuracy after round {out['round']}: {out['accuracy']:.4f} ({out['wall']:.0f} s)",
                      file=sys.stderr, flush=True)
                if out.get("diverged_round"):
                    print(f"  diverged: round {out['diverged_round']}'s update held NaN/Inf, so the run stopped "
                          f"there ({out['why']})", file=sys.stderr, flush=True)
                if full and (out["round"] == PROTOCOL["rounds"] or out.get("diverged_round")):
                    kept = write_record(record_of(args.setting, label, seed, out, args.partition), args.records)
                    print(f"  recorded in {kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept}",
                          file=sys.stderr, flush=True)

    epochs = args.epochs or int(PROTOCOL["train.local_epochs"])
    rounds = args.rounds or int(PROTOCOL["rounds"])
    setting = SETTINGS[args.setting]
    split = {"niid": f"NIID-Bench {setting.niid_partition} (file)",
             "flower": f"Flower's baseline's {args.setting} split of seed {FLOWER_SEED} (file)",
             "mpifl": f"mpifl {setting.keys.get('data.partition')}"}[args.partition]
    print(f"## NIID-Bench, Fashion-MNIST, {setting.title}: mpifl against the paper\n")
    print(f"- command: `{shlex.join([sys.executable, *sys.argv])}`")
    print(f"- date: {started:%Y-%m-%d %H:%M %Z}")
    print(f"- git commit: {git_commit()}")
    print(f"- machine: {machine()}; {args.ranks} MPI ranks (1 server + {args.ranks - 1} client ranks)")
    print(f"- runs: {rounds} rounds, {epochs} local epochs, seeds {' '.join(map(str, args.seeds))}, partition "
          f"{split}"
          f"{', overrides ' + ' '.join(args.set) if args.set else ''}; run directories in {work}")
    if (rounds, epochs) != (PROTOCOL["rounds"], PROTOCOL["train.local_epochs"]):
        print(f"- NOT the paper's protocol ({PROTOCOL['rounds']} rounds, {PROTOCOL['train.local_epochs']} local "
              "epochs): the accuracies below are not comparable with the paper's")
    print(f"- accuracy: the global model's top-1 accuracy on {setting.test_set} after the last round, and the best "
          f"over rounds; mean ± sample standard deviation over seeds\n- paper: {setting.paper_source}\n- other "
          f"reproduction: {setting.other_source}\n")
    print(format_table(results, errors, args.setting, best))
    if timings:
        print("\n| run | seed | rounds | median round (s) | training samples/s | wall, this invocation (s) | "
              "full-protocol round, estimated (s) |\n|---|---|---|---|---|---|---|")
        full_rounds = []
        for label, seed, out in timings:
            round_s = statistics.median(out["round_seconds"])
            eval_s = statistics.median(out["eval_seconds"])
            per_s = statistics.median(out["num_samples"]) * epochs / max(round_s - eval_s, 1e-9)
            full = (round_s - eval_s) * PROTOCOL["train.local_epochs"] / epochs + eval_s
            full_rounds.append(full)
            print(f"| {label} | {seed} | {out['rounds']} | {round_s:.1f} | {per_s:,.0f} | {out['wall']:.0f} | "
                  f"{full:.0f} |")
        runs = len(ALGORITHMS) - 1 + len(FEDPROX_MU_GRID)  # every algorithm, FedProx at each mu of the grid
        total = statistics.fmean(full_rounds) * PROTOCOL["rounds"] * len(SEEDS)
        print(f"\nEstimated full reproduction on this machine ({PROTOCOL['rounds']} rounds x {len(SEEDS)} seeds, "
              f"run after run): {total / 3600:.1f} h per algorithm, {total * len(ALGORITHMS) / 3600:.1f} h for the "
              f"four with one mu, {total * runs / 3600:.1f} h with FedProx's whole mu grid.")
    if not_started:
        print(f"\nNot started (past --start-before): {'; '.join(not_started)}. The same command goes on with them.")
    return 1 if errors else 0


def record_of(setting: str, label: str, seed: int, out: dict, partition: str = "niid") -> RunRecord:
    """The record of a finished run from ``run_one``'s read-out, with the commit, date, machine and command."""
    return record_from_curve(out["curve"], setting=setting, label=label, seed=seed, commit=git_commit(),
                             date=f"{datetime.date.today():%Y-%m-%d}", machine=machine(),
                             command=shlex.join(["python", "profiling/niid_bench.py", "--setting", setting,
                                                 "--algorithms", algorithm_of(label), "--seeds", str(seed),
                                                 *(["--mu", label.split("mu=")[1].rstrip(")")] if "mu=" in label
                                                   else []),
                                                 *(["--partition", partition] if partition != "niid" else [])]),
                             round_seconds=round(sum(out["round_seconds"]), 1),
                             diverged_round=out.get("diverged_round"))


if __name__ == "__main__":
    sys.exit(main())
