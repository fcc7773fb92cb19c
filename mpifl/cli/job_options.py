"""The options of ``mpifl plan``, ``mpifl pbs`` and ``mpifl slurm``, apart from the planning code behind them.

Why a module of its own: every ``mpifl`` command builds the whole argument parser, and the planning modules
import torch (a model's layout, its codecs) at about 2 CPU-seconds. Kept here, the parser imports nothing heavy,
so ``mpifl status`` in a job's epilogue, ``inspect``, ``report`` and ``--help`` start in a fraction of a second
on a login node; the commands themselves import their code when they run (``mpifl.cli.commands``).
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from mpifl.cli.parsing import add_subcommand

CLIENT_RANKS_HELP = "client ranks (default: one per client sampled in a round, or per group with clients.groups)"


SLURM_MEMORY_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}  # sbatch --mem's suffixes, in MB


def slurm_megabytes(text: str) -> float | None:
    """An ``sbatch --mem`` size in MB (MiB: Slurm counts in binary units): a number, in MB unless it ends in K,
    M, G or T; None for anything else."""
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "M")
    if unit not in SLURM_MEMORY_UNITS:
        return None
    try:
        value = float(number)
    except ValueError:
        return None
    return value * SLURM_MEMORY_UNITS[unit] if 0 <= value < float("inf") else None


def positive_int(text: str) -> int:
    """An option's argument type: a whole number above 0 (a count of nodes, ranks or cores), else argparse's error."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above 0")
    return value


def non_negative_int(text: str) -> int:
    """An option's argument type: a whole number, 0 or more (0: none), else argparse's error."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return value


def _whole_number(text: str) -> int:
    """``text`` as an int, else argparse's error."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def slurm_seconds(text: str) -> int | None:
    """A Slurm time limit in seconds: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds (sbatch's formats; 0: no limit), minutes after hours and
    seconds below 60; None for anything else."""
    match = SLURM_TIME.fullmatch(text)
    if match is None:
        return None
    days, *clock = match.groups()
    parts = [int(p) for p in clock if p is not None]
    if days is not None:  # days-hours[:minutes[:seconds]]
        units: tuple[int, ...] = (3600, 60, 1)
    else:  # minutes[:seconds], hours:minutes:seconds
        units = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]
    if any(p >= 60 for p in parts[1:]):  # the fields after the first: minutes after hours, and seconds
        return None
    return int(days or 0) * 86400 + sum(p * u for p, u in zip(parts, units))


def slurm_time(text: str) -> str:
    """``--time``'s argument type: ``text`` as given when Slurm would take it (0 included: Slurm's "no limit"),
    else argparse's error (which names the option)."""
    seconds = slurm_seconds(text)
    if seconds is None:
        within = " (minutes after hours, and seconds, below 60)" if SLURM_TIME.fullmatch(text) else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a Slurm time limit{within}: minutes, minutes:seconds, "
                                         "hours:minutes:seconds, days-hours, days-hours:minutes or "
                                         "days-hours:minutes:seconds, e.g. 01:00:00 or 2-00")
    return text


def slurm_memory(text: str) -> str:
    """``--mem``'s argument type: ``text`` as given when Slurm would take it, else argparse's error."""
    if text and (slurm_megabytes(text) is None or text != "".join(text.split())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Slurm memory size (e.g. 0, 200G, 190000)")
    return text


# What a job script may hold of a word it pastes into shell code: no space, quote, $, `, ;, {, } or glob
SHELL_WORD = re.compile(r"[A-Za-z0-9_./+@%,=-]+")


def shell_word(what: str) -> Callable[[str], str]:
    """An argument type for an option whose value a job script runs as part of its shell code (a venv's path, a
    module, srun's --mpi plugin): ``text`` as given when it holds only letters, digits and ``_ . / + @ % , = -``,
    else argparse's error, naming ``what`` it is; '' passes (the option's 'none')."""
    def parse(text: str) -> str:
        if text and not SHELL_WORD.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}: the script would run it as shell code; use "
                                             "letters, digits and _ . / + @ % , = - only")
        return text
    return parse


