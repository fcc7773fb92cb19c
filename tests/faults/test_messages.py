"""What a user reads when nothing is wrong with the run: no traceback for a reader that leaves, no third-party noise."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from mpifl.storage.hdf5 import CheckpointWriter
from mpifl.wire.flat import FlatModel


@pytest.mark.parametrize("layers", [1, 2000], ids=["output flushed at exit", "output past the pipe's buffer"])
def test_inspect_into_a_reader_that_leaves_early_exits_0_without_a_traceback(tmp_path, layers):
    flat = FlatModel(torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(layers)]))
    with CheckpointWriter(tmp_path / "c.h5", flat.spec, {"round": 1}) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_metrics([])
        checkpoint = writer.publish()
    # `mpifl inspect CKPT | head -1`, as users type it: head leaves after its line and the pipe closes
    result = subprocess.run(f"'{sys.executable}' -m mpifl inspect '{checkpoint}' | head -1; exit ${{PIPESTATUS[0]}}",
                            shell=True, executable="/bin/bash", capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{checkpoint}: round 1") and result.stdout.count("\n") == 1
    assert result.stderr == ""


def test_dp_accountings_convergence_warnings_are_said_once_in_mpifls_words():
    pytest.importorskip("dp_accounting")
    # z = 0.3 with Poisson sampling at q = 0.1: the RDP series fails to converge at some orders, which
    # dp-accounting logs through absl several times per epsilon (it used to be 8 WARNING lines per round)
    script = ("from mpifl.config import PrivacyConfig\n"
              "from mpifl.privacy.accounting import epsilon\n"
              "cfg = PrivacyConfig(mode='central', sampling='poisson', noise_multiplier=0.3, accountant='rdp')\n"
              "for rounds in (10, 100, 1000):\n"
              "    print(epsilon(cfg, rounds, 1000, 100))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    epsilons = [float(line) for line in result.stdout.split()]
    assert len(epsilons) == 3 and epsilons == sorted(epsilons) and epsilons[0] > 0
    assert "absl" not in result.stderr and "_compute_log_a_frac" not in result.stderr
    assert result.stderr.count("did not converge at some orders (its own warning, shown once)") == 1
