"""memray on every rank (one ``rankNNNNN.bin`` each) and the per-rank report (needs 'profile', 'plot')."""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from mpifl.units import MIB

RANK_FILE = "rank{rank:05d}.bin"  # the one template for per-rank profile names


def _memray() -> ModuleType:
    try:
        import memray
    except ImportError:
        raise SystemExit("memray profiling needs memray: pip install 'mpifl[profile]'") from None
    return memray


@contextlib.contextmanager
def tracked(directory: str | Path | None, rank: int, native: bool = False) -> Iterator[None]:
    """Run the body under memray, writing DIR/rankNNNNN.bin; a no-op when DIR is None."""
    if directory is None:
        yield
        return
    memray = _memray()
    path = Path(directory) / RANK_FILE.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with memray.Tracker(path, native_traces=native, memory_interval_ms=10):
        yield


def summarize(profile: Path, top: int = 3) -> dict:
    """Peak RSS (sampled), peak heap and the largest allocation sites at the heap's high-water mark."""
    memray = _memray()
    reader = memray.FileReader(profile)
    try:
        snaps = list(reader.get_memory_snapshots())
        records = sorted(reader.get_high_watermark_allocation_records(merge_threads=True), key=lambda r: -r.size)
        sites = []
        for rec in records[:top]:
            frame = next(iter(rec.stack_trace(max_stacks=1)), None)
            where = f"{frame[0]} ({Path(frame[1]).name}:{frame[2]})" if frame else "?"
            sites.append((where, rec.size))
        rank = re.search(r"(\d+)", profile.stem)
        assert rank is not None, f"{profile.name}: mpifl names its profiles rankNNNNN.bin"
        return {
            "rank": int(rank.group(1)),
            "peak_rss_bytes": max((s.rss for s in snaps), default=0),
            "peak_heap_bytes": reader.metadata.peak_memory,
            "snapshots": [(s.time, s.rss, s.heap) for s in snaps],
            "top_sites": sites,
        }
    finally:
        reader.close()


def readable_summaries(profiles: list[Path]) -> tuple[list[dict], list[str]]:
    """The summaries of the profiles memray can read, and a warning (printed) naming each it cannot: a rank
    killed while it profiled (SIGKILL, a scheduler's walltime) leaves its file torn, and the others still say
    what they held."""
    summaries, unread = [], []
    for profile in profiles:
        try:
            summaries.append({**summarize(profile), "path": profile})
        except (OSError, RuntimeError) as err:
            unread.append(f"{profile.name}: {err}")
            print(f"mpifl profile-report: warning: {profile} cannot be read, left out (a rank killed while it "
                  f"profiled leaves its file torn): {err}", file=sys.stderr)
    return summaries, unread


def write_profile_report(directory: str | Path, flamegraph: bool = False) -> Path:
    """Peak table (markdown) and one memory-over-time PNG per rank; optional flamegraph HTML."""
    directory = Path(directory)
    if directory.is_file():
        raise SystemExit(f"mpifl profile-report: {directory} is a file: give the folder mpifl run --memray wrote "
                         f"the ranks' profiles to ({directory.parent})")
    if not directory.is_dir():
        raise SystemExit(f"mpifl profile-report: {directory} does not exist (the folder given to mpifl run --memray)")
    profiles = sorted(directory.glob("rank*.bin"))
    if not profiles:
        raise SystemExit(f"mpifl profile-report: no rank*.bin profiles in {directory}")
    summaries, unread = readable_summaries(profiles)
    if not summaries:
        raise SystemExit(f"mpifl profile-report: none of the {len(profiles)} profiles in {directory} can be read "
                         f"({'; '.join(unread)})")
    profiles = [s["path"] for s in summaries]  # the readable ones, for the flamegraphs
    lines = ["| rank | role | peak RSS (MiB) | peak heap (MiB) | largest allocation sites at the heap peak |",
             "|---|---|---|---|---|"]
    for s in summaries:
        sites = "; ".join(f"{w}: {n / MIB:.0f} MiB" for w, n in s["top_sites"])
        role = "server" if s["rank"] == 0 else "client"
        lines.append(f"| {s['rank']} | {role} | {s['peak_rss_bytes'] / MIB:.0f} | {s['peak_heap_bytes'] / MIB:.0f} "
                     f"| {sites} |")
    table = directory / "peaks.md"
    table.write_text("\n".join(lines) + "\n")
    _plot(directory, summaries)
    if flamegraph:
        for p in profiles:
            subprocess.run([sys.executable, "-m", "memray", "flamegraph", "-f", "-o",
                            str(p.with_suffix(".html")), str(p)], check=True, capture_output=True)
    print("\n".join(lines))
    return table


def _plot(directory: Path, summaries: list[dict]) -> None:
    from mpifl.cli.report import pyplot

    plt = pyplot("profile-report")
    for s in summaries:
        if not s["snapshots"]:
            continue
        t0 = s["snapshots"][0][0]
        times = [(t - t0) / 1000 for t, _, _ in s["snapshots"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(times, [r / MIB for _, r, _ in s["snapshots"]], label="RSS")
        ax.plot(times, [h / MIB for _, _, h in s["snapshots"]], label="heap (tracked allocations)")
        role = "server" if s["rank"] == 0 else "client"
        ax.set_title(f"rank {s['rank']} ({role}): memory over time, peak RSS {s['peak_rss_bytes'] / MIB:.0f} MiB")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / f"rank{s['rank']:05d}-memory.png", dpi=110)
        plt.close(fig)