def positive_gib(text: str) -> float:
    """A memory size in GiB for the checks: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a memory size must be above 0 GiB")
    return value


def pbs_seconds(text: str) -> int | None:
    """A PBS walltime in seconds: seconds, minutes:seconds or hours:minutes:seconds (qsub's ``[[HH:]MM:]SS``), the
    fields after the first below 60; None for anything else."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        return None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or any(p >= 60 for p in parts[1:]):
        return None
    return sum(p * u for p, u in zip(reversed(parts), (1, 60, 3600)))


def pbs_walltime(text: str) -> str:
    """``--walltime``'s argument type: ``text`` as given when PBS would take it and it leaves the job time to run,
    else argparse's error (which names the option)."""
    seconds = pbs_seconds(text)
    if seconds is None:
        within = " (minutes and seconds below 60)" if re.fullmatch(r"\d+(:\d+){1,2}", text) else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a PBS walltime{within}: HH:MM:SS, e.g. 01:00:00")
    if seconds == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is a zero walltime: PBS would end the job as it starts; give "
                                         "one above 0 as HH:MM:SS, e.g. 01:00:00")
    return text


# A queue, partition or account name as written into the job script: letters, digits and these marks (a PBS
# destination may be queue@server). Nothing else: the name is written raw into a #PBS or #SBATCH line, which qsub
# and sbatch split at whitespace ('-A A B' charges A and passes B on), and the script is bash.
SCHEDULER_NAME = re.compile(r"[A-Za-z0-9_.@:+-]+")


def scheduler_name(text: str) -> str:
    """``--queue``'s and ``--account``'s argument type: a name that a directive line carries as one word (see
    ``SCHEDULER_NAME``), else argparse's error naming the first character refused."""
    return _one_word(text, SCHEDULER_NAME, "_.@:+-", "letters, digits and _ . - @ : + only", "a name")


def _one_word(text: str, pattern: re.Pattern[str], marks: str, allowed: str, what: str) -> str:
    """``text`` when ``pattern`` takes it whole, else argparse's error naming the first character that is neither
    an ASCII letter or digit nor one of ``marks``, and what is ``allowed``."""
    if not pattern.fullmatch(text):
        bad = next((c for c in text if not (c.isascii() and c.isalnum()) and c not in marks), None)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {what} a job script can carry" + (f" ({bad!r} in it)" if bad else
                                                                 " (empty)" if not text else "") + f": {allowed}")
    return text


# A PBS system name, written into '#PBS -l select=N:system=NAME': a ':' would start another resource there.
SYSTEM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# PBS Pro's filesystems resource: names joined by ':' ('home:eagle').
FILESYSTEMS = re.compile(r"[A-Za-z0-9_.-]+(?::[A-Za-z0-9_.-]+)*")
# A log path in '#SBATCH --output=PATH': no whitespace (sbatch splits the line there) nor shell marks, which no
# shell expands in a directive; Slurm's filename patterns (%x, %j, ...) and folders are fine.
LOG_PATH = re.compile(r"[A-Za-z0-9_.%/@+=,:-]+")


def system_name(text: str) -> str:
    """``mpifl pbs --system``'s argument type: one name (letters, digits and _ . -), else argparse's error."""
    return _one_word(text, SYSTEM_NAME, "_.-", "letters, digits and _ . - only", "a system name")


def filesystems(text: str) -> str:
    """``mpifl pbs --filesystems``'s argument type: names joined by ':', e.g. home:eagle, else argparse's
    error."""
    return _one_word(text, FILESYSTEMS, "_.-:", "names of letters, digits and _ . -, joined by ':' (e.g. home:eagle)",
                     "a filesystems list")


def log_path(text: str) -> str:
    """``mpifl slurm --log``'s argument type: a path with Slurm's patterns, in one word, else argparse's error."""
    return _one_word(text, LOG_PATH, "_.%/@+=,:-", "letters, digits, Slurm's % patterns and _ . / @ + = , : - only",
                     "a log path")


def optional_scheduler_name(text: str) -> str:
    """``scheduler_name``, or '' (``mpifl slurm`` then writes no line for it)."""
    return text if text == "" else scheduler_name(text)


def add_stop_before(p: argparse.ArgumentParser, limit: str, how: str) -> None:
    """--stop-before: when, before the time limit, every rank gets SIGTERM (both schedulers' scripts)."""
    p.add_argument("--stop-before", type=non_negative_int, metavar="SECONDS",
                   help=f"every rank gets SIGTERM this long before {limit} ({how}), so that the server finishes "
                   "its round and checkpoints before the scheduler's SIGKILL; default: a tenth of the limit, at "
                   "most 300; 0: none; it must be shorter than the limit")


