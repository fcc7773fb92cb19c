"""The shared task for the peer comparison (mpifl, Flower, pfl): data, models, and the harness.

Imported by every framework's script (each in its own virtual environment, so only numpy + torch).
Run as a script it is the harness, stdlib only:

    python task.py measure OUT.json -- CMD...   # run CMD, sample RSS/PSS of its whole process tree
    python task.py table results.json [--header TEXT] RUN.json...   # merge runs, print medians and ratios
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

CLASSES = 62
TASKS = {  # name -> (model, median samples per client); everything else is shared
    "cnn": ("leaf_cnn", 20),
    "mlp100mb": ("big_mlp", 5),
}


def femnist_data(clients: int = 1000, samples: int = 20, sigma: float = 0.5, noise: float = 1.0,
                 scale: float = 2.0, test: int = 2000, seed: int = 0):
    """FEMNIST-shaped synthetic data that can be learned: class c is a fixed random 28 x 28 template
    (standard normal pixels times ``scale``) plus Gaussian noise of std ``noise`` (the LEAF CNN reaches
    65-80% held-out accuracy after 10 FedAvg rounds of 20 clients; chance is 1/62). Returns
    (x_train, y_train, x_test, y_test, writers) as numpy arrays; ``writers[i]`` are client i's
    indices into x_train (lognormal sizes, median ``samples``)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    templates = scale * rng.standard_normal((CLASSES, 1, 28, 28), dtype=np.float32)
    sizes = np.maximum(2, rng.lognormal(np.log(samples), sigma, clients).astype(int))

    def draw(n):
        y = rng.integers(0, CLASSES, n)
        return (templates[y] + noise * rng.standard_normal((n, 1, 28, 28), dtype=np.float32)), y

    x, y = draw(int(sizes.sum()))
    x_test, y_test = draw(test)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    writers = [np.arange(bounds[i], bounds[i + 1]) for i in range(clients)]
    return x, y, x_test, y_test, writers


def leaf_cnn(num_classes: int = CLASSES):
    """LEAF's FEMNIST CNN: conv 5x5 32, pool, conv 5x5 64, pool, dense 512, dense classes (1.69 M)."""
    from torch import nn
    return nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, num_classes))


def big_mlp(num_classes: int = CLASSES):
    """The communication-heavy model: 784 -> 8192 -> 2048 -> 62, 23.3 M parameters (93 MB fp32)."""
    from torch import nn
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 8192), nn.ReLU(), nn.Linear(8192, 2048), nn.ReLU(),
                         nn.Linear(2048, num_classes))


def _nhwc_output(module, inputs, output):
    return output.contiguous(memory_format=__import__("torch").channels_last) if output.dim() == 4 else output


def nhwc_activations(model):
    """Every Conv2d hands on its output in channels_last (NHWC) order: what mpifl's ``model.memory_format:
    channels_last`` does, so the peers can be timed with the same trick."""
    from torch import nn
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(_nhwc_output)
    return model


def build_model(task: str, seed: int = 0):
    import torch
    torch.manual_seed(seed)
    return globals()[TASKS[task][0]]()


def accuracy(model, x, y, batch: int = 500) -> float:
    import torch
    model.eval()
    device = next(model.parameters()).device  # a peer may train on a GPU
    with torch.no_grad():
        correct = sum(int((model(torch.as_tensor(x[i:i + batch]).to(device)).argmax(1).cpu()
                           == torch.as_tensor(y[i:i + batch])).sum()) for i in range(0, len(y), batch))
    return correct / len(y)


def summarize(round_seconds: list[float], acc: float, **extra) -> dict:
    """What every framework's script prints (as ``RESULT {json}``): the median skips round 1."""
    later = round_seconds[1:] or round_seconds
    return {"round_seconds": [round(s, 3) for s in round_seconds],
            "seconds_per_round": round(statistics.median(later), 3), "accuracy": acc, **extra}


# ---- harness (stdlib only) ---------------------------------------------------------------------

