"""``mpifl.wire.transport.arrive_together``, the barrier a rank waits in at start-up while the others still import
torch or read the data: it returns only once every rank has arrived, and the wait sleeps, so that early ranks leave
the cores to the late ones. MPICH's blocking ``MPI_Barrier`` in its place polls a core: 1.23 and 1.34 CPU-s of the
2 s wait against 0.04 (2026-12-03, PyPI's MPICH, a 2-core machine busy with a test suite)."""
from __future__ import annotations

import re
import subprocess
import sys

from arrival_ranks import LATE
from conftest import TESTS, mpiexec, rank_environment


def test_early_ranks_wait_for_the_last_one_asleep():
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(TESTS / "arrival_ranks.py")],
                          capture_output=True, text=True, timeout=120, env=rank_environment())
    assert done.returncode == 0, done.stderr
    waits = [tuple(map(float, m)) for m in re.findall(r"waited ([\d.]+) s using ([\d.]+) CPU-s", done.stdout)]
    assert len(waits) == 2, done.stdout
    for seconds, cpu in waits:
        assert seconds >= LATE * 0.9  # it waited for the late rank
        assert cpu < 0.25 * LATE, done.stdout  # and slept through most of it