def add_job_arguments(p: argparse.ArgumentParser, suffix: str) -> None:
    """The config, its overrides, the script path, and the rank and node counts."""
    p.add_argument("config", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=50")
    p.add_argument("--output", "-o", help=f"script path (default: <name>{suffix})")
    p.add_argument("--nodes", type=positive_int, help="nodes to ask for: exactly those the ranks fill at "
                   "--ranks-per-node (default: that count; another is refused, naming it)")
    p.add_argument("--ranks-per-node", type=positive_int, default=4, help="ranks per node (Polaris: 4, one per GPU)")
    p.add_argument("--client-ranks", type=positive_int, help=CLIENT_RANKS_HELP)
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="an axis of a sweep (repeat for more; NAME=@FILE: a variants file, as mpifl sweep takes "
                   "them): the job runs mpifl sweep over the grid, one run after another, instead of mpifl run; "
                   "planned for the grid point that needs the most memory")
    p.add_argument("--runs-dir", type=shell_word("a folder's path"),
                   help="with --grid: the folder of the sweep's runs (default: runs/<name>-sweep)")


def add_gpu_argument(p: argparse.ArgumentParser) -> None:
    """--gpus-per-node, and the memory of each for the check."""
    p.add_argument("--gpus-per-node", type=non_negative_int, default=4, help="GPUs per node: each rank sees one, "
                   "from its node-local rank (0: CPU only)")
    p.add_argument("--gpu-memory-gb", type=positive_gib, default=40.0, help="memory per GPU (GiB) for the check "
                   "(Polaris: A100 40 GB)")