def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _proc_bytes(path: str, key: str) -> int:
    """A ``key:  N kB`` line of a /proc file, in bytes (0 once the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss(pid: int) -> int:
    """Resident bytes from /proc/PID/status (VmRSS): kernel counters, read in microseconds."""
    return _proc_bytes(f"/proc/{pid}/status", "VmRSS:")


def _pss(pid: int) -> int:
    """Proportional bytes from /proc/PID/smaps_rollup: the kernel walks the page tables to count them, 10-20 ms
    for a 500 MB process, with the process's memory map locked; hence read less often than RSS."""
    return _proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss:")


def measure(out: str, cmd: list[str], interval: float = 0.2, pss_every: int = 5) -> int:
    """Run ``cmd``; sample every process in its tree (RSS every ``interval`` seconds, PSS every ``pss_every``-th
    sample: reading it costs the measured processes CPU and stalls, more for more and larger processes); save
    peaks and the RESULT line it printed."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = {"sum_rss": 0, "sum_pss": 0, "max_process_rss": 0, "processes": 0}
    lines: list[str] = []
    import threading
    reader = threading.Thread(target=lambda: [lines.append(line) or print(line, end="", flush=True)
                                              for line in proc.stdout])
    reader.start()
    samples = 0
    while proc.poll() is None:
        tree = _tree(proc.pid)
        rss = [_rss(p) for p in tree]
        peak["sum_rss"] = max(peak["sum_rss"], sum(rss))
        peak["max_process_rss"] = max([peak["max_process_rss"]] + rss)
        peak["processes"] = max(peak["processes"], sum(1 for r in rss if r))
        if samples % pss_every == 0:
            peak["sum_pss"] = max(peak["sum_pss"], sum(_pss(p) for p in tree))
        samples += 1
        time.sleep(interval)
    reader.join()
    result = next((json.loads(line.split("RESULT", 1)[1]) for line in reversed(lines) if line.startswith("RESULT")),
                  None)
    record = {"rc": proc.returncode, "wall_seconds": round(time.time() - start, 1),
              **{f"peak_{k}_mib" if k != "processes" else "peak_processes": (v // 2**20 if k != "processes" else v)
                 for k, v in peak.items()}, "result": result}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return proc.returncode


FORMS = {  # framework form (the middle of a run's name) -> what the table calls it, in table order
    "mpifl": "mpifl (2 client ranks + server, 2 groups by cost, per-round placement)",
    "pfl2": "pfl-research, 2 processes (torchrun)",
    "pfl1": "pfl-research, 1 process",
    "mpifl_torchpool": "mpifl, PyTorch's own max-pooling kernel (model.nhwc_pooling: false)",
    "mpifl_nhwc": "mpifl, NHWC activations (model.memory_format: channels_last)",
    "pfl2_nhwc": "pfl-research, 2 processes, NHWC activations (the same hooks)",
    "pfl1_nhwc": "pfl-research, 1 process, NHWC activations (the same hooks)",
    "flower": "Flower (simulation, Ray)",
    "pfl": "pfl-research (torchrun)",
}
TASK_NAMES = {"cnn20": "LEAF CNN (1.69 M), 20 per round", "cnn100": "LEAF CNN, 100 per round",
              "mlp100mb": "93 MB MLP, ~5 samples per client, 20 per round"}


def _split(name: str) -> tuple[str, str, int]:
    """``cnn20-pfl2-r3`` -> ("cnn20", "pfl2", 3); a name without ``-rN`` is repeat 1."""
    m = re.fullmatch(r"(.+?)-([A-Za-z0-9_]+?)(?:-r(\d+))?", name)
    return (m.group(1), m.group(2), int(m.group(3) or 1)) if m else (name, "?", 1)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v, spec: str = ".0f") -> str:
    return "" if v is None else format(v, spec)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else ""


def table(out: str, parts: list[str], header: str | None = None) -> None:
    """Merge the runs into ``out`` (raw data) and print, per task and framework form, the medians over
    the repeats that succeeded, then mpifl's ratios: time to the faster pfl form, memory to pfl with 2
    processes (the same number of client workers as mpifl)."""
    rows = {}
    for path in parts:
        name = os.path.basename(path).removesuffix(".json")
        with open(path) as f:
            rows[name] = json.load(f)
    with open(out, "w") as f:
        json.dump({"_header": header, **rows} if header else rows, f, indent=1)
    groups: dict[str, dict[str, list[tuple[int, dict]]]] = {}
    for name, r in rows.items():
        task_, form, rep = _split(name)
        groups.setdefault(task_, {}).setdefault(form, []).append((rep, r))
    if header:
        print(header)
        print()
    print("| task | framework | s/round (median; min-max) | peak RSS sum (MiB) | peak PSS sum (MiB) "
          "| largest process RSS (MiB) | accuracy | repeats |")
    print("|---|---|---|---|---|---|---|---|")
    stats: dict[str, dict[str, dict]] = {}
    order = list(FORMS)
    for task_ in sorted(groups, key=lambda t: (list(TASK_NAMES).index(t) if t in TASK_NAMES else 99, t)):
        first = True
        for form in sorted(groups[task_], key=lambda f: order.index(f) if f in order else 99):
            runs = sorted(groups[task_][form], key=lambda x: x[0])
            good = [r.get("rc") == 0 and (r.get("result") or {}).get("seconds_per_round") is not None
                    for _, r in runs]
            ok = [r for (_, r), g in zip(runs, good) if g]
            failed = [rep for (rep, _), g in zip(runs, good) if not g]
            times = [r["result"]["seconds_per_round"] for r in ok]
            s = stats.setdefault(task_, {})[form] = {
                "time": _median(times),
                "rss": _median([r.get("peak_sum_rss_mib") for r in ok]),
                "pss": _median([r.get("peak_sum_pss_mib") for r in ok]),
                "max": _median([r.get("peak_max_process_rss_mib") for r in ok]),
                "acc": _median([r["result"].get("accuracy") for r in ok]),
            }
            spread = f" ({min(times):.3f}-{max(times):.3f})" if len(times) > 1 else ""
            count = f"{len(ok)}" + (f" (failed: r{', r'.join(map(str, failed))})" if failed else "")
            print(f"| {TASK_NAMES.get(task_, task_) if first else ''} | {FORMS.get(form, form)} "
                  f"| {_fmt(s['time'], '.3f') or 'FAILED'}{spread} | {_fmt(s['rss'])} | {_fmt(s['pss'])} "
                  f"| {_fmt(s['max'])} | {_fmt(s['acc'], '.3f')} | {count} |")
            first = False
    ratios = []
    any_flower = any("flower" in forms for forms in stats.values())
    for task_, forms in stats.items():
        # each mpifl form against pfl's forms with the same model code (mpifl's default pools by the NHWC kernel:
        # also against pfl with NHWC activations, and mpifl with PyTorch's pooling against pfl as given)
        for mine, theirs in (("mpifl", ""), ("mpifl_torchpool", ""), ("mpifl", "_nhwc"), ("mpifl_nhwc", "_nhwc")):
            m = forms.get(mine)
            pfl = {f: forms[f] for f in (f"pfl2{theirs}", f"pfl1{theirs}") if f in forms and forms[f]["time"]}
            if not m or m["time"] is None or not pfl:
                continue
            best = min(pfl, key=lambda f: pfl[f]["time"])
            two = forms.get(f"pfl2{theirs}") or {}
            flower = (forms.get("flower") or {}).get("time")
            ratios.append(f"| {TASK_NAMES.get(task_, task_)} | {mine} / {best} "
                          f"| {_ratio(m['time'], pfl[best]['time'])} "
                          f"| {_ratio(m['rss'], two.get('rss'))} | {_ratio(m['pss'], two.get('pss'))} |"
                          + (f" {_ratio(m['time'], flower)} |" if any_flower else ""))
    if ratios:
        print()
        print("| task | forms compared | mpifl / pfl-best s/round | mpifl / pfl-2 peak RSS sum "
              "| mpifl / pfl-2 peak PSS sum |" + (" mpifl / Flower s/round |" if any_flower else ""))
        print("|---|---|---|---|---|" + ("---|" if any_flower else ""))
        print("\n".join(ratios))


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        sys.exit(measure(sys.argv[2], sys.argv[sys.argv.index("--") + 1:]))
    args = sys.argv[3:]
    header = None
    if args[:1] == ["--header"]:
        header, args = args[1], args[2:]
    table(sys.argv[2], args, header)
