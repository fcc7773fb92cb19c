"""HDF5 model files: one dataset per tensor under /model/<name>, published atomically.

bf16 has no HDF5/numpy type: it is stored as its raw 16-bit patterns (uint16) with the
dataset attribute ``dtype = "bfloat16"``; every dataset carries its torch dtype name.
"""
from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch

from .flat import DTYPES, FlatModel

_STORED_AS = {"bfloat16": np.uint16}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a tensor; bf16 as its raw uint16 bits."""
    name = str(tensor.dtype).replace("torch.", "")
    if name in _STORED_AS:
        return tensor.view(torch.int16).numpy().view(_STORED_AS[name])
    return tensor.numpy()


def save_model(path: str | Path, flat: FlatModel, attrs: dict) -> Path:
    """Write the model to ``path`` via a temporary file, fsync, then atomic rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with h5py.File(tmp, "w") as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            f.attrs["spec_hash"] = flat.spec.hash
            group = f.create_group("model")
            for (name, tensor), entry in zip(flat.tensors(), flat.spec.entries):
                ds = group.create_dataset(name, data=to_numpy(tensor))
                ds.attrs["dtype"] = entry.dtype
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(f"could not save the model to {str(path)!r}: {err}") from err
    return path


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every /model/<name> dataset back as a torch tensor of its recorded dtype."""
    out = {}
    with h5py.File(path, "r") as f:
        if "model" not in f:
            raise ValueError(f"{path}: no /model group; not an mpifl model file")
        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset):
                data = torch.from_numpy(np.array(obj))
                dtype = obj.attrs.get("dtype", "")
                out[name] = data.view(DTYPES[dtype]) if dtype in _STORED_AS else data
        f["model"].visititems(visit)
    return out