def add_node_arguments(p: argparse.ArgumentParser, venv_help: str) -> None:
    """The memory per node for the check, and the venv to activate."""
    p.add_argument("--node-memory-gb", type=positive_gib, default=512.0, help="memory per node (GiB) for the check")
    p.add_argument("--venv", type=shell_word("a venv's path"), help=venv_help)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """The ``plan`` subcommand's options."""
    p = add_subcommand(sub, "plan", help="dry run: bytes and expected memory per rank for a config, nothing allocated")
    p.add_argument("config", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. clients.per_round=8")
    p.add_argument("--client-ranks", type=positive_int, help=CLIENT_RANKS_HELP)
    p.add_argument("--ranks-per-node", type=positive_int, default=4, help="ranks per node (Polaris: 4, one per GPU)")
    p.add_argument("--server-alone", action="store_true", help="the server has a node to itself")
    p.add_argument("--cores-per-node", type=positive_int, default=None, help="cores per node, for the binding of each "
                   "local rank (default: this machine's, os.cpu_count())")
    p.add_argument("--gpus-per-node", type=non_negative_int, default=None, help="GPUs per node, for the binding of "
                   "each local rank and, with train.device auto, whether client ranks train on GPUs (default: this "
                   "machine's: CUDA_VISIBLE_DEVICES, MPIFL_GPUS_PER_NODE or the NVIDIA driver's count)")
    p.add_argument("--node-memory-gb", type=positive_gib, default=None, help="memory per node (GiB): warn when the "
                   "fullest node would pass 90%% of it")
    p.add_argument("--gpu-memory-gb", type=positive_gib, default=None, help="memory per GPU (GiB): warn when a client "
                   "rank's GPU would pass 90%% of it (activations counted where the plan estimates them)")
    p.add_argument("--time", action="store_true", help="also predict the round time (mpifl.planning.scale's model)")
    p.add_argument("--rates", default="polaris", help="for --time: 'polaris', 'lustre', or a JSON file of "
                   "mpifl.planning.scale.Rates fields (bytes or elements per second)")


# mpifl pbs --site: the resources a site's PBS Pro knows (Polaris: the custom system and filesystems resources
# and whole nodes; generic: PBS Pro's built-in ncpus, mpiprocs and ngpus of each chunk)
PBS_SITES = ("polaris", "generic")


def add_pbs_parser(sub: argparse._SubParsersAction) -> None:
    """The ``pbs`` subcommand's options."""
    p = add_subcommand(sub, "pbs", help="write a PBS Pro job script for a config, with a memory check per node")
    add_job_arguments(p, ".pbs")
    p.add_argument("--depth", type=positive_int, default=8, help="cores per rank (Cray PALS --depth)")
    p.add_argument("--walltime", default="01:00:00", type=pbs_walltime, help="#PBS -l walltime (HH:MM:SS, "
                   "above 0)")
    add_stop_before(p, "the walltime", "a timer in the script sends it to mpiexec, which forwards it; PBS's "
                    "SIGKILL comes the queue's kill_delay after its own SIGTERM, at the walltime")
    p.add_argument("--queue", default=None, type=scheduler_name, help="#PBS -q queue (letters, digits and "
                   "_ . - @ : + only). Default with --site polaris: the queue Polaris's limits admit for the job's "
                   "nodes and walltime (debug, debug-scaling, prod or preemptable), and a queue given is checked "
                   "against them; with --site generic: debug")
    p.add_argument("--account", default="MYPROJECT", type=scheduler_name, help="#PBS -A project to charge "
                   "(letters, digits and _ . - @ : + only)")
    p.add_argument("--site", default="polaris", choices=PBS_SITES, help="polaris: each chunk is select=N:system="
                   "SYSTEM, with a filesystems line (Polaris's resources); generic: a plain PBS Pro, each chunk "
                   "asks for its node's ranks' cores, MPI processes and GPUs (select=N:ncpus=RANKS_PER_NODE*DEPTH:"
                   "mpiprocs=RANKS_PER_NODE[:ngpus=GPUS_PER_NODE]), and system and filesystems only when given")
    p.add_argument("--filesystems", type=filesystems, help="#PBS -l filesystems: names of letters, digits and "
                   "_ . -, joined by ':' (default: home:eagle with --site polaris, no line with --site generic)")
    p.add_argument("--system", type=system_name, help="#PBS -l select=N:...:system=SYSTEM (letters, digits and "
                   "_ . - only; default: polaris with --site polaris, none with --site generic)")
    add_gpu_argument(p)
    p.add_argument("--server-alone", action="store_true", help="give the server the first node to itself")
    add_node_arguments(p, "activate this venv (default: --site polaris: none, the conda module instead; --site "
                       "generic: the venv this command runs in, unless --conda-module is given)")
    p.add_argument("--conda-module", type=shell_word("a module's name"),
                   help="the module that provides Python, when no venv is activated (default: "
                   "conda, from /soft/modulefiles, with --site polaris; none with --site generic)")


def add_slurm_parser(sub: argparse._SubParsersAction) -> None:
    """The ``slurm`` subcommand's options."""
    summary = ("write a Slurm batch script for a config, with a memory check per node (the server shares the "
               "first node)")
    p = add_subcommand(sub, "slurm", help=summary, description=summary)
    add_job_arguments(p, ".sbatch")
    p.add_argument("--cpus-per-task", type=positive_int, default=8,
                   help="cores per rank (#SBATCH and srun --cpus-per-task)")
    p.add_argument("--time", default="01:00:00", type=slurm_time, help="#SBATCH --time (HH:MM:SS, or another of "
                   "Slurm's formats: minutes, days-hours, ...)")
    p.add_argument("--partition", default="debug", type=optional_scheduler_name, help="#SBATCH --partition "
                   "(letters, digits and _ . - @ : + only; '': the cluster's default)")
    p.add_argument("--account", default="MYPROJECT", type=optional_scheduler_name, help="#SBATCH --account to "
                   "charge (letters, digits and _ . - @ : + only; '': none)")
    add_stop_before(p, "the time limit", "#SBATCH --signal=TERM@SECONDS; Slurm's SIGKILL comes KillWait, 30 s "
                    "by default, after its own SIGTERM, at the limit")
    p.add_argument("--mem", default="0", type=slurm_memory,
                   help="#SBATCH --mem: memory per node in Slurm's units (a number of MB, or with K, M, G or T); "
                   "0: all of each node's memory (Slurm's special case), so that a cluster's default memory per "
                   "CPU cannot end the job short of what the check counted; a size replaces --node-memory-gb in "
                   "the check; '': no --mem line")
    p.add_argument("--mpi", default=None, type=shell_word("an srun --mpi plugin (pmi2, pmix, ...)"),
                   help="srun --mpi: the process-management interface (PMI) the ranks' MPI "
                   "reads (default: from the MPI that mpi4py finds here: pmi2 for MPICH, PyPI's included, Intel MPI "
                   "and MVAPICH; pmix for Open MPI and Cray MPICH); '': srun's default (MpiDefault, SLURM_MPI_TYPE)")
    p.add_argument("--overcommit", action="store_true", help="let a node's ranks share its CPUs (#SBATCH and srun "
                   "--overcommit: --cpus-per-task is counted once per node, not per rank), e.g. 3 ranks on a "
                   "2-core workstation")
    p.add_argument("--log", default="%x-%j.out", type=log_path, help="#SBATCH --output: the file for the job's "
                   "stdout and stderr (Slurm's filename patterns: job name, job id; no spaces or shell marks)")
    add_gpu_argument(p)
    add_node_arguments(p, "activate this venv (bin/activate) before srun")
