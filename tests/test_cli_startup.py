"""The command line starts without importing torch: every ``mpifl`` command builds the whole parser, and a job
script's epilogue, a login node's ``mpifl report`` or ``--help`` should not pay torch's ~2 CPU-seconds for it."""
from __future__ import annotations

import subprocess
import sys


def test_the_parser_and_the_report_import_no_torch():
    probe = ("import sys\n"
             "from mpifl.cli import _parser\n"
             "import mpifl.cli.report\n"
             "args = _parser().parse_args(['pbs', 'c.yaml', '--nodes', '2'])\n"
             "assert args.nodes == 2 and args.func.__name__ == 'pbs'\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'h5py', 'mpi4py')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
