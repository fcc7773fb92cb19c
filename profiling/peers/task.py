"""The shared task for the peer comparison (mpifl, Flower, pfl): data, models, and the harness.

Imported by every framework's script (each in its own virtual environment, so only numpy + torch).
Run as a script it is the harness, stdlib only:

    python task.py measure OUT.json -- CMD...   # run CMD, sample RSS/PSS of its whole process tree
    python task.py table results.json ...        # merge measurements, print a Markdown table
"""
from __future__ import annotations

import json
import os
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


def build_model(task: str, seed: int = 0):
    import torch
    torch.manual_seed(seed)
    return globals()[TASKS[task][0]]()


def accuracy(model, x, y, batch: int = 500) -> float:
    import torch
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(torch.as_tensor(x[i:i + batch])).argmax(1) == torch.as_tensor(y[i:i + batch])).sum())
                      for i in range(0, len(y), batch))
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


def _mem(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes from /proc/PID/smaps_rollup."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def measure(out: str, cmd: list[str], interval: float = 0.2) -> int:
    """Run ``cmd``; sample every process in its tree; save peaks and the RESULT line it printed."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = {"sum_rss": 0, "sum_pss": 0, "max_process_rss": 0, "processes": 0}
    lines: list[str] = []
    import threading
    reader = threading.Thread(target=lambda: [lines.append(line) or print(line, end="", flush=True)
                                              for line in proc.stdout])
    reader.start()
    while proc.poll() is None:
        mems = [_mem(p) for p in _tree(proc.pid)]
        peak["sum_rss"] = max(peak["sum_rss"], sum(m[0] for m in mems))
        peak["sum_pss"] = max(peak["sum_pss"], sum(m[1] for m in mems))
        peak["max_process_rss"] = max([peak["max_process_rss"]] + [m[0] for m in mems])
        peak["processes"] = max(peak["processes"], sum(1 for m in mems if m[0]))
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


def table(out: str, parts: list[str]) -> None:
    rows = {}
    for path in parts:
        name = os.path.basename(path).removesuffix(".json")
        with open(path) as f:
            rows[name] = json.load(f)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print("| run | s/round (median, rounds 2..) | peak RSS sum (MiB) | peak PSS sum (MiB) | largest process RSS (MiB) "
          "| processes | final accuracy | wall (s) | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        res = r.get("result") or {}
        acc = res.get("accuracy")
        per_round = res.get("seconds_per_round", f"FAILED (rc {r.get('rc')})")
        print(f"| {name} | {per_round} | {r.get('peak_sum_rss_mib')} "
              f"| {r.get('peak_sum_pss_mib')} | {r.get('peak_max_process_rss_mib')} | {r.get('peak_processes')} "
              f"| {'' if acc is None else f'{acc:.3f}'} | {r.get('wall_seconds')} | {res.get('note', '')} |")


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        sys.exit(measure(sys.argv[2], sys.argv[sys.argv.index("--") + 1:]))
    table(sys.argv[2], sys.argv[3:])
