"""Write the example's tiny LEAF-layout dataset (data/train, data/test), deterministically.

``python -m examples.natural_partition.make_data [FOLDER]`` rewrites the shipped files (the same
bytes every time). Each of 8 writers draws 16 features per sample around 5 class centres, shifted
by the writer's own style, with its own mix of classes and its own number of samples: a natural,
non-IID split, as LEAF's FEMNIST writers are, small enough to ship.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

WRITERS, FEATURES, CLASSES = 8, 16, 5
HERE = Path(__file__).parent / "data"


def writer_samples(rng: np.random.Generator, centres: np.ndarray, style: np.ndarray, count: int) -> dict:
    """``count`` samples of one writer: its class mix (Dirichlet), its style shift, unit noise."""
    mix = rng.dirichlet(np.full(CLASSES, 0.7))
    y = rng.choice(CLASSES, size=count, p=mix)
    x = centres[y] + style + rng.normal(0.0, 1.0, size=(count, FEATURES))
    return {"x": np.round(x, 2).tolist(), "y": y.tolist()}


def write(folder: Path = HERE, seed: int = 0) -> None:
    """LEAF's layout: per split, JSON files of ``users``, ``num_samples`` and ``user_data``, users spread over two."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, size=(CLASSES, FEATURES))
    users = [f"writer_{i:02d}" for i in range(WRITERS)]
    styles = {u: rng.normal(0.0, 0.6, size=FEATURES) for u in users}
    sizes = {u: int(rng.integers(20, 60)) for u in users}
    for split in ("train", "test"):
        data = {u: writer_samples(rng, centres, styles[u], sizes[u] if split == "train" else 12) for u in users}
        (folder / split).mkdir(parents=True, exist_ok=True)
        for part, names in enumerate((users[:WRITERS // 2], users[WRITERS // 2:])):
            table = {"users": names, "num_samples": [len(data[u]["y"]) for u in names],
                     "user_data": {u: data[u] for u in names}}
            path = folder / split / f"all_data_{part}_niid_0_keep_0_{split}_9.json"
            path.write_text(json.dumps(table, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
