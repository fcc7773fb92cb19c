"""Federated benchmark data in the LEAF layout, from local files (nothing is downloaded).

LEAF (Caldas et al. 2018) ships each split as JSON files with ``users``, ``num_samples`` and
``user_data: {user: {"x": [...], "y": [...]}}``. Every training user becomes one logical
client (users sorted by name), so the partition is the data's own (``data.partition:
natural``); the test files' samples, pooled, are the held-out set.

- FEMNIST-like data: ``x`` rows of numbers (784 become 1 x 28 x 28 images), ``y`` integer labels.
- Shakespeare-like data: ``x`` strings and ``y`` single characters, mapped to ids over LEAF's
  80-character alphabet.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# LEAF's Shakespeare alphabet (models/utils/language_utils.py), as character ids 0..79.
LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def read_split(folder: Path) -> dict[str, dict]:
    """Every user's data in a split folder's JSON files, by user name."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"data.kwargs.path: no LEAF *.json files in {folder}")
    users: dict[str, dict] = {}
    for path in files:
        table = json.loads(path.read_text())
        missing = {"users", "user_data"} - set(table)
        if missing:
            raise ValueError(f"{path}: not a LEAF file (no {', '.join(sorted(missing))})")
        for user in table["users"]:
            users[user] = table["user_data"][user]
    return users


def encode(values: list) -> np.ndarray:
    """Rows of numbers as float32; strings as rows of LEAF alphabet ids, single characters as ids (int64)."""
    if not values or not isinstance(values[0], str):
        return np.asarray(values, dtype=np.float32)
    ids = np.array([[LETTERS.find(ch) for ch in text] for text in values], dtype=np.int64)
    return ids[:, 0] if ids.shape[1] == 1 else ids


def as_inputs(x: np.ndarray) -> torch.Tensor:
    """Inputs as a tensor; 784-wide rows as 1 x 28 x 28 images (FEMNIST)."""
    tensor = torch.from_numpy(x)
    if x.ndim == 2 and x.shape[1] == 784 and x.dtype == np.float32:
        tensor = tensor.reshape(-1, 1, 28, 28)
    return tensor


def leaf(path: str) -> tuple:
    """(x_train, y_train, x_test, y_test, clients) from ``path/train`` and ``path/test``; ``clients`` holds
    each training user's sample indices, users sorted by name."""
    root = Path(path)
    train, test = read_split(root / "train"), read_split(root / "test")
    xs, ys, clients, start = [], [], [], 0
    for user in sorted(train):
        x, y = encode(train[user]["x"]), encode(train[user]["y"])
        xs.append(x)
        ys.append(y)
        clients.append(np.arange(start, start + len(y)))
        start += len(y)
    x_test = np.concatenate([encode(test[u]["x"]) for u in sorted(test)])
    y_test = np.concatenate([encode(test[u]["y"]) for u in sorted(test)])
    return (as_inputs(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys).astype(np.int64)),
            as_inputs(x_test), torch.from_numpy(y_test.astype(np.int64)), clients)
