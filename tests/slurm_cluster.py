"""A real single-node Slurm for the tests: munged, slurmctld and slurmd from Debian's ``munge`` and ``slurm-wlm``,
started as root in a private directory, on free ports, with Slurm's default ``MpiDefault=none`` and this machine's
real CPU count, and stopped by PID.

Nothing here touches the machine's own Slurm or munge: every path (key, socket, state, spool, logs, PID files) is
under the directory given, and the daemons find the config through ``SLURM_CONF``. Where the daemons are missing or
cannot start (not root, no ``slurm-wlm``), ``why_not`` says why and the tests skip with it.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")
START_SECONDS = 60.0  # the node is idle well within this on a loaded 2-core machine (about 3 s alone)


def why_not() -> str | None:
    """Why a private Slurm cannot be started here, or None."""
    if os.geteuid() != 0:
        return "a private slurmd must run as root (it starts each job's tasks as their user)"
    missing = [name for name in DAEMONS if not _which(name)]
    if missing:
        return f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _node_line() -> str:
    """This node as slurmd sees it (``slurmd -C``): its real CPUs and memory."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    return next(line for line in out.splitlines() if line.startswith("NodeName="))


@dataclass
class SlurmCluster:
    """A running private Slurm: the environment that its clients (sbatch, squeue, ...) need, and its files."""

    root: Path
    env: dict[str, str]
    pids: dict[str, int]
    cpus: int

    def run(self, *command: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(command), capture_output=True, text=True, env=self.env, timeout=timeout, cwd=cwd)

    def submit(self, script: Path, *args: str, cwd: Path, export: str = "ALL", options: tuple[str, ...] = ()) -> int:
        """``sbatch --parsable [options] script args`` from ``cwd`` (its SLURM_SUBMIT_DIR); its job id."""
        out = self.run("sbatch", "--parsable", f"--export={export}", *options, str(script), *args, cwd=cwd)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    @contextmanager
    def environment(self) -> Iterator[None]:
        """This process's environment pointed at the cluster (``SLURM_CONF``), for what runs in it: ``mpifl slurm``
        asking ``sinfo``."""
        before = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.env["SLURM_CONF"]
        try:
            yield
        finally:
            if before is None:
                del os.environ["SLURM_CONF"]
            else:
                os.environ["SLURM_CONF"] = before

    def state(self, job: int) -> str:
        """The job's state as ``scontrol show job`` says it (``COMPLETED``, ``FAILED``, ``PENDING``...)."""
        out = self.run("scontrol", "show", "job", str(job)).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.removeprefix("JobState=")
        return "GONE"

    def wait(self, job: int, timeout: float, until: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED",
                                                                         "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                                                         "GONE")) -> str:
        """Poll until the job reaches one of ``until``; its state (raises past ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in until:
                return state
            time.sleep(0.5)
        self.run("scancel", str(job))
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:g} s; slurmd log:\n"
                           + self.log("slurmd")[-3000:])

    def cancel_all(self, seconds: float = 20.0) -> None:
        """Cancel every job and wait until none is left (at most ``seconds``)."""
        jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        if jobs:
            self.run("scancel", *jobs)
        deadline = time.monotonic() + seconds
        while jobs and time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i").stdout.split():
            time.sleep(0.2)

    def log(self, daemon: str) -> str:
        """A daemon's log so far."""
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _write_config(root: Path, munge_socket: Path, ports: list[int], node: str) -> Path:
    """slurm.conf. Job ids start at a random number: MPICH names its shared-memory segment after the PMI's key
    space, which srun derives from the job and step ids, so a cancelled job's stale /dev/shm segment would hang
    MPI_Init in a later cluster's job of the same id."""
    host = socket.gethostname().split(".")[0]
    first_job = random.randrange(1000, 50_000_000)
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=mpifltest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
MinJobAge=600
FirstJobId={first_job}
{node.replace("NodeName=" + node.split()[0].split("=")[1], "NodeName=" + host, 1)} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


@contextmanager
def single_node_slurm(root: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd under ``root``; stop them by PID on the way out."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # munged refuses a key or socket directory others may write
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(exist_ok=True)
        (root / sub).chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = root / "munge" / "munge.socket"
    node = _node_line()
    conf = _write_config(root, munge_socket, _free_ports(2), node)
    env = dict(os.environ, SLURM_CONF=str(conf))
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_")) and v != "SLURM_CONF"]:
        del env[var]  # the tests may themselves run inside a Slurm job
    pids: dict[str, int] = {}
    cluster = SlurmCluster(root, env, pids, int(node.split("CPUs=")[1].split()[0]))
    try:
        pids["munged"] = _start([_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={munge_socket}",
                                 f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                                 f"--seed-file={root / 'munge' / 'munged.seed'}"], env, root / "munged.out")
        _wait_for(lambda: munge_socket.exists(), "munged's socket", cluster)
        pids["slurmctld"] = _start([_which("slurmctld"), "-D", "-i"], env, root / "slurmctld.out")
        pids["slurmd"] = _start([_which("slurmd"), "-D"], env, root / "slurmd.out")
        _wait_for(lambda: cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() in ("idle", "mix", "alloc"),
                  "an idle node in sinfo", cluster)
        yield cluster
    finally:
        if "slurmd" in pids:
            cluster.cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            _stop(pids.get(name))
        _kill_strays(str(conf))


def _start(command: list[str | None], env: dict[str, str], out: Path) -> int:
    with out.open("w") as sink:
        return subprocess.Popen([str(c) for c in command], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True).pid


def _wait_for(ready, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if ready():
            return
        for name, pid in cluster.pids.items():
            if _exited(pid):
                raise RuntimeError(f"{name} exited while waiting for {what}: "
                                   + (cluster.root / f"{name}.out").read_text()[-2000:] + cluster.log(name)[-2000:])
        time.sleep(0.2)
    raise RuntimeError(f"no {what} after {START_SECONDS:g} s; slurmctld log:\n{cluster.log('slurmctld')[-2000:]}"
                       f"\nslurmd log:\n{cluster.log('slurmd')[-2000:]}")


def _kill_strays(conf: str) -> None:
    """SIGKILL whatever this cluster started and left behind (a job step's slurmstepd and its tasks outlive slurmd,
    in sessions of their own): every process whose environment names this cluster's slurm.conf."""
    marker = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _stop(pid: int | None) -> None:
    """SIGTERM the daemon's process group, SIGKILL after 10 s."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _exited(pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
