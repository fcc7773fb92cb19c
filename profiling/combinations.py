"""A black-box sweep of feature combinations: does each run give the same bits on any number of ranks, and does
a run stopped and resumed on another number of ranks end where an uninterrupted one does?

Each case is a set of config overrides on a small task (UCI digits, 12 clients, 5 a round, 4 rounds, an MLP or
a small CNN with BatchNorm). It runs through ``mpiexec`` as a user would: on 2 and on 4 client ranks, and once
stopped after round 2 on 2 client ranks and resumed on 3 (on 4, two groups of two, with
clients.ranks_per_client=2). The three final models (``model.h5``: every tensor) and the clients' kept vectors
(the last checkpoint's per-rank files) must be equal to the bit. A combination the config checks refuse prints
the refusal (it must name a key); one run that fails prints its error. From the repository root (about 23
minutes on 2 cores for every case):

    python profiling/combinations.py                     # every case
    python profiling/combinations.py scaffold_fedbn ditto_on_disk --chunk-bytes 7

Exit status 1 when a case that should be rank-count independent is not, or a run fails outright.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mpifl.storage.comparison import Result
from mpifl.storage.comparison import digest as result_digest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

BASE = ["seed=3", "rounds=4", "clients.num_clients=12", "clients.per_round=5", "data.dataset=digits",
        "data.partition=dirichlet", "data.alpha=0.5", "model.name=mlp", "model.kwargs={hidden: [32]}", "train.lr=0.05",
        "train.local_epochs=1", "train.batch_size=16", "eval.every=2", "transport.floor_probe_mb=0",
        "output.progress=false"]
BN = ["model.name=combinations:bn_net", "model.kwargs={width: 8}"]  # BatchNorm layers, for FedBN
SCAFFOLD = ["strategy.name=scaffold", "strategy.update=delta", "clients.placement=balanced"]
FEDDYN = ["strategy.name=feddyn", "strategy.update=delta", "strategy.weighting=equal", "strategy.alpha=0.05"]
FEDNOVA = ["strategy.name=fednova", "strategy.update=delta"]
FEDERATED_EVAL = ["data.val_fraction=0.2", "eval.federated_every=2"]
OUT_OF_CORE = ["server.state=disk", "eval.every=0", "clients.per_round=2"]

# name: overrides; each must give the same bits on any number of ranks (or, named refused_*, be refused)
CASES: dict[str, list[str]] = {
    "fedavg_groups_by_cost": ["clients.groups=4", "clients.placement=per_round", "clients.group_by=cost"],
    "fedavgm_local_steps": ["strategy.name=fedavgm", "train.local_steps=3", "clients.groups=4",
                            "clients.placement=balanced"],
    "fedadam_fedper": ["strategy.name=fedadam", "model.local=['1.*']", "clients.groups=4"],
    "fedyogi_delta_bf16": ["strategy.name=fedyogi", "strategy.update=delta", "strategy.wire_dtype=bfloat16"],
    "trimmed_mean_bf16": ["strategy.name=trimmed_mean", "strategy.trim_fraction=0.2",
                          "strategy.wire_dtype=bfloat16"],
    "fednova_momentum_groups": [*FEDNOVA, "train.momentum=0.5", "train.local_epochs=2", "clients.groups=4"],
    "fednova_fedbn_feature_noise": [*BN, *FEDNOVA, "model.local=['*bn*']", "data.feature_noise=0.5"],
    "scaffold_groups_momentum": [*SCAFFOLD, "clients.groups=4", "train.momentum=0.9"],
    "scaffold_on_disk": [*SCAFFOLD, "strategy.control_ram_mb=0", "strategy.server_lr=0.7"],
    "scaffold_fedprox": [*SCAFFOLD, "train.prox_mu=0.01"],
    "scaffold_fedbn": [*BN, *SCAFFOLD, "model.local=['*bn*']", "clients.groups=4", "train.momentum=0.9"],
    "scaffold_fedper_virtual_time": [*SCAFFOLD, "model.local=['3.*']", "clock.mode=sync",
                                     "clients.accept_failures=true"],
    "feddyn_groups": [*FEDDYN, "clients.groups=4"],
    "feddyn_fedper_on_disk": [*FEDDYN, "model.local=['3.*']", "strategy.control_ram_mb=0", "model.local_ram_mb=0",
                              *FEDERATED_EVAL],
    "feddyn_bn_adam": [*BN, *FEDDYN, "train.optimizer=adam", "train.lr=0.01"],
    "fedbn_groups": [*BN, "model.local=['*bn*']", "clients.groups=4", "train.momentum=0.9"],
    "ditto_on_disk": ["train.ditto_lambda=0.3", "train.personal_ram_mb=0", "clients.placement=balanced",
                      *FEDERATED_EVAL],
    "topk_error_feedback_fedbn": [*BN, "compression.method=topk", "strategy.update=delta",
                                  "model.local=['*bn*']"],
    "int8_group_sums": ["compression.method=int8", "clients.groups=4", "strategy.update=delta"],
    "topk_error_feedback": ["compression.method=topk", "strategy.update=delta"],
    "dp_central": ["privacy.mode=central", "strategy.update=delta", "strategy.weighting=equal"],
    "secure_aggregation": ["secagg.enabled=true", "strategy.update=delta"],
    "fedbuff": ["clock.mode=fedbuff", "clock.concurrency=6", "strategy.update=delta"],
    "fedcompass": ["clock.mode=fedcompass", "strategy.update=delta"],
    "dispatch_tree": ["transport.dispatch_fanout=2", "clients.groups=4"],
    # several groups per rank on 2 client ranks, one on 4: the chain visits the groups in id order either way
    "chain_several_groups_per_rank": ["transport.reduce=chain", "clients.groups=4", "strategy.update=delta"],
    # 5 groups placed by their work: runs of consecutive groups on a rank, on 2 client ranks and on 4
    "chain_feddyn_balanced_groups": [*FEDDYN, "clients.groups=5", "clients.placement=balanced",
                                     "transport.reduce=chain"],
    "chain_scaffold_fedbn_per_round_cost_groups": [*BN, *SCAFFOLD, "clients.placement=per_round",
                                                   "model.local=['*bn*']", "clients.groups=4",
                                                   "clients.group_by=cost", "transport.reduce=chain"],
    "ranks_per_client_scaffold_fedbn": [*BN, *SCAFFOLD, "clients.ranks_per_client=2", "model.local=['*bn*']"],
    "ranks_per_client_feddyn_fedbn": [*BN, *FEDDYN, "clients.ranks_per_client=2", "model.local=['*bn*']"],
    "ranks_per_client_ditto": ["clients.ranks_per_client=2", "train.ditto_lambda=0.2",
                               "clients.placement=balanced"],
    "ranks_per_client_fednova_noise": [*FEDNOVA, "clients.ranks_per_client=2", "data.feature_noise=0.4"],
    # per-client state on a device replica: the GPU path's copies, run on the CPU (train.device_copy)
    "scaffold_fedbn_device_replica": [*BN, *SCAFFOLD, "model.local=['*bn*']", "clients.groups=4",
                                      "train.device_copy=true"],
    "ditto_device_replica": ["train.ditto_lambda=0.3", "train.device_copy=true", *FEDERATED_EVAL],
    "ranks_per_client_feddyn_fedper_device_replica": [*FEDDYN, "clients.ranks_per_client=2", "model.local=['3.*']",
                                                      "train.device_copy=true"],
    # per-round placement: each client's state lent by its home rank to the rank that trains it (roles.lending)
    "scaffold_fedbn_per_round_cost_groups": [*BN, *SCAFFOLD, "clients.placement=per_round", "model.local=['*bn*']",
                                             "clients.groups=4", "clients.group_by=cost"],
    "ditto_per_round_on_disk": ["train.ditto_lambda=0.3", "train.personal_ram_mb=0", "clients.placement=per_round",
                                *FEDERATED_EVAL],
    "topk_error_feedback_per_round": ["compression.method=topk", "strategy.update=delta",
                                      "clients.placement=per_round"],
    # Ditto over a global rule with per-client state of its own: both in each client's one vector
    "ditto_scaffold_bn_groups": [*BN, *SCAFFOLD, "train.ditto_lambda=0.3", "clients.groups=4", *FEDERATED_EVAL],
    "ditto_feddyn_on_disk_per_round": [*FEDDYN, "train.ditto_lambda=0.3", "strategy.control_ram_mb=0",
                                       "train.personal_ram_mb=0", "clients.placement=per_round"],
    "ditto_topk_error_feedback": ["compression.method=topk", "train.ditto_lambda=0.3"],
    "ranks_per_client_ditto_scaffold": [*SCAFFOLD, "clients.ranks_per_client=2", "train.ditto_lambda=0.2",
                                        "clients.placement=balanced"],
    # Ditto beside model.local: the client's local tensors, then its personal model with local tensors of its own
    "ditto_fedper_on_disk_per_round": ["train.ditto_lambda=0.3", "model.local=['3.*']", "model.local_ram_mb=0",
                                       "train.personal_ram_mb=0", "clients.placement=per_round", *FEDERATED_EVAL],
    "ditto_fedbn_groups": [*BN, "train.ditto_lambda=0.3", "model.local=['*bn*']", "clients.groups=4"],
    # the out-of-core server (one participant per client rank, so 2 a round) beside per-client state
    "scaffold_fedbn_out_of_core": [*BN, *SCAFFOLD, "model.local=['*bn*']", *OUT_OF_CORE],
    "ditto_feddyn_out_of_core": [*FEDDYN, "train.ditto_lambda=0.3", *OUT_OF_CORE, *FEDERATED_EVAL],
    # the chain hands the out-of-core server one stream: 4 groups on 2 client ranks and on 4, resumed on 3
    "chain_out_of_core_scaffold_groups": [*SCAFFOLD, "server.state=disk", "eval.every=0", "clients.groups=4",
                                          "transport.reduce=chain"],
    # privacy beyond DP-FedAvg's fixed clip, and virtual time's sampling beside SCAFFOLD
    "local_dp_fedper": ["privacy.mode=local", "strategy.update=delta", "model.local=['3.*']"],
    "dp_adaptive_clip": ["privacy.mode=central", "privacy.adaptive_clip=true", "privacy.count_noise=1.0",
                         "strategy.update=delta", "strategy.weighting=equal"],
    "scaffold_over_selection_diurnal": [*SCAFFOLD, "clock.mode=sync", "clock.over_selection=0.5",
                                        "clock.deadline=50", "clock.availability=diurnal"],
    "fedasync": ["clock.mode=fedasync", "clock.concurrency=4"],
    # refused, each naming a key
    "refused_ditto_fedper_scaffold": [*SCAFFOLD, "train.ditto_lambda=0.1", "model.local=['3.*']"],
    "refused_median_groups": ["strategy.name=median", "clients.groups=4"],
}


def bn_net(input_shape, num_classes, width: int = 16):
    """A small CNN with BatchNorm after its convolution and its dense layer (for FedBN's ``*bn*`` patterns)."""
    from torch import nn

    class Net(nn.Module):
        """conv -> BatchNorm -> ReLU -> dense -> BatchNorm -> ReLU -> head."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(input_shape[0], width, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(width)
            self.fc = nn.Linear(width * input_shape[1] * input_shape[2], 32)
            self.bn2 = nn.BatchNorm1d(32)
            self.head = nn.Linear(32, num_classes)

        def forward(self, x):
            """Logits of a batch of images."""
            x = self.bn1(self.conv(x)).relu().flatten(1)
            return self.head(self.bn2(self.fc(x)).relu())

    return Net()


def digest(run_dir: Path) -> str:
    """SHA-256 of every tensor of the final model, then of every kept per-client vector of the last checkpoint:
    ``mpifl diff``'s and ``mpifl inspect``'s digest of the run directory."""
    return result_digest(Result.at(run_dir))


def run(bin_dir: Path, ranks: int, run_dir: Path, overrides: list[str], resume: bool = False,
        timeout: int = 300) -> subprocess.CompletedProcess:
    """One ``mpiexec`` run of the base task with ``overrides``, under a timeout (exit 124 past it)."""
    cmd = [str(bin_dir / "mpiexec"), "-n", str(ranks), str(bin_dir / "mpifl"), "run",
           str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), *(["--resume"] if resume else []),
           *BASE, *overrides]
    env = {**__import__("os").environ, "PYTHONPATH": str(HERE)}  # the bn_net plug-in, on every rank
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout} s: {err}")


def last_line(result: subprocess.CompletedProcess) -> str:
    """The line that says why a run ended (a config error or the failing rank's), without the launcher's noise."""
    lines = [line for line in result.stderr.splitlines() if "mpifl" in line and ("error" in line or "fail" in line)]
    return (lines or result.stderr.strip().splitlines()[-1:] or ["(no output)"])[-1].strip()


def sweep(names: list[str], bin_dir: Path, work: Path, chunk_bytes: int | None) -> int:
    """Run the cases; print one line each; the number of cases that are not what they should be."""
    extra = [f"transport.chunk_mb={chunk_bytes / 2**20:.10f}"] if chunk_bytes else []
    bad = 0
    for name in names:
        overrides = [*CASES[name], *extra]
        base = work / name
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        digests, failure = {}, None
        for client_ranks in (2, 4):
            result = run(bin_dir, client_ranks + 1, base / f"ranks{client_ranks}", overrides)
            if result.returncode:
                failure = (result.returncode, last_line(result))
                break
            digests[f"{client_ranks} ranks"] = digest(base / f"ranks{client_ranks}")
        if failure is None:
            later = 5 if "clients.ranks_per_client=2" in overrides else 4  # 2 groups of 2 ranks, or 3 client ranks
            first = run(bin_dir, 3, base / "resumed", [*overrides, "rounds=2"])
            rest = run(bin_dir, later, base / "resumed", overrides, resume=True) if first.returncode == 0 else first
            if rest.returncode:
                failure = (rest.returncode, last_line(rest))
            else:
                digests[f"resumed 2 -> {later - 1}"] = digest(base / "resumed")
        if failure is not None:
            refused = failure[0] == 2 and "config error" in failure[1] or "clients.groups=" in failure[1]
            bad += not (refused and name.startswith("refused_"))
            print(f"{name}: {'refused' if refused else 'FAILED'} (exit {failure[0]}): {failure[1]}", flush=True)
            continue
        same = len(set(digests.values())) == 1
        bad += not same or name.startswith("refused_")
        print(f"{name}: {'same bits' if same else 'DIFFERS'} {digests}", flush=True)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all {len(CASES)})")
    parser.add_argument("--chunk-bytes", type=int, help="transport.chunk_mb in bytes (e.g. 7); default: 16 MiB")
    parser.add_argument("--bin", type=Path, default=ROOT / ".venv" / "bin", help="where mpiexec and mpifl are")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        bad = sweep(args.cases or list(CASES), args.bin, args.work or Path(tmp), args.chunk_bytes)
    print(f"{bad} case(s) not as they should be" if bad else "every case as it should be")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
