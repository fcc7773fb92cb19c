"""The commands that only read start without torch: every ``mpifl`` command builds the whole parser, and a job
script's epilogue (``mpifl status``), a login node's ``inspect``, ``report`` or ``--help`` should not pay torch's
~2 CPU-seconds for it. The model's layout they read is ``mpifl.wire.spec``, torch-free; ``mpifl.wire.flat``
builds buffers from a torch module."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import nn

from mpifl.storage.hdf5 import CheckpointWriter
from mpifl.wire.flat import FlatModel


def imported_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which of torch, h5py and mpi4py it imported, and what it printed."""
    probe = ("import io, contextlib, json, sys\nout = io.StringIO()\nwith contextlib.redirect_stdout(out):\n"
             + "".join(f"    {line}\n" for line in code.splitlines())
             + "print(json.dumps({'out': out.getvalue(), 'modules': sorted({m.split('.')[0] for m in sys.modules} "
               "& {'torch', 'h5py', 'mpi4py'})}))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_parser_and_the_report_import_neither_torch_h5py_nor_mpi4py():
    seen = imported_after("from mpifl.cli import _parser\nimport mpifl.cli.report\n"
                          "args = _parser().parse_args(['pbs', 'c.yaml', '--nodes', '2'])\n"
                          "assert args.nodes == 2 and args.func.__name__ == 'pbs'")
    assert seen["modules"] == []


def test_status_and_inspect_read_a_run_without_importing_torch(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("rounds: 2\n")
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1}) + "\n")
    flat = FlatModel(nn.Linear(3, 2).to(torch.bfloat16))
    with CheckpointWriter(run / "checkpoints" / "ckpt-r000001.h5", flat.spec, {"round": 1, "config": "rounds: 2\n"}) \
            as writer:
        writer.write_tensors(flat.tensors())
        ckpt = writer.publish()
    seen = imported_after(f"from mpifl.cli import main\nprint(main(['status', {str(run)!r}]))\n"
                          f"print(main(['inspect', {str(ckpt)!r}, '--verify']))")
    assert seen["modules"] == ["h5py"], seen
    assert "1 of 2 rounds recorded; newest checkpoint ckpt-r000001.h5" in seen["out"]
    assert "bfloat16" in seen["out"] and seen["out"].splitlines()[-1] == "0"  # inspect's exit status


def test_mpifl_run_starts_mpi_only_in_the_rank_its_supervisor_forks():
    """``mpifl run`` imports its command's modules before its supervisor forks the rank (mpifl.cli.supervisor); had
    one of them imported mpi4py, MPI would have started in the supervisor, and the forked rank's ``MPI_Finalize``
    hung in UCX's clean-up (PyPI's MPICH, three times out of three, 2026-12-03)."""
    seen = imported_after("import mpifl.cli.commands, mpifl.cli.supervisor, mpifl.roles.launch")
    assert seen["modules"] == []
